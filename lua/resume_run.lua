#!lua
--[[ resume_run: lift a run's pause. A parked run is woken (a new delivery replays the
ledger and parks again on whatever it still waits for); a run that had not parked yet
carries on.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] output stream   <tag>:out:<run id>
KEYS[3] waits zset      <tag>:waits
KEYS[4] dispatch zset   <tag>:dispatch
ARGV[1] run_id
ARGV[2] event           JSON data of the "resumed" output event
ARGV[3] grace_ms        the woken run's dispatch check comes due after this long
Returns:
  {"woken", attempt, queue}   it was parked: queued as <attempt>; the caller enqueues it
  {"resumed"}                 it had not parked yet: the pause is lifted
  {"not_paused"}              nothing to resume; nothing written
  {"settled", status}         finished; nothing written
  {"missing"}                 no such run
Writes: HSET/HINCRBY/HDEL KEYS[1]; XADD KEYS[2]; ZREM KEYS[3]; ZADD KEYS[4]
]]
local run, out, waits, dispatch = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local run_id = ARGV[1]
local r = redis.pcall('HMGET', run, 'status', 'attempt', 'pause', 'queue')
if r.err or not r[1] then return {'missing'} end
if r[1] == 'succeeded' or r[1] == 'failed' or r[1] == 'cancelled' then
  return {'settled', r[1]}
end
if r[3] ~= '1' then return {'not_paused'} end
redis.call('HDEL', run, 'pause')
redis.call('XADD', out, '*', 't', 'resumed', 'a', r[2], 'd', ARGV[2])
if r[1] ~= 'waiting' then return {'resumed'} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- A wake is a delivery that does not count against max deliveries (counted with deferrals).
local attempt = tonumber(r[2]) + 1
redis.call('HSET', run, 'status', 'queued', 'attempt', attempt)
redis.call('HINCRBY', run, 'deferred', 1)
redis.call('HINCRBY', run, 'resumptions', 1)  -- status shows them apart
redis.call('HDEL', run, 'wait_reason', 'wait_for', 'wait_since', 'wake_at', 'wake_pending')
redis.call('ZREM', waits, run_id)
redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[3]), run_id)
redis.call('XADD', out, '*', 't', 'woken', 'a', attempt, 'd', '{"cause":"resume"}')
return {'woken', attempt, r[4]}
