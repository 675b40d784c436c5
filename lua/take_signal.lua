#!lua
--[[ take_signal: an execution takes the next `count` signals of a name into its ledger, at
the position of the call that asked (wait_for_signal takes one, signals() every one it
found, perhaps none). Compare-and-set on how many were taken: a signal enters the ledger
exactly once, and a replay reads it from there, never from the buffer again. Fenced by the
execution's epoch and lease, as every write of an execution.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] signals hash    <tag>:sig:<run id>
KEYS[3] ledger hash     <tag>:steps:<run id>
KEYS[4] lease zset      <tag>:leases
KEYS[5] output stream   <tag>:out:<run id>
ARGV[1] epoch           the execution's fence
ARGV[2] run_id
ARGV[3] name            the signals' name
ARGV[4] taken           how many of the name the caller read as taken already
ARGV[5] count           how many it takes now: sequence numbers taken+1 .. taken+count
ARGV[6] step_key        the ledger key of the call
ARGV[7] record          StepRecord JSON holding the signals' payloads (or the timeout)
ARGV[8] event           JSON data of the "signal_taken" output event
ARGV[9] seq             this execution's write number; one already applied is not rewritten
Returns:
  {"ok"}                  recorded (or a resend of a call that was)
  {"conflict", taken, sent}  the count moved since the caller read it (another branch took
                          some), or fewer were sent; nothing written: read again
  {"cancelled"}           cancel was requested: nothing written, the body must stop
  {"paused"}              a pause was asked: nothing written, the body must park
  {"stale", epoch}        a newer execution owns the run, or this one's lease expired
  {"settled", status}     the run is finished; nothing written
Writes (only for a fresh "ok"): HSET KEYS[3]; HSET/HDEL KEYS[2]; HSET KEYS[1] wseq;
  XADD KEYS[5]
]]
local run, sigs, steps, leases, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local name = ARGV[3]
local r = redis.call('HMGET', run, 'epoch', 'status', 'cancel', 'attempt', 'wseq', 'pause')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
local t = redis.call('TIME')
if tonumber(redis.call('ZSCORE', leases, ARGV[2]) or '0') <=
    tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then
  return {'stale', tonumber(r[1])}
end
if tonumber(ARGV[9]) <= tonumber(r[5] or '0') then return {'ok'} end  -- a resend
if r[3] == '1' then return {'cancelled'} end
if r[6] == '1' then return {'paused'} end
local s = redis.call('HMGET', sigs, name .. '|n', name .. '|c')
local sent, taken = tonumber(s[1] or '0'), tonumber(s[2] or '0')
local from, count = tonumber(ARGV[4]), tonumber(ARGV[5])
if taken ~= from or from + count > sent then return {'conflict', taken, sent} end
redis.call('HSET', steps, ARGV[6], ARGV[7])
redis.call('HSET', run, 'wseq', ARGV[9])
if count > 0 then
  redis.call('HSET', sigs, name .. '|c', from + count)
  for seq = from + 1, from + count do
    redis.call('HDEL', sigs, name .. '|' .. seq, name .. '|' .. seq .. '|at')
  end
end
redis.call('XADD', out, '*', 't', 'signal_taken', 'a', r[4], 'd', ARGV[8])
return {'ok'}
