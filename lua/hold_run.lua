#!lua
--[[ hold_run: a delivery found its run's concurrency limit full before the run started
(flow control, marbles_rq/engine/flowctl.py). Hand the run back, unharmed and not started:
queued again as a new delivery that the controller's dispatch check enqueues after a short
delay that grows with the run's holds (jittered by the caller). A hold does not count
against the run's max deliveries (as defer_run).
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] dispatch zset   <tag>:dispatch
KEYS[3] output stream   <tag>:out:<run id>
ARGV[1] run_id
ARGV[2] attempt         the delivery that found the limit full
ARGV[3] base_ms         the first hold waits base_ms; each further one 1.5 times longer ...
ARGV[4] cap_ms          ... up to cap_ms
ARGV[5] jitter          a factor from the caller (0.75 .. 1.25): runs held together spread
ARGV[6] note            why the run waits (status shows it): "concurrency limit k=v 5/5"
ARGV[7] event           JSON data of the "held" output event (written when the note changes,
                        so a long wait is one line, not one per retry)
Returns:
  {"ok", attempt, delay_ms}   queued again as delivery <attempt>, checked after delay_ms
  {"moved", status}           the run is not queued under this delivery (it started, was
                              cancelled, settled, parked, or a newer delivery exists): nothing
                              written
Writes (only for "ok"): HSET/HINCRBY KEYS[1]; ZADD KEYS[2]; XADD KEYS[3] when the note changed
]]
local run, dispatch, out = KEYS[1], KEYS[2], KEYS[3]
local run_id, attempt = ARGV[1], tonumber(ARGV[2])
local r = redis.pcall('HMGET', run, 'status', 'attempt', 'note', 'holds')
if r.err then return {'moved', 'corrupt'} end
if r[1] ~= 'queued' or tonumber(r[2] or '') ~= attempt then return {'moved', r[1] or ''} end
local holds = tonumber(r[4] or '0') or 0
local delay = math.min(tonumber(ARGV[3]) * 1.5 ^ math.min(holds, 30), tonumber(ARGV[4]))
delay = math.floor(delay * tonumber(ARGV[5]))
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local next_attempt = attempt + 1
redis.call('HSET', run, 'attempt', next_attempt, 'note', ARGV[6], 'holds', holds + 1)
redis.call('HINCRBY', run, 'deferred', 1)
redis.call('ZADD', dispatch, now_ms + delay, run_id)
if r[3] ~= ARGV[6] then
  redis.call('XADD', out, '*', 't', 'held', 'a', next_attempt, 'd', ARGV[7])
end
return {'ok', next_attempt, delay}
