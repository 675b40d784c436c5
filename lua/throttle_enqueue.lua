#!lua
--[[ throttle_enqueue: let one run of a throttled workflow through, or drop it: at most
`limit` runs in any `period_ms` (a sliding log of the runs let through).
KEYS[1] log zset        <tag>:thr:<digest>       run id -> when it was let through
ARGV[1] run_id          a resend with the same run id answers started again
ARGV[2] limit
ARGV[3] period_ms
Returns:
  {"started", count}           let through (count: runs in the period, this one included)
  {"dropped", retry_at, count} full: a run is let through again from retry_at (server ms)
Writes: ZREMRANGEBYSCORE, ZADD, PEXPIRE KEYS[1]
]]
local log = KEYS[1]
local limit, period = tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', log, '-inf', now - period)
local count = redis.call('ZCARD', log)
if redis.call('ZSCORE', log, ARGV[1]) then return {'started', count} end
if count >= limit then
  local oldest = redis.call('ZRANGE', log, 0, count - limit, 'WITHSCORES')
  return {'dropped', tonumber(oldest[#oldest]) + period, count}
end
redis.call('ZADD', log, now, ARGV[1])
redis.call('PEXPIRE', log, period + 1000)
return {'started', count + 1}
