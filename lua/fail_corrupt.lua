#!lua
--[[ fail_corrupt: a run's stored state cannot be read (a field that is not a number, a
document that does not decode, a key of the wrong type). Fail it once, naming the key, and
take it out of the indexes, so it costs only itself: no crash loop, no endless redelivery.
Every write is a pcall: the run's own keys are the suspects.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] lease zset      <tag>:leases
KEYS[3] dispatch zset   <tag>:dispatch
KEYS[4] output stream   <tag>:out:<run id>
KEYS[5] finished zset   <tag>:finished
KEYS[6] run listing     <tag>:idx:run
ARGV[1] run_id
ARGV[2] error           ErrorInfo JSON (type CorruptRecord, naming the key)
ARGV[3] event           JSON data of the final output event
ARGV[4] retention_ms    how long the failed run is kept
Returns:
  {"failed"}              settled failed by this call
  {"settled", status}     it had finished already; only the indexes were cleaned
  {"unindexed"}           the run hash is unusable (missing or of another type); only the
                          indexes were cleaned (the listing too: nothing would ever prune it)
Writes: HSET KEYS[1]; ZREM KEYS[2], KEYS[3]; XADD KEYS[4]; ZADD KEYS[5]; ZREM KEYS[6]
]]
local run, leases, dispatch, out, finished, listing = KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  KEYS[5], KEYS[6]
local run_id = ARGV[1]
redis.pcall('ZREM', leases, run_id)
redis.pcall('ZREM', dispatch, run_id)
local s = redis.pcall('HGET', run, 'status')
if type(s) ~= 'string' then  -- wrong type (error) or no hash (nil)
  redis.pcall('ZREM', listing, run_id)
  return {'unindexed'}
end
if s == 'succeeded' or s == 'failed' or s == 'cancelled' then return {'settled', s} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- A fresh epoch fences any execution still holding the old one, even if `epoch` was garbage.
local e = redis.pcall('HINCRBY', run, 'epoch', 1)
if type(e) ~= 'number' then redis.call('HSET', run, 'epoch', now_ms) end
redis.call('HSET', run, 'status', 'failed', 'finished_ms', now_ms, 'error', ARGV[2])
redis.pcall('ZADD', finished, now_ms + tonumber(ARGV[4]), run_id)
redis.pcall('XADD', out, '*', 't', 'final', 'a', '0', 'd', ARGV[3])
return {'failed'}
