#!lua
--[[ claim_run: record a run before anything is enqueued (journal first); insert-if-absent.
When the store and RQ share one standalone Redis, the same call also enqueues the run's first
delivery (KEYS[5..7], ARGV[10..]): recording and enqueueing are then one round trip, and the
journal-first order holds inside the script. Otherwise only KEYS[1..4] are given and the
caller enqueues after it.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] run listing     <tag>:idx:run            zset run id -> created (server ms)
KEYS[3] dispatch zset   <tag>:dispatch           run id -> when the controller checks it
KEYS[4] output stream   <tag>:out:<run id>
KEYS[5] job hash        optional: RQ's job key of delivery 1 (rq:job:<job id>)
KEYS[6] queue list      optional: RQ's key of the run's queue (rq:queue:<prefix>.<queue>)
KEYS[7] queues set      optional: RQ's set of queue keys (rq:queues)
ARGV[1] run_id
ARGV[2] doc             RunRecord JSON, stored verbatim
ARGV[3] request_id      a resend with the same id answers "ok" again
ARGV[4] queue           RQ queue name
ARGV[5] timeout_ms      run timeout from its first start, 0 = none
ARGV[6] max_deliveries  give up after this many deliveries (poison runs)
ARGV[7] grace_ms        how long the enqueuer has before the controller dispatches it
ARGV[8] event           JSON data of the "queued" output event
ARGV[9] retention_ms    how long the run is kept after it finishes, then pruned
ARGV[10] lane           the run's lane (transport/lanes.py): every delivery goes through it
ARGV[11] job_id         with KEYS[5..7]: delivery 1's RQ job id, pushed on the queue list
ARGV[12] fields         with KEYS[5..7]: how many field, value pairs follow
ARGV[13..]              with KEYS[5..7]: the job hash: field, value, ... (Job.to_dict of the
                        delivery's job, built by RQ in marbles_rq/transport/dispatch.py)
Returns:
  {"ok", created_ms, enqueued}  recorded by this call (or an earlier send of it); enqueued:
                              1 when delivery 1 is in RQ (written by this call, or found by a
                              resend), 0 when RQ already held a job with its id or its
                              queue key is not a list (nothing written to RQ), or no
                              KEYS[5..7] were given
  {"exists", doc, status}     a run with this id exists already; nothing written
  {"corrupt", reason}         an index key of the bucket holds another type; nothing written
Writes: HSET KEYS[1]; ZADD KEYS[2]; ZADD KEYS[3]; XADD KEYS[4]; with KEYS[5..7], unless
  KEYS[5] exists or KEYS[6] is not a list: RPUSH KEYS[6]; HSET KEYS[5]; SADD KEYS[7]
]]
local run, listing, dispatch, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local run_id, doc, req = ARGV[1], ARGV[2], ARGV[3]
local job, queue, queues = KEYS[5], KEYS[6], KEYS[7]

local existing = redis.call('HMGET', run, 'doc', 'req', 'status', 'created_ms')
if existing[1] then
  if existing[2] == req then
    local found = job and redis.call('EXISTS', job) or 0
    return {'ok', tonumber(existing[4]), found}
  end
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
  'max_deliveries', ARGV[6], 'retention_ms', ARGV[9], 'lane', ARGV[10])
redis.call('ZADD', listing, now_ms, run_id)
redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[7]), run_id)
redis.call('XADD', out, '*', 't', 'queued', 'a', 1, 'd', ARGV[8])
if not job then return {'ok', now_ms, 0} end
-- As RQ's unique enqueue: a job id RQ holds already is left alone (the controller's dispatch
-- check sees it there). A queue key of another type is left to the controller's dispatch,
-- which reports it: the run is recorded either way.
if redis.call('EXISTS', job) == 1 then return {'ok', now_ms, 0} end
-- The id first: RPUSH is the only write here that can fail (a queue key of another type);
-- no worker can pop it before the hash exists (a script runs alone).
local pushed = redis.pcall('RPUSH', queue, ARGV[11])
if type(pushed) == 'table' and pushed.err then return {'ok', now_ms, 0} end
local n = tonumber(ARGV[12])
redis.call('HSET', job, unpack(ARGV, 13, 12 + 2 * n))
redis.pcall('SADD', queues, queue)
return {'ok', now_ms, 1}
