#!lua
--[[ arm_monitor: put a declared monitor on its bucket's due index if it is not there yet
(it then resumes from its stored state), or take an undeclared one off it.
KEYS[1] monitor hash    <tag>:mon:<monitor key>
KEYS[2] due zset        <tag>:mondue             monitor key -> next poll (server ms)
KEYS[3] bucket fence    <tag>:ctl
ARGV[1] monitor_key
ARGV[2] ctl_epoch       the calling controller's lease epoch
ARGV[3] mode            arm | disarm
Returns:
  {"ok", next_ms}       armed (next_ms: when it is due) or disarmed (0)
  {"fenced", epoch}     a newer controller acts on this bucket; nothing written
Writes: ZADD NX or ZREM KEYS[2]; HSET KEYS[1] next_ms; HSET KEYS[3] epoch
]]
local mon, due, fence = KEYS[1], KEYS[2], KEYS[3]
local key, ctl_epoch = ARGV[1], tonumber(ARGV[2])

local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0  -- garbage reads as 0
if seen > ctl_epoch then return {'fenced', seen} end
if seen < ctl_epoch then redis.call('HSET', fence, 'epoch', ctl_epoch) end
if ARGV[3] == 'disarm' then
  redis.call('ZREM', due, key)
  return {'ok', 0}
end
local score = redis.call('ZSCORE', due, key)
if score then return {'ok', tonumber(score)} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local next_ms = tonumber(redis.call('HGET', mon, 'next_ms') or now_ms)
redis.call('ZADD', due, next_ms, key)
redis.call('HSET', mon, 'next_ms', next_ms)
return {'ok', next_ms}
