#!lua
--[[ append_output: add a line to a running run's output (stream.write, log lines).
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] output stream   <tag>:out:<run id>
ARGV[1] epoch           the execution's fence
ARGV[2] type            output | log
ARGV[3] data            JSON data of the event
ARGV[4] seq             this execution's write number; one already applied answers "ok"
Returns:
  {"ok"}
  {"stale", epoch}        a newer execution owns the run; nothing written
  {"settled", status}     the run is finished; nothing written
Writes (only for a fresh "ok"): HSET KEYS[1] wseq; XADD KEYS[2]
]]
local run, out = KEYS[1], KEYS[2]
local r = redis.call('HMGET', run, 'epoch', 'status', 'attempt', 'wseq')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
if tonumber(ARGV[4]) <= tonumber(r[4] or '0') then return {'ok'} end  -- a resend
redis.call('HSET', run, 'wseq', ARGV[4])
redis.call('XADD', out, '*', 't', ARGV[2], 'a', r[3], 'd', ARGV[3])
return {'ok'}
