#!lua
--[[ append_session: append one message to a session's transcript, atomically: its position
is the session's message count plus one, so any number of concurrent appenders each keep
their message, in the order the server applied them. An idempotency key makes a resend (a
retry after a lost reply, a re-executed run body) return the first append's position and
append nothing; keys are kept for the session's lifetime. An append without a key still
carries a request id (a 60 s marker), so the client's own resend after a dropped connection
appends nothing twice either.
KEYS[1] session hash    <tag>:ses:<id>       doc, n, last_ms, keep
KEYS[2] messages        <tag>:sesmsg:<id>    stream; entry id 0-<position>, fields t (server
                                              ms), m (the stored message), k (its key)
KEYS[3] keys hash       <tag>:seskey:<id>    idempotency key -> position
KEYS[4] owners set      <tag>:sesown:<id>    run ids that used it (retention)
KEYS[5] request marker  <tag>:req:<request id>   position, expires after ARGV[5] ms
ARGV[1] message         the stored message (payload codec output: JSON text or envelope)
ARGV[2] key             idempotency key ("" for none)
ARGV[3] owner           the run id appending ("" outside a run)
ARGV[4] request_id      used when ARGV[2] is "" (its marker is KEYS[5])
ARGV[5] marker_ms       how long the request marker is kept
Returns:
  {"ok", position, at_ms}
  {"duplicate", position, at_ms}  a message with that key was appended before; nothing written
  {"missing"}             no such session (never created, or deleted); nothing written
  {"corrupt"}             its document cannot be decoded; nothing written
Writes (ok): HINCRBY KEYS[1] n; HSET KEYS[1] last_ms; XADD KEYS[2]; HSET KEYS[3] (key) or
  SET KEYS[5] PX ARGV[5] (no key); SADD KEYS[4] (owner)
]]
local ses, messages, idem, owners, marker = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local doc = redis.call('HGET', ses, 'doc')
if not doc then return {'missing'} end
local ok, decoded = pcall(cjson.decode, doc)
if not ok or type(decoded) ~= 'table' then return {'corrupt'} end
local seen
if ARGV[2] ~= '' then seen = redis.call('HGET', idem, ARGV[2]) else seen = redis.call('GET', marker) end
if seen then
  local entry = redis.call('XRANGE', messages, '0-' .. seen, '0-' .. seen)
  local at = 0
  if entry[1] then at = tonumber(entry[1][2][2]) end
  return {'duplicate', tonumber(seen), at}
end
local n = redis.call('HINCRBY', ses, 'n', 1)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('XADD', messages, '0-' .. n, 't', now, 'm', ARGV[1], 'k', ARGV[2])
redis.call('HSET', ses, 'last_ms', now)
if ARGV[2] ~= '' then
  redis.call('HSET', idem, ARGV[2], n)
else
  redis.call('SET', marker, n, 'PX', ARGV[5])
end
if ARGV[3] ~= '' then redis.call('SADD', owners, ARGV[3]) end
return {'ok', n, now}
