#!lua
--[[ retire_schedule: the controller stops looking at a schedule its source no longer declares
(orphaned): its due entry goes; its state and history stay for `marbles-rq schedules`.
KEYS[1] due zset        <tag>:sched_due
KEYS[2] bucket fence    <tag>:ctl                {epoch}: the newest controller seen here
ARGV[1] key             the schedule key
ARGV[2] ctl_epoch       the calling controller's lease epoch
Returns:
  {"ok"}                  no longer due
  {"fenced", epoch}       a newer controller acts on this bucket; nothing written
Writes: ZREM KEYS[1]; HSET KEYS[2]
]]
local due, fence = KEYS[1], KEYS[2]
local ctl_epoch = tonumber(ARGV[2])
local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0  -- garbage reads as 0
if seen > ctl_epoch then return {'fenced', seen} end
if seen < ctl_epoch then redis.call('HSET', fence, 'epoch', ctl_epoch) end
redis.call('ZREM', due, ARGV[1])
return {'ok'}
