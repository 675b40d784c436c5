#!lua
--[[ acquire_lock: a run asks for a durable mutex (flow/locks.py) on entering `with
mr.lock(key)`. A lock's keys are its own, under its own hash tag, so this is one script on
one slot whatever the runs' buckets. The holder is a run and the epoch of the execution that
took it: a newer execution of the same run (redelivered, or resumed after a park inside the
critical section) takes the hold over at once (even a lapsed one nobody took meanwhile); an
older one is refused. Other runs wait in a FIFO, in order of arrival: only its head may take
a free lock, and a newcomer never passes a non-empty queue. A head that has not come back
stale_ms after the lock became free (cancelled, lost) is dropped so it cannot block the rest;
it queues again at the tail if it comes back.
KEYS[1] state hash      {P:lock:<id>}:state   name, run and epoch of the holder, since and
                                              until (server ms), free (since when the lock
                                              is free with runs queued), seq (arrivals)
KEYS[2] queue zset      {P:lock:<id>}:queue   run id -> arrival number (the FIFO)
ARGV[1] run_id
ARGV[2] epoch           the asking execution's epoch (the run's fence)
ARGV[3] ttl_ms          a hold lapses this long after it is taken or renewed
ARGV[4] stale_ms        a head this late to take a free lock is dropped
ARGV[5] name            the lock's key as the body names it (for listings)
Returns:
  {"ok", until, since}          held by this execution until <until>, since <since> (server
                                ms; since is kept when this run held it already)
  {"queued", position, queued, holder, until}
                                held by run <holder> until <until>, or free and another run
                                is the head: this run waits at <position> (0: the head) of
                                <queued>
  {"stale", epoch}              a newer execution of this run holds it; nothing written
Writes: HSET/HDEL KEYS[1]; ZADD/ZREM KEYS[2]
]]
local state, queue = KEYS[1], KEYS[2]
local run_id, epoch, ttl_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local stale_ms = tonumber(ARGV[4])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local h = redis.call('HMGET', state, 'run', 'epoch', 'until', 'since', 'free', 'seq')
local holder, by, untl = h[1], tonumber(h[2] or '0') or 0, tonumber(h[3] or '0') or 0

local function take(since)
  redis.call('ZREM', queue, run_id)
  redis.call('HSET', state, 'name', ARGV[5], 'run', run_id, 'epoch', epoch, 'since', since,
    'until', now_ms + ttl_ms)
  redis.call('HDEL', state, 'free')
  return {'ok', now_ms + ttl_ms, since}
end

if holder == run_id then
  if by > epoch then return {'stale', by} end
  -- Its own hold (live, or lapsed with nobody taking it since): this execution goes on with
  -- the critical section it (or an older execution of the run) entered.
  return take(tonumber(h[4] or now_ms))
end
if holder and untl > now_ms then
  local mine = redis.call('ZSCORE', queue, run_id)
  if not mine then
    local seq = redis.call('HINCRBY', state, 'seq', 1)
    redis.call('ZADD', queue, seq, run_id)
  end
  return {'queued', redis.call('ZRANK', queue, run_id), redis.call('ZCARD', queue), holder,
    untl}
end
-- Free: released, never taken, or lapsed (its holder vanished without a renewal).
local free = tonumber(h[5] or '0') or 0
if holder then
  redis.call('HDEL', state, 'run', 'epoch', 'since', 'until')
  free = untl
end
if free == 0 then free = now_ms end
local head = redis.call('ZRANGE', queue, 0, 0)[1]
for _ = 1, 10 do
  if not head or head == run_id or now_ms <= free + stale_ms then break end
  redis.call('ZREM', queue, head)
  free = now_ms
  head = redis.call('ZRANGE', queue, 0, 0)[1]
end
if not head or head == run_id then return take(now_ms) end
redis.call('HSET', state, 'name', ARGV[5], 'free', free)
if not redis.call('ZSCORE', queue, run_id) then
  redis.call('ZADD', queue, redis.call('HINCRBY', state, 'seq', 1), run_id)
end
return {'queued', redis.call('ZRANK', queue, run_id), redis.call('ZCARD', queue), '', 0}
