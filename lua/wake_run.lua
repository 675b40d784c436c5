#!lua
--[[ wake_run: wake a waiting run (its timer or a question's timeout came due, or a child it
waits for settled): queued again as a new delivery that replays the ledger. Idempotent: a
run that is not waiting is left as it is.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] waits zset      <tag>:waits
KEYS[3] dispatch zset   <tag>:dispatch
KEYS[4] output stream   <tag>:out:<run id>
KEYS[5] bucket fence    <tag>:ctl                 {epoch}: the newest controller seen here
KEYS[6] asks hash       <tag>:asks:<run id>
KEYS[7] feed zset       <tag>:feed
ARGV[1] run_id
ARGV[2] ctl_epoch       the calling controller's lease epoch; '' = not the controller
ARGV[3] cause           timer (wakes only once its wake time has come) | child (from a
                        settled child, not the controller: wakes only a run that waits for
                        children) | rate (a rate limit's turn comes: wakes only a run that
                        waits for a rate limit, whatever its timer) | lock (a lock it
                        waits for was released: wakes only a run that waits for a lock;
                        one executing is marked, and requeues itself if it parks for one)
ARGV[4] grace_ms        the dispatch check comes due after this long
ARGV[5] event           JSON data of the "woken" output event
Returns:
  {"woken", attempt, queue}   queued as delivery <attempt>; the caller enqueues it
  {"not_due", wake_at}        a timer that is not due yet (re-indexed at its time)
  {"pending"}                 the run is executing: it requeues itself when it parks (for
                              a child: if it parks waiting for children)
  {"paused"}                  paused: only resume wakes it
  {"idle", status}            queued, finished or missing: nothing to wake; or (status
                              waiting, its index entry kept) a child's wake of a run that
                              waits for no child
  {"fenced", epoch}           a newer controller acts on this bucket; nothing written
Writes: HSET/HINCRBY/HDEL KEYS[1]; ZREM/ZADD KEYS[2]; ZADD KEYS[3]; XADD KEYS[4]; HSET KEYS[5];
  HSET KEYS[6] (questions past their timeout); ZREM KEYS[7]
]]
local run, waits, dispatch, out, fence, asks, feed = KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  KEYS[5], KEYS[6], KEYS[7]
local run_id = ARGV[1]
if ARGV[2] ~= '' then
  local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0
  if seen > tonumber(ARGV[2]) then return {'fenced', seen} end
  if seen < tonumber(ARGV[2]) then redis.call('HSET', fence, 'epoch', ARGV[2]) end
end
local r = redis.pcall('HMGET', run, 'status', 'attempt', 'pause', 'queue', 'wake_at',
  'wake_pending', 'wait_for', 'wait_reason')
if r.err then
  redis.call('ZREM', waits, run_id)
  return {'idle', 'corrupt'}
end
if ARGV[3] == 'rate' and (r[1] ~= 'waiting' or r[8] ~= 'rate_limit') then
  return {'idle', r[1] or 'missing'}  -- it moved on: nothing to wake, its index kept
end
if ARGV[3] == 'lock' and r[1] ~= 'running' and (r[1] ~= 'waiting' or r[8] ~= 'lock') then
  return {'idle', r[1] or 'missing'}  -- it moved on: nothing to wake, its index kept
end
if r[1] == 'running' then
  -- A lock released while its waiter executes (it asked, and has not parked yet): it
  -- requeues itself if it parks waiting for a lock (park_run), else the wake is spent.
  if ARGV[3] == 'lock' and r[6] ~= '1' then redis.call('HSET', run, 'wake_pending', 'lock') end
  -- Marked as a child's: it requeues the run only if it parks waiting for children. An
  -- answer's pending wake ('1') is never lowered to a child's: the run may park on that
  -- answered question again, and only the answer's wake would then requeue it.
  if ARGV[3] == 'child' and r[6] ~= '1' then redis.call('HSET', run, 'wake_pending', 'child') end
  return {'pending'}
end
if r[1] ~= 'waiting' then
  redis.call('ZREM', waits, run_id)
  return {'idle', r[1] or 'missing'}
end
if r[3] == '1' then
  redis.call('ZREM', waits, run_id)
  return {'paused'}
end
if ARGV[3] == 'child' and ARGV[2] == '' then
  -- A settled child wakes a run only if it waits for children (as a wake_pending 'child' in
  -- park_run): one parked on a timer alone would replay for nothing, or, begun after the
  -- due time, pass its timer without the timer's wake. (Unreadable: woken, never stranded.
  -- The controller's own child wakes come from the children it read; nothing is left due
  -- in its index to be found again at every pass.)
  local ok, wait_for = pcall(cjson.decode, r[7] or '{}')
  if ok and type(wait_for) == 'table' and wait_for.children == nil then
    return {'idle', 'waiting'}
  end
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local wake_at = tonumber(r[5] or '0') or 0
if ARGV[3] == 'timer' then
  if wake_at == 0 then
    redis.call('ZREM', waits, run_id)
    return {'idle', 'waiting'}
  end
  if wake_at > now_ms then
    redis.call('ZADD', waits, wake_at, run_id)
    return {'not_due', wake_at}
  end
  -- Questions past their timeout are closed first, so an answer after it is refused.
  local fields = redis.call('HGETALL', asks)
  for j = 1, #fields, 2 do
    local name = fields[j]
    if string.sub(name, -11) == '|timeout_at' and tonumber(fields[j + 1]) <= now_ms then
      local key = string.sub(name, 1, -12)
      if redis.call('HGET', asks, key .. '|state') == 'open' then
        redis.call('HSET', asks, key .. '|state', 'timed_out', key .. '|answered_ms', now_ms)
        redis.call('HINCRBY', asks, key .. '|rev', 1)
        redis.call('ZREM', feed, run_id .. '|' .. key)
      end
    end
  end
end
-- A wake is a delivery that does not count against max deliveries (counted with deferrals).
local attempt = tonumber(r[2]) + 1
redis.call('HSET', run, 'status', 'queued', 'attempt', attempt)
redis.call('HINCRBY', run, 'deferred', 1)
redis.call('HINCRBY', run, 'resumptions', 1)  -- status shows them apart
redis.call('HDEL', run, 'wait_reason', 'wait_for', 'wait_since', 'wake_at', 'wake_pending')
redis.call('ZREM', waits, run_id)
redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[4]), run_id)
redis.call('XADD', out, '*', 't', 'woken', 'a', attempt, 'd', ARGV[5])
return {'woken', attempt, r[4]}
