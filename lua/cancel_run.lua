#!lua
--[[ cancel_run: cancel a run. A run that is not executing (queued, waiting) is settled
cancelled at once (a later delivery or wake of it is a no-op; its open questions are closed);
a running one is flagged, and its execution stops at the next step boundary or lease renewal
and settles itself cancelled.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] lease zset      <tag>:leases
KEYS[3] dispatch zset   <tag>:dispatch
KEYS[4] output stream   <tag>:out:<run id>
KEYS[5] finished zset   <tag>:finished
KEYS[6] waits zset      <tag>:waits
KEYS[7] asks hash       <tag>:asks:<run id>
KEYS[8] feed zset       <tag>:feed
ARGV[1] run_id
ARGV[2] event           JSON data of the output event (the final one when settled now)
ARGV[3] request_id      a resend with the same id answers what the first send answered
Returns:
  {"cancelled"}           settled cancelled by this call
  {"requested"}           the run is executing; it will stop and settle itself
  {"settled", status}     already finished; nothing written
  {"missing"}             no such run
  {"corrupt", reason}     an index key of the bucket holds another type; nothing written
Writes: HSET/HINCRBY KEYS[1]; ZREM KEYS[2], KEYS[3]; XADD KEYS[4]; ZADD KEYS[5]; ZREM KEYS[6];
  HSET KEYS[7]; ZREM KEYS[8]
]]
local run, leases, dispatch, out, finished, waits, asks, feed = KEYS[1], KEYS[2], KEYS[3],
  KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local run_id, req = ARGV[1], ARGV[3]
local r = redis.call('HMGET', run, 'status', 'attempt', 'cancel', 'cancel_req', 'cancel_outcome',
  'retention_ms')
if not r[1] then return {'missing'} end
if r[4] == req and r[5] then return {r[5]} end  -- a resend: the first send's answer
if r[1] == 'succeeded' or r[1] == 'failed' or r[1] == 'cancelled' then
  return {'settled', r[1]}
end
if r[1] == 'running' then
  if r[3] == '1' then return {'requested'} end  -- asked already
  redis.call('HSET', run, 'cancel', '1', 'cancel_req', req, 'cancel_outcome', 'requested')
  redis.call('XADD', out, '*', 't', 'cancel_requested', 'a', r[2], 'd', ARGV[2])
  return {'requested'}
end
-- Settling writes several keys and Redis does not roll back a failed script: check them first.
for k, want in pairs({[leases] = 'zset', [dispatch] = 'zset', [finished] = 'zset',
                      [out] = 'stream', [waits] = 'zset', [asks] = 'hash', [feed] = 'zset'}) do
  local kind = redis.call('TYPE', k).ok
  if kind ~= 'none' and kind ~= want then return {'corrupt', k .. ' holds a ' .. kind} end
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', run, 'status', 'cancelled', 'cancel', '1', 'finished_ms', now_ms,
  'cancel_req', req, 'cancel_outcome', 'cancelled')
redis.call('HDEL', run, 'note', 'wait_reason', 'wait_for', 'wait_since', 'wake_at')
redis.call('HINCRBY', run, 'epoch', 1)  -- fences anything still holding the old epoch
redis.call('ZREM', leases, run_id)
redis.call('ZREM', dispatch, run_id)
redis.call('ZREM', waits, run_id)
local fields = redis.call('HGETALL', asks)
for j = 1, #fields, 2 do
  if fields[j + 1] == 'open' and string.sub(fields[j], -6) == '|state' then
    local key = string.sub(fields[j], 1, -7)
    redis.call('HSET', asks, fields[j], 'cancelled')
    redis.call('HINCRBY', asks, key .. '|rev', 1)
    redis.call('ZREM', feed, run_id .. '|' .. key)
  end
end
redis.call('ZREM', feed, run_id .. '|!failed_step')  -- paused on a failed step: not any more
redis.call('ZADD', finished, now_ms + (tonumber(r[6] or '') or 604800000), run_id)
redis.call('XADD', out, '*', 't', 'final', 'a', r[2], 'd', ARGV[2])
return {'cancelled'}
