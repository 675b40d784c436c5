#!lua
--[[ beat_worker: a worker says it is alive (every second, whatever it executes); one silent
past its ttl is lost, and the controller redelivers the runs it was executing.
KEYS[1] workers zset    {<prefix>}:workers      worker name -> when it is lost (server ms)
ARGV[1] worker          the worker's name (what start_attempt records as the run's worker)
ARGV[2] ttl_ms          it is lost if it does not beat again within this long
Returns:
  {"ok", until_ms}        alive until until_ms (server clock); safe to resend
Writes: ZADD KEYS[1]
]]
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], until_ms, ARGV[1])
return {'ok', until_ms}
