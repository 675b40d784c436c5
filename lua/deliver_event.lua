#!lua
--[[ deliver_event: an inbound event ends a run's open wait for it: recorded in the ledger at
the wait's position (and in the run's event inbox), and the run woken if it is parked. A run
consumes an event at most once, whichever of its waits matched it.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
KEYS[3] event inbox     <tag>:evin:<run id>
KEYS[4] output stream   <tag>:out:<run id>
KEYS[5] waits zset      <tag>:waits
KEYS[6] dispatch zset   <tag>:dispatch
ARGV[1] run_id
ARGV[2] wait_key        the ledger key of the wait
ARGV[3] record          StepRecord JSON (status received, the event as its result)
ARGV[4] event_key       the event's stable key
ARGV[5] epoch           '' from outside (the sender); the execution's epoch when the run takes
                        an event itself (found in the lookback window): not woken then
ARGV[6] grace_ms        a woken run's dispatch check comes due after this long
ARGV[7] event           JSON data of the "event_received" output event
ARGV[8] woken           JSON data of the "woken" output event
Returns:
  {"woken", attempt, queue}  delivered; the run was parked and is queued as <attempt>: the
                             caller enqueues that delivery
  {"pending"}                delivered; the run is executing: it requeues itself when it parks
  {"paused"}                 delivered; the run is paused: resume wakes it
  {"taken_now"}              delivered to the calling execution (ARGV[5] given)
  {"taken"}                  the wait had ended already (another event, or its timeout)
  {"consumed"}               the run consumed this event before; its wait stays open
  {"not_open"}               the run has no such open wait
  {"stale"}                  ARGV[5] given and the run is not that execution's any more
  {"idle", status}           the run is finished or missing; nothing written
Writes (delivered): HSET KEYS[3], HSET KEYS[2], XADD KEYS[4]; woken: HSET/HINCRBY/HDEL KEYS[1],
  ZREM KEYS[5], ZADD KEYS[6], XADD KEYS[4]; pending: HSET KEYS[1] wake_pending
]]
local run, steps, inbox, out, waits, dispatch = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6]
local run_id, key = ARGV[1], ARGV[2]
local r = redis.pcall('HMGET', run, 'status', 'epoch', 'attempt', 'pause', 'queue')
if r.err then return {'idle', 'corrupt'} end
if r[1] ~= 'running' and r[1] ~= 'waiting' then return {'idle', r[1] or 'missing'} end
if ARGV[5] ~= '' and (r[2] ~= ARGV[5] or r[1] ~= 'running') then return {'stale'} end
if redis.call('HEXISTS', inbox, key) == 1 then return {'taken'} end
if redis.call('HEXISTS', inbox, key .. '|since') == 0 then return {'not_open'} end
if redis.call('HSETNX', inbox, 'seen|' .. ARGV[4], key) == 0 then return {'consumed'} end
redis.call('HSET', inbox, key, ARGV[3])
redis.call('HSET', steps, key, ARGV[3])
redis.call('XADD', out, '*', 't', 'event_received', 'a', r[3], 'd', ARGV[7])
if ARGV[5] ~= '' then return {'taken_now'} end
if r[1] == 'running' then
  -- It executes: parking (on this wait or any other) sends it round again to read it.
  redis.call('HSET', run, 'wake_pending', '1')
  return {'pending'}
end
if r[4] == '1' then return {'paused'} end
-- A wake is a delivery that does not count against max deliveries (counted with deferrals).
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local attempt = tonumber(r[3]) + 1
redis.call('HSET', run, 'status', 'queued', 'attempt', attempt)
redis.call('HINCRBY', run, 'deferred', 1)
redis.call('HINCRBY', run, 'resumptions', 1)
redis.call('HDEL', run, 'wait_reason', 'wait_for', 'wait_since', 'wake_at', 'wake_pending')
redis.call('ZREM', waits, run_id)
redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[6]), run_id)
redis.call('XADD', out, '*', 't', 'woken', 'a', attempt, 'd', ARGV[8])
return {'woken', attempt, r[5]}
