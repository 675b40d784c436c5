#!lua
--[[ redispatch_run: the controller found a queued run's delivery lost inside RQ (the job is
in no queue list: e.g. a worker popped it with BLPOP and died before recording it). Deliver
it again as attempt + 1; a late start of the lost delivery then reads as stale.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] dispatch zset   <tag>:dispatch
KEYS[3] output stream   <tag>:out:<run id>
KEYS[4] bucket fence    <tag>:ctl                {epoch}: the newest controller seen here
ARGV[1] run_id
ARGV[2] attempt         the delivery found lost
ARGV[3] ctl_epoch       the calling controller's lease epoch
ARGV[4] grace_ms        the dispatch check comes due after this long
Returns:
  {"redelivered", attempt, queue}   the caller now enqueues delivery <attempt> on <queue>
  {"moved"}                         the run started or changed meanwhile; nothing written
  {"fenced", epoch}                 a newer controller acts on this bucket; nothing written
Writes: HSET/HINCRBY KEYS[1]; ZADD KEYS[2]; XADD KEYS[3]; HSET KEYS[4]
]]
local run, dispatch, out, fence = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local run_id, attempt, ctl_epoch = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0')
if seen > ctl_epoch then return {'fenced', seen} end
local r = redis.call('HMGET', run, 'status', 'attempt', 'queue')
if r[1] ~= 'queued' or tonumber(r[2]) ~= attempt then return {'moved'} end
if seen < ctl_epoch then redis.call('HSET', fence, 'epoch', ctl_epoch) end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', run, 'attempt', attempt + 1)
redis.call('HINCRBY', run, 'epoch', 1)
redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[4]), run_id)
redis.call('XADD', out, '*', 't', 'redelivered', 'a', attempt + 1,
  'd', '{"previous":' .. attempt .. ',"attempt":' .. (attempt + 1)
    .. ',"reason":"delivery lost before it started"}')
return {'redelivered', attempt + 1, r[3]}
