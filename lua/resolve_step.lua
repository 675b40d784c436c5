#!lua
--[[ resolve_step: a person acts on a run paused on a step whose tries ran out (reason
failed_step): retry (the step's ledger entry is written back running, with no tries and
perhaps an input patch) or fail (written back failed, with the reason). Either way the run is
woken as a new delivery that replays the ledger, where the step now runs again or raises.
The entry is compared first: an entry changed since the caller read it (another retry or
fail won) is refused.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
KEYS[3] output stream   <tag>:out:<run id>
KEYS[4] waits zset      <tag>:waits
KEYS[5] dispatch zset   <tag>:dispatch
KEYS[6] feed zset       <tag>:feed                "<run id>|!failed_step" is removed
ARGV[1] run_id
ARGV[2] action          retry | fail (the name of the output event: step_retried |
                        step_given_up)
ARGV[3] step key        the ledger key of the paused step
ARGV[4] expected        the entry's text as the caller read it
ARGV[5] entry           its new text
ARGV[6] epoch           the run's epoch as the caller read it
ARGV[7] event           JSON data of the output event
ARGV[8] grace_ms        the woken run's dispatch check comes due after this long
Returns:
  {"woken", attempt, queue}   queued as <attempt>; the caller enqueues it
  {"conflict"}                the run or the entry changed since it was read; nothing written
  {"not_waiting", status}     the run is not waiting; nothing written
  {"settled", status}         finished; nothing written
  {"missing"}                 no such run
Writes: HSET/HINCRBY/HDEL KEYS[1]; HSET KEYS[2]; XADD KEYS[3]; ZREM KEYS[4]; ZADD KEYS[5];
  ZREM KEYS[6]
]]
local run, steps, out, waits, dispatch, feed = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6]
local run_id = ARGV[1]
local r = redis.pcall('HMGET', run, 'status', 'attempt', 'epoch', 'queue')
if r.err or not r[1] then return {'missing'} end
if r[1] == 'succeeded' or r[1] == 'failed' or r[1] == 'cancelled' then
  return {'settled', r[1]}
end
if r[1] ~= 'waiting' then return {'not_waiting', r[1]} end
if (r[3] or '0') ~= ARGV[6] or redis.call('HGET', steps, ARGV[3]) ~= ARGV[4] then
  return {'conflict'}
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', steps, ARGV[3], ARGV[5])
-- A wake is a delivery that does not count against max deliveries (counted with deferrals).
local attempt = tonumber(r[2]) + 1
redis.call('HSET', run, 'status', 'queued', 'attempt', attempt)
redis.call('HINCRBY', run, 'deferred', 1)
redis.call('HINCRBY', run, 'resumptions', 1)
-- Acting on the step is acting on the run: a pause asked while it waited is lifted too.
redis.call('HDEL', run, 'wait_reason', 'wait_for', 'wait_since', 'wake_at', 'wake_pending',
  'pause')
redis.call('ZREM', waits, run_id)
redis.call('ZREM', feed, run_id .. '|!failed_step')
redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[8]), run_id)
local kind = ARGV[2] == 'retry' and 'step_retried' or 'step_given_up'
redis.call('XADD', out, '*', 't', kind, 'a', r[2], 'd', ARGV[7])
redis.call('XADD', out, '*', 't', 'woken', 'a', attempt, 'd', '{"cause":"' .. ARGV[2] .. '"}')
return {'woken', attempt, r[4]}
