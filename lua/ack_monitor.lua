#!lua
--[[ ack_monitor: a monitor's pending launch was started (or its target is gone): drop it.
KEYS[1] monitor hash    <tag>:mon:<monitor key>
KEYS[2] bucket fence    <tag>:ctl
ARGV[1] ctl_epoch       the caller's controller epoch; 0 for a manual roll (not fenced)
ARGV[2] launch_run      the run id of the launch handed out
ARGV[3] error           why it was dropped unstarted; '' when it started
Returns:
  {"ok"}                dropped
  {"gone"}              no such launch is pending (acknowledged already); nothing written
  {"fenced", epoch}     a newer controller acts on this bucket; nothing written
Writes: HDEL KEYS[1] pending, pending_run; HSET KEYS[1] last_error (+ HINCRBY rev);
  HSET KEYS[2] epoch (a controller)
]]
local mon, fence = KEYS[1], KEYS[2]
local ctl_epoch = tonumber(ARGV[1])

local seen = 0
if ctl_epoch > 0 then
  seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0  -- garbage reads as 0
  if seen > ctl_epoch then return {'fenced', seen} end
end
if redis.call('HGET', mon, 'pending_run') ~= ARGV[2] then return {'gone'} end
if ctl_epoch > seen then redis.call('HSET', fence, 'epoch', ctl_epoch) end
redis.call('HDEL', mon, 'pending', 'pending_run')
redis.call('HSET', mon, 'last_error', ARGV[3])
redis.call('HINCRBY', mon, 'rev', 1)
return {'ok'}
