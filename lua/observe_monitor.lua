#!lua
--[[ observe_monitor: record one poll of a monitor: the new observation (only after its
handler returned), the launch it asked for as pending, and when it is polled next.
KEYS[1] monitor hash    <tag>:mon:<monitor key>
KEYS[2] due zset        <tag>:mondue
KEYS[3] bucket fence    <tag>:ctl
ARGV[1] monitor_key
ARGV[2] ctl_epoch       the caller's controller epoch; 0 for a manual roll (not fenced)
ARGV[3] expected_rev    the `rev` the poll compared against ('' = absent)
ARGV[4] obs             the new observation JSON; '' keeps the stored one (no change, a
                        failed poll or a failed handler)
ARGV[5] launch          pending launch JSON; '' for none
ARGV[6] launch_run      the launch's run id; '' for none
ARGV[7] seq             the monitor's launch count after this poll
ARGV[8] interval_ms     the next poll comes due after this long
ARGV[9] error           what went wrong in this poll; '' for nothing
Returns:
  {"ok", next_ms}       recorded
  {"conflict", rev}     another poll recorded first, or a launch is still pending; nothing
                        written
  {"fenced", epoch}     a newer controller acts on this bucket; nothing written
Writes: HSET KEYS[1] (+ HINCRBY rev); ZADD KEYS[2]; HSET KEYS[3] epoch (a controller)
]]
local mon, due, fence = KEYS[1], KEYS[2], KEYS[3]
local key, ctl_epoch = ARGV[1], tonumber(ARGV[2])
local obs, launch, launch_run = ARGV[4], ARGV[5], ARGV[6]

local seen = 0
if ctl_epoch > 0 then
  seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0  -- garbage reads as 0
  if seen > ctl_epoch then return {'fenced', seen} end
end
local cur = redis.call('HMGET', mon, 'rev', 'pending_run')
if (cur[1] or '') ~= ARGV[3] then return {'conflict', cur[1] or ''} end
if obs ~= '' and cur[2] then return {'conflict', cur[1] or ''} end

if ctl_epoch > seen then redis.call('HSET', fence, 'epoch', ctl_epoch) end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local next_ms = now_ms + tonumber(ARGV[8])
redis.call('HSET', mon, 'last_poll_ms', now_ms, 'next_ms', next_ms, 'last_error', ARGV[9])
if obs ~= '' then
  redis.call('HSET', mon, 'obs', obs, 'last_change_ms', now_ms, 'seq', ARGV[7])
  if launch ~= '' then redis.call('HSET', mon, 'pending', launch, 'pending_run', launch_run) end
  redis.call('HINCRBY', mon, 'rev', 1)
end
redis.call('ZADD', due, next_ms, key)
return {'ok', next_ms}
