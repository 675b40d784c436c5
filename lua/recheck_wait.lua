#!lua
--[[ recheck_wait: the controller's waiting duty looks at a run waiting for a child again
later (its child had not settled): moves the run's entry in the waits index to at_ms, but
only while the run is still in the very wait the duty read. A run that was woken and parked
again meanwhile (a new epoch: every start and park raises it) has its own entry, written by
that park; moving it would push its timer late.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] waits zset      <tag>:waits               run id -> when the controller looks at it
KEYS[3] bucket fence    <tag>:ctl                 {epoch}: the newest controller seen here
ARGV[1] run_id
ARGV[2] ctl_epoch       the calling controller's lease epoch
ARGV[3] epoch           the run's epoch when the duty read it
ARGV[4] at_ms           when to look again (server ms): the caller's choice, no later than
                        the run's timer and question timeouts it read (for a child wait
                        wake_at is only the first look, so it is no bound here)
Returns:
  {"ok", at}              moved to <at>
  {"moved_on"}            not that wait any more (woken, parked again, finished, missing):
                          nothing written
  {"fenced", epoch}       a newer controller acts on this bucket; nothing written
Writes (only for "ok"): ZADD XX KEYS[2]
]]
local run, waits, fence = KEYS[1], KEYS[2], KEYS[3]
local run_id = ARGV[1]
local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0
if seen > tonumber(ARGV[2]) then return {'fenced', seen} end
local r = redis.pcall('HMGET', run, 'status', 'epoch')
if r.err or r[1] ~= 'waiting' or r[2] ~= ARGV[3] then return {'moved_on'} end
redis.call('ZADD', waits, 'XX', ARGV[4], run_id)
return {'ok', ARGV[4]}
