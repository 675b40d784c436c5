#!lua
--[[ claim_record: insert a record if its key is absent, and list it (insert-if-absent).
KEYS[1] record hash     <tag>:rec:<kind>:<id>  (or <tag>:jrn:<journal>:<id> for journal entries)
KEYS[2] listing zset    <tag>:idx:<kind>       member <id>, score = creation time (server ms)
KEYS[3] owner set       <tag>:own:<owner>      (ignored when ARGV[4] is '')
KEYS[4] request marker  <tag>:req:<request id> remembers a created record's request for a
                        minute, so a resend after a purge does not create it again
ARGV[1] id              the listing member
ARGV[2] doc             the record's JSON text, stored verbatim
ARGV[3] request_id      unique per logical call; a resend with the same id answers "ok" again
ARGV[4] owner           agent id that owns the record, or ''
ARGV[5] marker_ms       how long the request marker lives
Returns:
  {"ok", created_ms}          this call (or an earlier send of it) created the record
  {"exists", doc}             another caller's record is there; doc is its stored text
Writes (only when absent): HSET KEYS[1] {doc, req[, own]}; ZADD KEYS[2]; SADD KEYS[3];
  SET KEYS[4] PX
]]
local rec, listing, owned, marker = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, doc, req, owner = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

local first = redis.call('GET', marker)
if first then return {'ok', tonumber(first)} end  -- a resend of the call that created it
local existing = redis.call('HMGET', rec, 'doc', 'req')
if existing[1] then
  if existing[2] == req then  -- a resend after the marker expired
    return {'ok', tonumber(redis.call('ZSCORE', listing, id) or '0')}
  end
  return {'exists', existing[1]}
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if owner ~= '' then
  redis.call('HSET', rec, 'doc', doc, 'req', req, 'own', owner)
  redis.call('SADD', owned, rec .. '|' .. listing .. '|' .. id)
else
  redis.call('HSET', rec, 'doc', doc, 'req', req)
end
redis.call('ZADD', listing, now_ms, id)
redis.call('SET', marker, now_ms, 'PX', ARGV[5])
return {'ok', now_ms}
