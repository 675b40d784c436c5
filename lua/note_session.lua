#!lua
--[[ note_session: a run body opened a session: the ledger entry at the call's position (a
replay returns the same session id) and the session id in the run's set of sessions (what
the controller's pruning releases when the run goes), written together, before the session
itself is opened (another slot on a cluster: lua/open_session.lua), so no session ever has
an owner its run does not know about.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
KEYS[3] lease zset      <tag>:leases
KEYS[4] run sessions    <tag>:runses:<run id>    set of session ids
ARGV[1] epoch           the execution's fence
ARGV[2] run_id
ARGV[3] seq             this execution's write number; one already applied is not rewritten
ARGV[4] step_key        the ledger key of the call
ARGV[5] record          StepRecord JSON (name "|session")
ARGV[6] session_id
Returns:
  {"ok"}
  {"cancelled"}           written, but cancel was requested: the body must stop
  {"paused"}              written, but a pause was asked: the body must park
  {"stale", epoch}        a newer execution owns the run, or this one's lease expired;
                          nothing written
  {"settled", status}     the run is not running; nothing written
Writes (a fresh ok/cancelled/paused): HSET KEYS[1] wseq; HSET KEYS[2]; SADD KEYS[4]
]]
local run, steps, leases, sessions = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local r = redis.call('HMGET', run, 'epoch', 'status', 'cancel', 'attempt', 'wseq', 'pause')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
local t = redis.call('TIME')
if tonumber(redis.call('ZSCORE', leases, ARGV[2]) or '0') <=
    tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then
  return {'stale', tonumber(r[1])}
end
if tonumber(ARGV[3]) > tonumber(r[5] or '0') then  -- not a resend of an applied write
  redis.call('HSET', run, 'wseq', ARGV[3])
  redis.call('HSET', steps, ARGV[4], ARGV[5])
  redis.call('SADD', sessions, ARGV[6])
end
if r[3] == '1' then return {'cancelled'} end
if r[6] == '1' then return {'paused'} end
return {'ok'}
