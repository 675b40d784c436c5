#!lua
--[[ cas_entry: compare-and-set a workspace entry on its updated_at.
KEYS[1] entry hash      <tag>:ws:<workspace>:<key>   {doc, updated_at, req, own}
KEYS[2] entry listing   <tag>:wsidx:<workspace>      zset of entry keys
KEYS[3] owner set       <tag>:own:<owner>            (ignored when ARGV[5] is '')
KEYS[4] request marker  <tag>:req:<request id>       remembers an applied request for a
                        minute, so a resend answers "ok" even after another writer moved on
ARGV[1] expected        the updated_at the caller read; '' means the entry must be absent
ARGV[2] updated_at      the new updated_at; must differ from ARGV[1]
ARGV[3] doc             the new JSON text, stored verbatim
ARGV[4] request_id      a resend with the same id answers "ok" again
ARGV[5] owner           set when the entry is created, or ''
ARGV[6] key             the entry key (listing member)
ARGV[7] marker_ms       how long the request marker lives
Returns:
  {"ok"}                      written by this call (or an earlier send of it)
  {"conflict", current}       the entry's updated_at is `current` ('' = absent); nothing written
Writes (only for a fresh "ok"): HSET KEYS[1]; ZADD NX KEYS[2]; SADD KEYS[3]; SET KEYS[4] PX
]]
local entry, listing, owned, marker = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local expected, updated_at, doc, req, owner, key =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]

if updated_at == expected then
  return redis.error_reply('cas_entry: the new updated_at must differ from the expected one')
end
if redis.call('EXISTS', marker) == 1 then return {'ok'} end  -- a resend of an applied call
local cur = redis.call('HMGET', entry, 'updated_at', 'req')
if cur[1] and cur[1] == updated_at and cur[2] == req then return {'ok'} end
if expected == '' then
  if cur[1] then return {'conflict', cur[1]} end
elseif cur[1] ~= expected then
  return {'conflict', cur[1] or ''}
end

local created = not cur[1]
redis.call('HSET', entry, 'doc', doc, 'updated_at', updated_at, 'req', req)
redis.call('SET', marker, '1', 'PX', ARGV[7])
if created then
  local t = redis.call('TIME')
  redis.call('ZADD', listing, 'NX', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), key)
  if owner ~= '' then
    redis.call('HSET', entry, 'own', owner)
    redis.call('SADD', owned, entry .. '|' .. listing .. '|' .. key)
  end
end
return {'ok'}
