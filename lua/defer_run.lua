#!lua
--[[ defer_run: an execution's worker does not know the run's workflow (a rolling deploy, a
worker with other sources). Hand the run back, unharmed: queued again as a new delivery
that the controller enqueues after a delay, for a worker that knows it. A deferral does
not count against the run's max deliveries.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] lease zset      <tag>:leases
KEYS[3] dispatch zset   <tag>:dispatch
KEYS[4] output stream   <tag>:out:<run id>
ARGV[1] epoch           the execution's fence
ARGV[2] run_id
ARGV[3] delay_ms        the controller enqueues the new delivery after this long
ARGV[4] note            why the run waits (shown by status)
ARGV[5] event           JSON data of the "deferred" output event
Returns:
  {"ok", attempt}         queued again as delivery <attempt>
  {"stale", epoch}        a newer execution owns the run; nothing written
  {"settled", status}     the run is finished; nothing written
Writes (only for "ok"): HSET/HINCRBY KEYS[1]; ZREM KEYS[2]; ZADD KEYS[3]; XADD KEYS[4]
]]
local run, leases, dispatch, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local run_id = ARGV[2]
local r = redis.call('HMGET', run, 'epoch', 'status', 'attempt')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local attempt = tonumber(r[3]) + 1
redis.call('HSET', run, 'status', 'queued', 'attempt', attempt, 'note', ARGV[4])
redis.call('HINCRBY', run, 'deferred', 1)
redis.call('HINCRBY', run, 'epoch', 1)
redis.call('HDEL', run, 'worker')
redis.call('ZREM', leases, run_id)
redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[3]), run_id)
redis.call('XADD', out, '*', 't', 'deferred', 'a', attempt, 'd', ARGV[5])
return {'ok', attempt}
