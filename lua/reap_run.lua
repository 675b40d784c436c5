#!lua
--[[ reap_run: the controller redelivers a run whose execution's lease expired, or whose
worker was lost (it stopped beating: see beat_worker): attempt + 1 under the same run id
(or settles it, if it was cancelled or has used up its deliveries).
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] lease zset      <tag>:leases
KEYS[3] dispatch zset   <tag>:dispatch
KEYS[4] output stream   <tag>:out:<run id>
KEYS[5] bucket fence    <tag>:ctl                {epoch}: the newest controller seen here
KEYS[6] finished zset   <tag>:finished
KEYS[7] redeliveries    <tag>:redelivered        {<run id>#a<attempt>: server ms}, last hour
ARGV[1] run_id
ARGV[2] ctl_epoch       the calling controller's lease epoch
ARGV[3] grace_ms        the dispatch check comes due after this long
ARGV[4] final_cancel    JSON data of the final event when settled cancelled
ARGV[5] final_gave_up   JSON data of the final event when deliveries are used up
ARGV[6] worker          "" : reap if the lease expired; a lost worker's name: reap if the
                        run is executing on that worker, whatever its lease says
Returns: (limit: the run's `limit` field, "" if none: the caller frees the vanished
execution's concurrency slot, see release_slot)
  {"redelivered", attempt, queue, limit}  the caller now enqueues delivery <attempt> on <queue>
  {"cancelled", attempt, limit}     cancel had been requested: settled cancelled (the caller
                                    cancels its children too, as every cancelled settle does);
                                    a cancel that asked for compensation is redelivered
                                    instead (its next start writes the phase marker)
  {"gave_up", attempt, limit}       max deliveries reached: settled failed
  {"not_expired"}                   renewed meanwhile, or (worker given) executed by another
                                    worker now; nothing written
  {"gone"}                          no lease (settled or reaped already); nothing written
  {"fenced", epoch}                 a newer controller acts on this bucket; nothing written
  {"corrupt", reason}               the run's hash is unreadable; nothing written
Writes: HSET KEYS[1] (+ HINCRBY epoch); ZREM KEYS[2]; ZADD KEYS[3]; XADD KEYS[4]; HSET KEYS[5];
  ZADD KEYS[6] when settled; ZADD + ZREMRANGEBYSCORE KEYS[7] when redelivered
]]
local run, leases, dispatch, out, fence, finished = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6]
local redeliveries = KEYS[7]
local run_id, ctl_epoch = ARGV[1], tonumber(ARGV[2])

local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0  -- garbage reads as 0
if seen > ctl_epoch then return {'fenced', seen} end
local score = redis.call('ZSCORE', leases, run_id)
if not score then return {'gone'} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lost_worker = ARGV[6]
if lost_worker == '' and tonumber(score) > now_ms then return {'not_expired'} end
local r = redis.pcall('HMGET', run, 'status', 'attempt', 'cancel', 'max_deliveries', 'queue',
  'deferred', 'retention_ms', 'epoch', 'worker', 'limit', 'compensate')
if r.err then return {'corrupt', 'the run key is not a hash'} end
if r[1] ~= 'running' then
  -- Only a settled or missing run can be here; its lease entry is debris.
  redis.call('ZREM', leases, run_id)
  return {'gone'}
end
if lost_worker ~= '' and r[9] ~= lost_worker then return {'not_expired'} end
for i, name in pairs({[2] = 'attempt', [4] = 'max_deliveries', [6] = 'deferred',
                      [7] = 'retention_ms', [8] = 'epoch'}) do
  -- Whole numbers only: Lua's tonumber also takes 1.5, 1e999, inf, nan and 0x10.
  if r[i] and not (string.match(r[i], '^%d+$') and #r[i] <= 15) then
    return {'corrupt', 'field ' .. name .. ' is not a whole number'}
  end
end
if not r[2] then return {'corrupt', 'field attempt is missing'} end
if seen < ctl_epoch then redis.call('HSET', fence, 'epoch', ctl_epoch) end
local attempt = tonumber(r[2])

local function settle(status, error_json, final_event)
  redis.call('HSET', run, 'status', status, 'finished_ms', now_ms)
  if error_json then redis.call('HSET', run, 'error', error_json) end
  redis.call('HINCRBY', run, 'epoch', 1)
  redis.call('HDEL', run, 'note')
  redis.call('ZREM', leases, run_id)
  redis.call('ZREM', dispatch, run_id)
  redis.call('ZADD', finished, now_ms + tonumber(r[7] or '604800000'), run_id)
  redis.call('XADD', out, '*', 't', 'final', 'a', attempt, 'd', final_event)
end
if r[3] == '1' and not r[11] then
  settle('cancelled', nil, ARGV[4])
  return {'cancelled', attempt, r[10] or ''}
end
-- Deferrals (a worker that lacked the workflow handed it back) are not failed deliveries.
if attempt - tonumber(r[6] or '0') >= tonumber(r[4] or '0') then
  settle('failed', '{"type":"DeliveriesExhausted","message":"the run\'s executions kept '
    .. 'vanishing; gave up after ' .. attempt .. ' deliveries"}', ARGV[5])
  return {'gave_up', attempt, r[10] or ''}
end

redis.call('HSET', run, 'status', 'queued', 'attempt', attempt + 1)
redis.call('HDEL', run, 'worker')
redis.call('HINCRBY', run, 'epoch', 1)  -- the vanished execution's writes are refused from now
redis.call('ZREM', leases, run_id)
redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[3]), run_id)
local redelivered = {previous = attempt, attempt = attempt + 1, reason = 'lease expired'}
if lost_worker ~= '' then
  redelivered.reason = 'worker lost'
  redelivered.worker = lost_worker
end
redis.call('XADD', out, '*', 't', 'redelivered', 'a', attempt + 1,
  'd', cjson.encode(redelivered))
-- The dashboard's "redeliveries in the last hour": kept for an hour, trimmed here.
redis.call('ZADD', redeliveries, now_ms, run_id .. '#a' .. (attempt + 1))
redis.call('ZREMRANGEBYSCORE', redeliveries, '-inf', now_ms - 3600000)
return {'redelivered', attempt + 1, r[5], r[10] or ''}
