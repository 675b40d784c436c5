#!lua
--[[ renew_attempt: extend a running execution's lease; tells it when it must stop. A lease
that expired is over: the execution is fenced (its epoch raised, so nothing it sends is
written any more) and the reaper redelivers the run.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] lease zset      <tag>:leases
ARGV[1] epoch           the execution's fence
ARGV[2] ttl_ms          the lease is extended to now + ttl_ms
ARGV[3] run_id
ARGV[4] cap_ms          0, or the lease is extended at most to this (server ms): the expiry
                        of the run's concurrency slot (renew_slot); one at or before now
                        ends the lease like an expiry
Returns:
  {"ok"}
  {"stale", epoch}        a newer execution owns the run: stop now, write nothing
  {"settled", status}     the run is finished: stop now
  {"cancelled"}           cancel was requested: settle cancelled and stop
  {"timed_out"}           the run's deadline passed: settle failed and stop
  {"expired"}             the lease had expired (or its slot's cap passed): fenced, stop now
Writes: for "ok": ZADD XX KEYS[2]; for "expired": HINCRBY KEYS[1] epoch
]]
local run, leases = KEYS[1], KEYS[2]
local r = redis.call('HMGET', run, 'epoch', 'status', 'cancel', 'deadline_ms')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
if r[3] == '1' then return {'cancelled'} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deadline = tonumber(r[4] or '0')
if deadline > 0 and now_ms > deadline then return {'timed_out'} end
local cap = tonumber(ARGV[4])
local lease = tonumber(redis.call('ZSCORE', leases, ARGV[3]) or '0')
if lease <= now_ms or (cap > 0 and cap <= now_ms) then
  -- Frozen (or cut off) past its lease: the reaper may have freed its slot, another run may
  -- hold it now. Its writes end here, not at the reap.
  redis.call('HINCRBY', run, 'epoch', 1)
  return {'expired'}
end
local expiry = now_ms + tonumber(ARGV[2])
if cap > 0 and cap < expiry then expiry = cap end
redis.call('ZADD', leases, 'XX', expiry, ARGV[3])
return {'ok'}
