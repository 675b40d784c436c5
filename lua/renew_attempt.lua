#!lua
--[[ renew_attempt: extend a running execution's lease; tells it when it must stop.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] lease zset      <tag>:leases
ARGV[1] epoch           the execution's fence
ARGV[2] ttl_ms          the lease is extended to now + ttl_ms
ARGV[3] run_id
Returns:
  {"ok"}
  {"stale", epoch}        a newer execution owns the run: stop now, write nothing
  {"settled", status}     the run is finished: stop now
  {"cancelled"}           cancel was requested: settle cancelled and stop
  {"timed_out"}           the run's deadline passed: settle failed and stop
Writes (only for "ok"): ZADD XX KEYS[2]
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
redis.call('ZADD', leases, 'XX', now_ms + tonumber(ARGV[2]), ARGV[3])
return {'ok'}
