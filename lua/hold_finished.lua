#!lua
--[[ hold_finished: keep a finished run past its retention because its parent still needs it:
a child run whose parent has not finished (the parent reads the child's outcome when it
gathers, which may be long after the child finished). The controller reads the parent's
status first (another bucket, so another script) and holds the child; a later pass prunes it
once the parent has finished or is gone. A finished run never runs again, so a parent seen
finished never needs its child again: the check and this hold need not be one atomic step.
KEYS[1] finished zset   <tag>:finished           run id -> when it may be pruned (server ms)
ARGV[1] run_id
ARGV[2] hold_ms         when the controller looks at it again, from now
Returns:
  {"ok", due_ms}        held: it comes due for pruning again at due_ms (server ms)
  {"not_due"}           not in KEYS[1] (pruned meanwhile) or not due yet; nothing written
Writes (only for "ok"): ZADD XX KEYS[1]
]]
local finished, run_id = KEYS[1], ARGV[1]
local due = redis.call('ZSCORE', finished, run_id)
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if not due or tonumber(due) > now_ms then return {'not_due'} end
local until_ms = now_ms + tonumber(ARGV[2])
redis.call('ZADD', finished, 'XX', until_ms, run_id)
return {'ok', until_ms}
