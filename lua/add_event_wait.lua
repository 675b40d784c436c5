#!lua
--[[ add_event_wait: index a run's open wait for an event under one term (source, type, and
one of its match fields with its value), so an event finds the runs that may match it by its
own terms: the cost of an event is the waits under its terms, not every wait.
KEYS[1] term zset       {<prefix>:evwait}:w:<term digest>   member -> indexed (server ms)
KEYS[2] spec hash       {<prefix>:evwait}:spec              member -> the wait's spec JSON
ARGV[1] member          "<run id>|<wait key>"
ARGV[2] spec            JSON {run, key, source, type, match, term}
Returns:
  {"ok"}
Writes: ZADD KEYS[1]; HSET KEYS[2]
]]
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], 'NX', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000),
  ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {'ok'}
