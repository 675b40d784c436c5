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
ARGV[last]              optional, after everything above (ARGV[11] without KEYS[5..7]): the
                        run's concurrency limit, "<limit>|<limit id>|<label>" (flow control,
                        marbles_rq/engine/flowctl.py), kept in the run's `limit` field, which
                        start_attempt reads; "" or absent: no limit
Returns:
  {"ok", created_ms, enqueued}  recorded by this call (or an earlier send of it); enqueued:
                              1 when delivery 1 is in RQ (written by this call, or found by a
                              resend), 0 when RQ already held a job with its id or its
                              queue key is not a list (nothing written to RQ), or no
                              KEYS[5..7] were given
  {"exists", doc, status}     a run with this id exists already; nothing written
  {"corrupt", reason}         an index key of the bucket holds another type; nothing written
Writes: XADD KEYS[4] (its id's milliseconds are created_ms: the server clock, no TIME);
  ZADD KEYS[2]; HSET KEYS[1]; with KEYS[5..7], unless KEYS[5] exists or KEYS[6] is not a
  list: RPUSH KEYS[6], HSET KEYS[5], SADD KEYS[7] if the list was empty, and the run hash's
  field "enq" = 1 (delivery 1 was enqueued with the record); else ZADD KEYS[3] (the dispatch check: a delivery enqueued by this call
  needs none, as recording and enqueueing cannot be parted)
]]
local run, listing, dispatch, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local run_id, doc, req = ARGV[1], ARGV[2], ARGV[3]
local job, queue, queues = KEYS[5], KEYS[6], KEYS[7]

local existing = redis.call('HMGET', run, 'doc', 'req', 'status', 'created_ms', 'enq')
if existing[1] then
  if existing[2] == req then
    local found = existing[5] == '1' and 1 or (job and redis.call('EXISTS', job) or 0)
    return {'ok', tonumber(existing[4]), found}
  end
  return {'exists', existing[1], existing[3]}
end

-- Redis does not roll a script back when a command fails. The writes that can fail (a key of
-- the bucket holding another type) go first, with pcall, each undone if a later one fails:
-- a broken index cannot leave a recorded run that nothing will ever dispatch.
local function broken(k)
  return {'corrupt', k .. ' holds a ' .. redis.call('TYPE', k).ok}
end
local id = redis.pcall('XADD', out, '*', 't', 'queued', 'a', 1, 'd', ARGV[8])
if type(id) == 'table' then return broken(out) end
local function undo_out()
  redis.call('XDEL', out, id)
  if redis.call('XLEN', out) == 0 then redis.call('DEL', out) end
end
local now_ms = tonumber(string.match(id, '^%d+'))
local listed = redis.pcall('ZADD', listing, now_ms, run_id)
if type(listed) == 'table' then
  undo_out()
  return broken(listing)
end
-- As RQ's unique enqueue: a job id RQ holds already is left alone (the controller's dispatch
-- check sees it there). A queue key of another type is left to the controller's dispatch,
-- which reports it: the run is recorded either way.
local enqueued, pushed = 0, nil
if job and redis.call('EXISTS', job) == 0 then
  -- The id first: RPUSH is the only RQ write here that can fail (a queue key of another
  -- type); no worker can pop it before the hash exists (a script runs alone).
  pushed = redis.pcall('RPUSH', queue, ARGV[11])
  if type(pushed) ~= 'table' then enqueued = 1 end
end
if enqueued == 0 then
  local checked = redis.pcall('ZADD', dispatch, now_ms + tonumber(ARGV[7]), run_id)
  if type(checked) == 'table' then
    redis.call('ZREM', listing, run_id)
    undo_out()
    return broken(dispatch)
  end
end
local fields = {'doc', doc, 'req', req, 'queue', ARGV[4], 'status', 'queued', 'attempt', 1,
  'epoch', 0, 'created_ms', now_ms, 'max_deliveries', ARGV[6], 'retention_ms', ARGV[9]}
-- No timeout and lane 0 are the readers' defaults: left out, the run's hash stays smaller.
if ARGV[5] ~= '0' then
  fields[#fields + 1] = 'timeout_ms'
  fields[#fields + 1] = ARGV[5]
end
if ARGV[10] ~= '0' then
  fields[#fields + 1] = 'lane'
  fields[#fields + 1] = ARGV[10]
end
if enqueued == 1 then  -- start_attempt then knows there is no dispatch check to remove
  fields[#fields + 1] = 'enq'
  fields[#fields + 1] = 1
end
local limit = ARGV[job and (13 + 2 * tonumber(ARGV[12])) or 11]
if limit and limit ~= '' then  -- flow control: start_attempt reads it
  fields[#fields + 1] = 'limit'
  fields[#fields + 1] = limit
end
redis.call('HSET', run, unpack(fields))
if enqueued == 1 then
  local n = tonumber(ARGV[12])
  redis.call('HSET', job, unpack(ARGV, 13, 12 + 2 * n))
  -- RQ's enqueue adds the queue to its set of queues every time; here only when the list was
  -- empty (new, or emptied): a queue that holds jobs was added when its first one came, and
  -- the workers add the queues they serve with each registration renewal (transport/lean.py).
  if pushed == 1 then redis.pcall('SADD', queues, queue) end
end
return {'ok', now_ms, enqueued}
