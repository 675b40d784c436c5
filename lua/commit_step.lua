#!lua
--[[ commit_step: record a step attempt's outcome in the ledger (and extend the lease if asked). Steps
whose start was deferred (a step with no retries starts without a round trip of its own)
have their start written here too, before the outcome: a step costs this one script.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
KEYS[3] lease zset      <tag>:leases
KEYS[4] output stream   <tag>:out:<run id>
ARGV[1] epoch           the execution's fence
ARGV[2] step_key
ARGV[3] record          StepRecord JSON (succeeded with its result, or failed with its error)
ARGV[4] event_type      step_succeeded | step_failed | step_retry
ARGV[5] event           JSON data of the output event
ARGV[6] run_id
ARGV[7] ttl_ms          the lease is extended to now + ttl_ms; 0 = not extended (the
                        execution's watchdog renewed it lately)
ARGV[8] seq             this execution's write number; one already applied is not rewritten
  then any number of (step_key, record, event) triples: deferred starts (StepRecord JSON
  with status running, "step_started" event data), written first, in order
Returns:
  {"ok"}
  {"cancelled"}           written, but cancel was requested: the body must stop
  {"paused"}              written, but a pause was asked: the body must park
  {"timed_out"}           the run's deadline passed: the outcome is not written (the
                          deferred starts are, so the step shows as interrupted); the body
                          must stop. A resend after the deadline answers this too.
  {"stale", epoch}        a newer execution owns the run, or this one's lease expired;
                          nothing written
  {"settled", status}     the run is finished; nothing written
Writes (a fresh ok/cancelled/paused): HSET KEYS[1] wseq; one HSET KEYS[2] (the deferred
  starts and the outcome; a start of the outcome's own step is overwritten in the same
  command, as it would be by the next); XADD KEYS[4] per start and for the outcome; ZADD XX
  KEYS[3] if ARGV[7] > 0 (from TIME). A fresh timed_out: the deferred starts and wseq
  only.
]]
local run, steps, leases, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local r = redis.call('HMGET', run, 'epoch', 'status', 'cancel', 'attempt', 'wseq', 'deadline_ms',
  'pause')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
-- A step that ends after the run's deadline is not recorded: the run fails RunTimeout, even
-- when the lease watchdog that would have said so is gone.
local deadline = tonumber(r[6] or '0')
local late = false
if deadline > 0 then
  local t = redis.call('TIME')
  late = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > deadline
end
-- A lease that expired ends the execution's writes: a frozen execution that thaws commits
-- nothing (renew_attempt fences it at its next renewal; the reaper may have freed its
-- concurrency slot for another run already).
local t = redis.call('TIME')
if tonumber(redis.call('ZSCORE', leases, ARGV[6]) or '0') <=
    tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then
  return {'stale', tonumber(r[1])}
end
if tonumber(ARGV[8]) <= tonumber(r[5] or '0') then  -- a resend
  if late then return {'timed_out'} end
  if r[3] == '1' then return {'cancelled'} end
  if r[7] == '1' then return {'paused'} end
  return {'ok'}
end
redis.call('HSET', run, 'wseq', ARGV[8])
local records = {}
for i = 9, #ARGV - 2, 3 do
  records[#records + 1] = ARGV[i]
  records[#records + 1] = ARGV[i + 1]
end
if not late then
  records[#records + 1] = ARGV[2]
  records[#records + 1] = ARGV[3]
end
for i = 1, #records, 2000 do  -- one command unless there are over a thousand records
  redis.call('HSET', steps, unpack(records, i, math.min(i + 1999, #records)))
end
for i = 9, #ARGV - 2, 3 do
  redis.call('XADD', out, '*', 't', 'step_started', 'a', r[4], 'd', ARGV[i + 2])
end
if late then return {'timed_out'} end
redis.call('XADD', out, '*', 't', ARGV[4], 'a', r[4], 'd', ARGV[5])
if tonumber(ARGV[7]) > 0 then
  -- TIME, not the event's id: after the server clock stepped back a stream's ids run ahead
  -- of it, and a lease set from one would outlive a killed execution by that much.
  local t = redis.call('TIME')
  redis.call('ZADD', leases, 'XX', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    + tonumber(ARGV[7]), ARGV[6])
end
if r[3] == '1' then return {'cancelled'} end
if r[7] == '1' then return {'paused'} end
return {'ok'}
