#!lua
--[[ note_child: a running parent notes in its ledger the child it is about to record, before
the child exists (start_child). A cancel of the parent walks its ledger for children, so a
child recorded after this note is found by that walk whenever it comes; and a parent that is
cancelled (or asked to), paused, past its deadline, finished, or a stale execution of it
records no child at all. The note is the ledger entry of the start_child call, status
running, whose result names the child; the commit after the child's record rewrites it
succeeded. No output event: the commit writes "child_started".
KEYS[1] run hash        <tag>:run:<parent id>
KEYS[2] ledger hash     <tag>:steps:<parent id>
ARGV[1] epoch           the parent execution's fence
ARGV[2] seq             this execution's write number; one already applied answers "ok"
ARGV[3] step_key        the start_child call's ledger key ("<path>.|child#<n>")
ARGV[4] record          its StepRecord JSON (status running, result {"id", "workflow"})
Returns:
  {"ok"}                  noted: the caller records the child now
  {"stale", epoch}        a newer execution owns the parent; nothing written
  {"settled", status}     the parent is finished (or not running); nothing written
  {"cancelled"}           cancel was requested: nothing written, the body stops
  {"paused"}              a pause was asked: nothing written, the body parks
  {"timed_out"}           the parent's deadline passed: nothing written, the body stops
Writes (only for a fresh "ok"): HSET KEYS[1] wseq; HSET KEYS[2]
]]
local run, steps = KEYS[1], KEYS[2]
local r = redis.call('HMGET', run, 'epoch', 'status', 'cancel', 'wseq', 'deadline_ms', 'pause')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
if tonumber(ARGV[2]) <= tonumber(r[4] or '0') then return {'ok'} end  -- a resend
if r[3] == '1' then return {'cancelled'} end
if r[6] == '1' then return {'paused'} end
local deadline = tonumber(r[5] or '0')
if deadline > 0 then
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > deadline then
    return {'timed_out'}
  end
end
redis.call('HSET', run, 'wseq', ARGV[2])
redis.call('HSET', steps, ARGV[3], ARGV[4])
return {'ok'}
