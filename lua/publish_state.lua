#!lua
--[[ publish_state: a run body publishes a value under a key, readable from outside at any
time (last write wins per key). The ledger entry at the call's position and the value are
written together, so a replay (which finds the entry and publishes nothing) can never lose
the value nor publish it twice, whatever process dies between this call and the next.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
KEYS[3] lease zset      <tag>:leases
KEYS[4] output stream   <tag>:out:<run id>
KEYS[5] published hash  <tag>:pub:<run id>        key -> JSON value
ARGV[1] epoch           the execution's fence
ARGV[2] run_id
ARGV[3] seq             this execution's write number; one already applied is not rewritten
ARGV[4] step_key        the ledger key of the publish call
ARGV[5] record          StepRecord JSON (name "|publish")
ARGV[6] key             the published key
ARGV[7] value           its JSON value
ARGV[8] event           JSON data of the "published" output event
Returns:
  {"ok"}
  {"cancelled"}           written, but cancel was requested: the body must stop
  {"paused"}              written, but a pause was asked: the body must park
  {"stale", epoch}        a newer execution owns the run, or this one's lease expired;
                          nothing written
  {"settled", status}     the run is not running; nothing written
Writes (a fresh ok/cancelled/paused): HSET KEYS[1] wseq; HSET KEYS[2]; HSET KEYS[5]; XADD KEYS[4]
]]
local run, steps, leases, out, published = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local r = redis.call('HMGET', run, 'epoch', 'status', 'cancel', 'attempt', 'wseq', 'pause')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
local t = redis.call('TIME')
if tonumber(redis.call('ZSCORE', leases, ARGV[2]) or '0') <=
    tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then
  return {'stale', tonumber(r[1])}
end
if tonumber(ARGV[3]) > tonumber(r[5] or '0') then  -- not a resend of an applied write
  redis.call('HSET', run, 'wseq', ARGV[3])
  redis.call('HSET', steps, ARGV[4], ARGV[5])
  redis.call('HSET', published, ARGV[6], ARGV[7])
  redis.call('XADD', out, '*', 't', 'published', 'a', r[4], 'd', ARGV[8])
end
if r[3] == '1' then return {'cancelled'} end
if r[6] == '1' then return {'paused'} end
return {'ok'}
