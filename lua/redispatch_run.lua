#!lua
--[[ redispatch_run: the controller found a queued run's delivery lost inside RQ (its job sat
popped but unstarted: in a queue's intermediate list or started registry, or failed before
the run started). Deliver it again as attempt + 1, or give up when its deliveries are used
up; a late start of the lost delivery then reads as stale.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] dispatch zset   <tag>:dispatch
KEYS[3] output stream   <tag>:out:<run id>
KEYS[4] bucket fence    <tag>:ctl                {epoch}: the newest controller seen here
KEYS[5] finished zset   <tag>:finished
KEYS[6] redeliveries    <tag>:redelivered        {<run id>#a<attempt>: server ms}, last hour
ARGV[1] run_id
ARGV[2] attempt         the delivery found lost
ARGV[3] ctl_epoch       the calling controller's lease epoch
ARGV[4] grace_ms        the dispatch check comes due after this long
ARGV[5] final_gave_up   JSON data of the final event when deliveries are used up
Returns:
  {"redelivered", attempt, queue}   the caller now enqueues delivery <attempt> on <queue>
  {"gave_up", attempt}              max deliveries reached: settled failed
  {"moved"}                         the run started or changed meanwhile; nothing written
  {"fenced", epoch}                 a newer controller acts on this bucket; nothing written
  {"corrupt", reason}               the run's hash is unreadable; nothing written
Writes: HSET/HINCRBY KEYS[1]; ZADD/ZREM KEYS[2]; XADD KEYS[3]; HSET KEYS[4]; ZADD KEYS[5];
  ZADD + ZREMRANGEBYSCORE KEYS[6] when redelivered
]]
local run, dispatch, out, fence, finished = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local redeliveries = KEYS[6]
local run_id, attempt, ctl_epoch = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0  -- garbage reads as 0
if seen > ctl_epoch then return {'fenced', seen} end
local r = redis.pcall('HMGET', run, 'status', 'attempt', 'queue', 'max_deliveries', 'deferred',
  'retention_ms')
if r.err then return {'corrupt', 'the run key is not a hash'} end
if r[1] ~= 'queued' or tonumber(r[2]) ~= attempt then return {'moved'} end
for i, name in pairs({[4] = 'max_deliveries', [5] = 'deferred', [6] = 'retention_ms'}) do
  -- Whole numbers only: Lua's tonumber also takes 1.5, 1e999, inf, nan and 0x10.
  if r[i] and not (string.match(r[i], '^%d+$') and #r[i] <= 15) then
    return {'corrupt', 'field ' .. name .. ' is not a whole number'}
  end
end
if seen < ctl_epoch then redis.call('HSET', fence, 'epoch', ctl_epoch) end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if attempt - tonumber(r[5] or '0') >= tonumber(r[4] or '0') then
  redis.call('HSET', run, 'status', 'failed', 'finished_ms', now_ms, 'error',
    '{"type":"DeliveriesExhausted","message":"the run\'s deliveries kept getting lost; gave up '
    .. 'after ' .. attempt .. ' deliveries"}')
  redis.call('HINCRBY', run, 'epoch', 1)
  redis.call('HDEL', run, 'note')
  redis.call('ZREM', dispatch, run_id)
  redis.call('ZADD', finished, now_ms + tonumber(r[6] or '604800000'), run_id)
  redis.call('XADD', out, '*', 't', 'final', 'a', attempt, 'd', ARGV[5])
  return {'gave_up', attempt}
end
redis.call('HSET', run, 'attempt', attempt + 1)
redis.call('HINCRBY', run, 'epoch', 1)
redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[4]), run_id)
redis.call('XADD', out, '*', 't', 'redelivered', 'a', attempt + 1,
  'd', '{"previous":' .. attempt .. ',"attempt":' .. (attempt + 1)
    .. ',"reason":"delivery lost before it started"}')
-- The dashboard's "redeliveries in the last hour": kept for an hour, trimmed here.
redis.call('ZADD', redeliveries, now_ms, run_id .. '#a' .. (attempt + 1))
redis.call('ZREMRANGEBYSCORE', redeliveries, '-inf', now_ms - 3600000)
return {'redelivered', attempt + 1, r[3]}
