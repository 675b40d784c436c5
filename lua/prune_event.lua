#!lua
--[[ prune_event: remove an event past its retention, unless it is still pending.
KEYS[1] event hash      <tag>:evt:<event key>
KEYS[2] event listing   <tag>:evidx
KEYS[3] bucket fence    <tag>:ctl
ARGV[1] event_key
ARGV[2] ctl_epoch       the calling controller's lease epoch
ARGV[3] cutoff_ms       events received at or before this (server ms) may go
Returns:
  {"ok"}                removed (or already gone: its listing entry is dropped)
  {"kept", state}       still pending, or received after the cutoff; nothing written
  {"fenced", epoch}     a newer controller acts on this bucket; nothing written
Writes: DEL KEYS[1]; ZREM KEYS[2]; HSET KEYS[3] epoch
]]
local evt, listing, fence = KEYS[1], KEYS[2], KEYS[3]
local key, ctl_epoch = ARGV[1], tonumber(ARGV[2])

local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0  -- garbage reads as 0
if seen > ctl_epoch then return {'fenced', seen} end
local f = redis.call('HMGET', evt, 'state', 'received_ms')
if f[1] == 'pending' then return {'kept', 'pending'} end
if f[1] and tonumber(f[2] or '0') > tonumber(ARGV[3]) then return {'kept', f[1]} end
if seen < ctl_epoch then redis.call('HSET', fence, 'epoch', ctl_epoch) end
redis.call('DEL', evt)
redis.call('ZREM', listing, key)
return {'ok'}
