#!lua
--[[ beat_worker: a worker says it is alive (every second, whatever it executes); one silent
past its ttl is lost, and the controller redelivers the runs it was executing.
KEYS[1] workers zset    {<prefix>}:workers      worker name -> when it is lost (server ms)
KEYS[2] lanes hash      optional: {<prefix>}:worker_lanes  worker name -> the lanes it serves
ARGV[1] worker          the worker's name (what start_attempt records as the run's worker)
ARGV[2] ttl_ms          it is lost if it does not beat again within this long
KEYS[3] versions hash   optional, with KEYS[2]: {<prefix>}:worker_versions  worker name ->
                        the workflow versions it serves
ARGV[3] lanes           with KEYS[2]: the lanes it serves, comma-separated ("0,2")
ARGV[4] versions        with KEYS[3]: JSON {workflow: [version, ...]}, written when the
                        worker has no entry (its first beat, or after the controller forgot
                        it while it was frozen): a beat that finds it writes nothing more
Returns:
  {"ok", until_ms}        alive until until_ms (server clock); safe to resend
Writes: ZADD KEYS[1]; HSET KEYS[2] when given; HSETNX KEYS[3] when given
]]
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], until_ms, ARGV[1])
if KEYS[2] then redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) end
if KEYS[3] then redis.call('HSETNX', KEYS[3], ARGV[1], ARGV[4]) end
return {'ok', until_ms}
