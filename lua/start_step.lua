#!lua
--[[ start_step: record that steps (key "<path>#<position>") start an attempt.
A step with no retries normally has its start written by its commit_step (one round trip
per step); this script writes a start up front ("check": a step with retries, or one
started when the execution's last look at cancel, pause and the deadline is not fresh), or
late ("late": steps still running after a short delay, or running while the execution
writes something else, so status and watch show them; their start event carries the
time they really started).
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
KEYS[3] output stream   <tag>:out:<run id>
ARGV[1] epoch           the execution's fence
ARGV[2] seq             this execution's write number; one already applied answers "ok"
ARGV[3] mode            check | late
ARGV[4] step_key        the (first) step
ARGV[5] record          its StepRecord JSON (status running, attempts so far)
ARGV[6] event           JSON data of its "step_started" output event
  in "late" mode more (step_key, record, event) triples may follow, written in order
Returns:
  {"ok"}
  {"stale", epoch}        a newer execution owns the run; nothing written
  {"settled", status}     the run is finished; nothing written
  {"cancelled"}           "check" only: cancel was requested; nothing written, the body stops
  {"timed_out"}           "check" only: the deadline passed; nothing written, the body stops
  {"paused"}              "check" only: a pause was asked; nothing written, the body parks
  ("late" steps are already running: they are written whatever cancel, pause or the
  deadline say, and the commit that ends them answers for those)
Writes (only for a fresh "ok"): HSET KEYS[2]; XADD KEYS[3]; HSET KEYS[1] wseq
]]
local run, steps, out = KEYS[1], KEYS[2], KEYS[3]
local r = redis.call('HMGET', run, 'epoch', 'status', 'cancel', 'attempt', 'wseq', 'deadline_ms',
  'pause')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
if tonumber(ARGV[2]) <= tonumber(r[5] or '0') then return {'ok'} end  -- a resend
if ARGV[3] == 'check' then
  if r[3] == '1' then return {'cancelled'} end
  if r[7] == '1' then return {'paused'} end
  local deadline = tonumber(r[6] or '0')
  if deadline > 0 then
    local t = redis.call('TIME')
    if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > deadline then
      return {'timed_out'}
    end
  end
end
redis.call('HSET', run, 'wseq', ARGV[2])
local function put(key, record, event)
  redis.call('HSET', steps, key, record)
  redis.call('XADD', out, '*', 't', 'step_started', 'a', r[4], 'd', event)
end
put(ARGV[4], ARGV[5], ARGV[6])
for i = 7, #ARGV - 2, 3 do put(ARGV[i], ARGV[i + 1], ARGV[i + 2]) end
return {'ok'}
