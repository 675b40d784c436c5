#!lua
--[[ raise_fence: a newly elected controller claims a bucket before it acts anywhere, so a
paused ex-leader that wakes has every write it still sends refused in every bucket, not
only in those the new leader happened to write to.
KEYS[1] bucket fence    <tag>:ctl                {epoch}: the newest controller seen here
ARGV[1] ctl_epoch       the new controller's lease epoch
Returns:
  {"ok", seen}            the fence now holds ctl_epoch (or already did); seen: what it held
                          before (0 if nothing). A fresh epoch that finds itself there was
                          written by another epoch counter (lanes split or merged)
  {"fenced", epoch}       a newer controller claimed the bucket already; nothing written
Writes (only when raised): HSET KEYS[1]
]]
local fence, ctl_epoch = KEYS[1], tonumber(ARGV[1])
local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0
if seen > ctl_epoch then return {'fenced', seen} end
if seen < ctl_epoch then redis.call('HSET', fence, 'epoch', ctl_epoch) end
return {'ok', seen}
