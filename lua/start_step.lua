#!lua
--[[ start_step: record that a step (key "<path>#<position>") starts an attempt.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
KEYS[3] output stream   <tag>:out:<run id>
ARGV[1] epoch           the execution's fence
ARGV[2] step_key
ARGV[3] record          StepRecord JSON (status running, attempts so far)
ARGV[4] event           JSON data of the "step_started" output event
ARGV[5] seq             this execution's write number; one already applied answers "ok"
Returns:
  {"ok"}
  {"stale", epoch}        a newer execution owns the run; nothing written
  {"settled", status}     the run is finished; nothing written
  {"cancelled"}           cancel was requested; nothing written, the body must stop
  {"timed_out"}           the run's deadline passed; nothing written, the body must stop
  {"paused"}              a pause was asked; nothing written, the body must park
Writes (only for a fresh "ok"): HSET KEYS[2]; XADD KEYS[3]; HSET KEYS[1] wseq
]]
local run, steps, out = KEYS[1], KEYS[2], KEYS[3]
local r = redis.call('HMGET', run, 'epoch', 'status', 'cancel', 'attempt', 'wseq', 'deadline_ms',
  'pause')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
if tonumber(ARGV[5]) <= tonumber(r[5] or '0') then return {'ok'} end  -- a resend
if r[3] == '1' then return {'cancelled'} end
if r[7] == '1' then return {'paused'} end
local deadline = tonumber(r[6] or '0')
if deadline > 0 then
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > deadline then
    return {'timed_out'}
  end
end
redis.call('HSET', run, 'wseq', ARGV[5])
redis.call('HSET', steps, ARGV[2], ARGV[3])
redis.call('XADD', out, '*', 't', 'step_started', 'a', r[4], 'd', ARGV[4])
return {'ok'}
