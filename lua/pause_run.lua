#!lua
--[[ pause_run: pause a run. A waiting run is paused at once; a queued or running one parks
(reason paused) when it next starts or reaches a step boundary. Only resume_run wakes it.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] output stream   <tag>:out:<run id>
ARGV[1] event           JSON data of the "pause_requested" output event
Returns:
  {"paused"}              it was waiting: paused now
  {"requested"}           queued or running: it parks at its next start or step boundary
  {"already"}             paused already; nothing written
  {"settled", status}     finished; nothing written
  {"missing"}             no such run
Writes: HSET KEYS[1]; XADD KEYS[2]
]]
local run, out = KEYS[1], KEYS[2]
local r = redis.pcall('HMGET', run, 'status', 'attempt', 'pause')
if r.err or not r[1] then return {'missing'} end
if r[1] == 'succeeded' or r[1] == 'failed' or r[1] == 'cancelled' then
  return {'settled', r[1]}
end
if r[3] == '1' then return {'already'} end
redis.call('HSET', run, 'pause', 1)
redis.call('XADD', out, '*', 't', 'pause_requested', 'a', r[2], 'd', ARGV[1])
if r[1] == 'waiting' then
  redis.call('HSET', run, 'wait_reason', 'paused')
  return {'paused'}
end
return {'requested'}
