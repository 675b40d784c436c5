#!lua
--[[ put_rollup: the lane's leader writes the rollups of some minutes (each recomputed whole
from the store, so a repeat or an overlapping ex-leader writes the same value) and drops the
minutes older than the window kept.
KEYS[1] rollup hash     <lane tag>:roll:<lane>      minute -> MinuteRollup JSON
KEYS[2] minutes zset    <lane tag>:rollmin:<lane>   minute -> minute
KEYS[3] bucket fence    <lane tag>:ctl              {epoch}: the newest controller seen here
ARGV[1] ctl_epoch       the writer's lease epoch
ARGV[2] keep_from       the oldest minute kept; older ones are dropped
ARGV[3] keep_ms         both keys expire this long after the last write (a lane that is gone)
ARGV[4] count           how many (minute, JSON) pairs follow
ARGV[5..] minute, JSON, minute, JSON, ...
Returns:
  {"ok", dropped}       written; dropped: minutes trimmed
  {"fenced", epoch}     a newer controller wrote in the lane; nothing written
Writes (only for "ok"): HSET/HDEL KEYS[1], ZADD/ZREMRANGEBYSCORE KEYS[2], PEXPIRE both
]]
local roll, minutes, fence = KEYS[1], KEYS[2], KEYS[3]
local epoch = tonumber(ARGV[1])
local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0
if seen > epoch then return {'fenced', seen} end
local n = tonumber(ARGV[4])
for i = 0, n - 1 do
  local minute, doc = ARGV[5 + 2 * i], ARGV[6 + 2 * i]
  redis.call('HSET', roll, minute, doc)
  redis.call('ZADD', minutes, minute, minute)
end
local old = redis.call('ZRANGEBYSCORE', minutes, '-inf', '(' .. ARGV[2])
for _, minute in ipairs(old) do redis.call('HDEL', roll, minute) end
redis.call('ZREMRANGEBYSCORE', minutes, '-inf', '(' .. ARGV[2])
redis.call('PEXPIRE', roll, ARGV[3])
redis.call('PEXPIRE', minutes, ARGV[3])
return {'ok', #old}
