#!lua
--[[ hand_over_compensation: an execution stopped by a cancel that asked for compensation
(cancel_compensate) hands the run to a new delivery that runs the compensations: the phase
marker the cancel left in the run hash goes into the ledger (unless a marker is there: a run
already compensating after a failure keeps its own), the cancel flag is lifted (the new
delivery's writes must not stop on it), and the run is queued again. The hand-over does not
count against max deliveries.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
KEYS[3] lease zset      <tag>:leases
KEYS[4] dispatch zset   <tag>:dispatch
KEYS[5] output stream   <tag>:out:<run id>
ARGV[1] epoch           the execution's fence
ARGV[2] run_id
ARGV[3] grace_ms        the new delivery's dispatch check comes due after this long
ARGV[4] event           JSON data of the "compensating" output event
Returns:
  {"ok", attempt, queue}  queued as delivery <attempt>; the caller may enqueue it
  {"plain"}               no compensation was asked; nothing written (settle it cancelled)
  {"stale", epoch}        a newer execution owns the run; nothing written
  {"settled", status}     the run is finished (or not running); nothing written
Writes (only for "ok"): HSETNX KEYS[2]; HSET/HINCRBY/HDEL KEYS[1]; ZREM KEYS[3]; ZADD KEYS[4];
  XADD KEYS[5]
]]
local run, steps, leases, dispatch, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local run_id = ARGV[2]
local r = redis.call('HMGET', run, 'epoch', 'status', 'attempt', 'compensate', 'queue')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
if not r[4] then return {'plain'} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSETNX', steps, '|compensate', r[4])
local attempt = tonumber(r[3]) + 1
redis.call('HSET', run, 'status', 'queued', 'attempt', attempt)
redis.call('HINCRBY', run, 'deferred', 1)
redis.call('HINCRBY', run, 'epoch', 1)  -- fences the stopped execution
redis.call('HDEL', run, 'worker', 'cancel', 'compensate')
redis.call('ZREM', leases, run_id)
redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[3]), run_id)
redis.call('XADD', out, '*', 't', 'compensating', 'a', attempt, 'd', ARGV[4])
return {'ok', attempt, r[5]}
