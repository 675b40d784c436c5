#!lua
--[[ abandon_attempt: a worker saw its work-horse die; expire that delivery's lease now so
the controller redelivers it on its next pass instead of after the lease runs out.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] lease zset      <tag>:leases
ARGV[1] run_id
ARGV[2] attempt         the delivery the dead horse was executing
ARGV[3] worker          the worker whose horse died (only its own execution is abandoned)
Returns:
  {"ok"}                  the lease now reads as expired
  {"ignored"}             the run moved on (settled, or another delivery); nothing written
Writes (only for "ok"): ZADD XX KEYS[2]
]]
local run, leases = KEYS[1], KEYS[2]
local r = redis.call('HMGET', run, 'status', 'attempt', 'worker')
if r[1] ~= 'running' or r[2] ~= ARGV[2] or r[3] ~= ARGV[3] then return {'ignored'} end
if not redis.call('ZSCORE', leases, ARGV[1]) then return {'ignored'} end
redis.call('ZADD', leases, 'XX', 0, ARGV[1])
return {'ok'}
