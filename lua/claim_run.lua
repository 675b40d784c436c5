#!lua
--[[ claim_run: record a run before anything is enqueued (journal first); insert-if-absent.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] run listing     <tag>:idx:run            zset run id -> created (server ms)
KEYS[3] dispatch zset   <tag>:dispatch           run id -> when the controller checks it
KEYS[4] output stream   <tag>:out:<run id>
ARGV[1] run_id
ARGV[2] doc             RunRecord JSON, stored verbatim
ARGV[3] request_id      a resend with the same id answers "ok" again
ARGV[4] queue           RQ queue name
ARGV[5] timeout_ms      run timeout from its first start, 0 = none
ARGV[6] max_deliveries  give up after this many deliveries (poison runs)
ARGV[7] grace_ms        how long the enqueuer has before the controller dispatches it
ARGV[8] event           JSON data of the "queued" output event
ARGV[9] retention_ms    how long the run is kept after it finishes, then pruned
Returns:
  {"ok", created_ms}          recorded by this call (or an earlier send of it)
  {"exists", doc, status}     a run with this id exists already; nothing written
  {"corrupt", reason}         an index key of the bucket holds another type; nothing written
Writes: HSET KEYS[1]; ZADD KEYS[2]; ZADD KEYS[3]; XADD KEYS[4]
]]
local run, listing, dispatch, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local run_id, doc, req = ARGV[1], ARGV[2], ARGV[3]

local existing = redis.call('HMGET', run, 'doc', 'req', 'status', 'created_ms')
if existing[1] then
  if existing[2] == req then return {'ok', tonumber(existing[4])} end
  return {'exists', existing[1], existing[3]}
end

-- Redis does not roll a script back when a command fails: check the key types first, so a
-- broken index cannot leave a recorded run that nothing will ever dispatch.
for k, want in pairs({[listing] = 'zset', [dispatch] = 'zset', [out] = 'stream'}) do
  local kind = redis.call('TYPE', k).ok
  if kind ~= 'none' and kind ~= want then return {'corrupt', k .. ' holds a ' .. kind} end
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', run, 'doc', doc, 'req', req, 'queue', ARGV[4], 'status', 'queued',
  'attempt', 1, 'epoch', 0, 'created_ms', now_ms, 'timeout_ms', ARGV[5],
  'max_deliveries', ARGV[6], 'retention_ms', ARGV[9])
redis.call('ZADD', listing, now_ms, run_id)
redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[7]), run_id)
redis.call('XADD', out, '*', 't', 'queued', 'a', 1, 'd', ARGV[8])
return {'ok', now_ms}
