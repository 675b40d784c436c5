#!lua
--[[ move_schedule: the controller moves a schedule's cursor without firing (not due yet after
all, a slot skipped by the overlap policy or outside the catch-up window, a slot buffered),
and records a finished run's outcome in the history.
KEYS[1] schedule hash   <tag>:sched:<key>
KEYS[2] due zset        <tag>:sched_due
KEYS[3] bucket fence    <tag>:ctl                {epoch}: the newest controller seen here
ARGV[1] key             the schedule key
ARGV[2] ctl_epoch       the calling controller's lease epoch
ARGV[3] expected        the cursor the caller read
ARGV[4] cursor          the new cursor
ARGV[5] due_ms          the new due score
ARGV[6] buffered        '' keeps it; '-' clears it; else the buffered occurrence's nominal ms
ARGV[7] skipped         '1': a slot was skipped (counted in the history)
ARGV[8] finish_run      a finished run whose outcome goes into the history ('' = none)
ARGV[9] last_finish     its finish time (ms)
ARGV[10] last_status    its status
Returns:
  {"ok"}                  moved
  {"moved", cursor}       the cursor is not where the caller read it; nothing written
  {"paused"}              the schedule is paused: its due entry is dropped, nothing else
  {"missing"}             the schedule is not registered; nothing written
  {"fenced", epoch}       a newer controller acts on this bucket; nothing written
Writes: HSET KEYS[1] (+ HINCRBY skipped); ZADD/ZREM KEYS[2]; HSET KEYS[3]
]]
local state, due, fence = KEYS[1], KEYS[2], KEYS[3]
local key, ctl_epoch = ARGV[1], tonumber(ARGV[2])

local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0  -- garbage reads as 0
if seen > ctl_epoch then return {'fenced', seen} end
local s = redis.call('HMGET', state, 'registered_ms', 'cursor', 'paused')
if not s[1] then return {'missing'} end
if s[3] == '1' then
  redis.call('ZREM', due, key)
  return {'paused'}
end
if (s[2] or '') ~= ARGV[3] then return {'moved', s[2] or ''} end

if seen < ctl_epoch then redis.call('HSET', fence, 'epoch', ctl_epoch) end
redis.call('HSET', state, 'cursor', ARGV[4])
if ARGV[6] == '-' then
  redis.call('HDEL', state, 'buffered')
elseif ARGV[6] ~= '' then
  redis.call('HSET', state, 'buffered', ARGV[6])
end
if ARGV[7] == '1' then redis.call('HINCRBY', state, 'skipped', 1) end
if ARGV[8] ~= '' then
  redis.call('HSET', state, 'fin_run', ARGV[8], 'last_finish', ARGV[9], 'last_status', ARGV[10])
end
redis.call('ZADD', due, ARGV[5], key)
return {'ok'}
