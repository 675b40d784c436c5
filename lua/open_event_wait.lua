#!lua
--[[ open_event_wait: a run body reaches a wait for an event. Opens the wait (its start and
timeout on the server clock, kept for every replay), or answers how it ended: the event
delivered to it (deliver_event), or its timeout, recorded here once it has passed, so an
event delivered later cannot be consumed by a wait that gave up.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
KEYS[3] event inbox     <tag>:evin:<run id>
KEYS[4] output stream   <tag>:out:<run id>
ARGV[1] epoch           the execution's fence
ARGV[2] wait_key        the ledger key of the wait
ARGV[3] timeout_ms      how long the wait lasts once opened; 0 = no timeout
ARGV[4] timeout_record  StepRecord JSON recorded if the timeout has passed (status timed_out)
ARGV[5] event           JSON data of the "event_wait_timed_out" output event
Returns:
  {"open", since_ms, due_ms}   open: nothing received yet (due 0 = no timeout)
  {"done", record}             ended: the StepRecord recorded for it (received or timed out)
  {"timed_out", record}        its timeout passed just now: recorded by this call
  {"stale", epoch}             a newer execution owns the run; nothing written
  {"settled", status}          the run is not running; nothing written
Writes: HSET KEYS[3] (opening, or the timeout); HSET KEYS[2], XADD KEYS[4] (the timeout)
]]
local run, steps, inbox, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local key = ARGV[2]
local r = redis.call('HMGET', run, 'epoch', 'status', 'attempt')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
local done = redis.call('HGET', inbox, key)
if done then return {'done', done} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local w = redis.call('HMGET', inbox, key .. '|since', key .. '|due')
local since, due = tonumber(w[1] or ''), tonumber(w[2] or '')
if not since then
  since = now_ms
  due = 0
  if tonumber(ARGV[3]) > 0 then due = now_ms + tonumber(ARGV[3]) end
  redis.call('HSET', inbox, key .. '|since', since, key .. '|due', due)
end
if due > 0 and now_ms >= due then
  redis.call('HSET', inbox, key, ARGV[4])
  redis.call('HSET', steps, key, ARGV[4])
  redis.call('XADD', out, '*', 't', 'event_wait_timed_out', 'a', r[3], 'd', ARGV[5])
  return {'timed_out', ARGV[4]}
end
return {'open', since, due}
