#!lua
--[[ release_session: a run that used a session is being pruned: it is no longer an owner,
and a session left with no owner (and not kept by a client) goes, with its transcript.
Idempotent: the controller's pruning calls it again after a kill -9 at any point.
KEYS[1] session hash    <tag>:ses:<id>
KEYS[2] messages        <tag>:sesmsg:<id>
KEYS[3] keys hash       <tag>:seskey:<id>
KEYS[4] owners set      <tag>:sesown:<id>
KEYS[5] listing zset    <tag>:idx:ses
ARGV[1] id              the session id
ARGV[2] owner           the run id released
Returns:
  {"kept", owners_left}   still used by other runs, or kept by a client (owners_left 0)
  {"deleted"}             it had no owner left: every key of it deleted
  {"missing"}             no such session (released before); nothing written
Writes: SREM KEYS[4]; deleted: DEL KEYS[1..4], ZREM KEYS[5]
]]
local ses, messages, idem, owners, listing = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
redis.call('SREM', owners, ARGV[2])
if redis.call('EXISTS', ses) == 0 then
  redis.call('DEL', messages, idem, owners)
  redis.call('ZREM', listing, ARGV[1])
  return {'missing'}
end
local left = redis.call('SCARD', owners)
if left > 0 or redis.call('HGET', ses, 'keep') == '1' then return {'kept', left} end
redis.call('DEL', ses, messages, idem, owners)
redis.call('ZREM', listing, ARGV[1])
return {'deleted'}
