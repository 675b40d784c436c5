#!lua
--[[ claim_runs: claim_run for a chunk of runs whose first deliveries are enqueued with them,
in one call: what a batch enqueue sends when the store and RQ share one standalone Redis
(the chunk's keys span many buckets and RQ's keyspace: never on a cluster). Each run is
recorded, and its delivery enqueued, exactly as claim_run with KEYS[5..7] would, in order;
the per-call cost (the script's start, its arguments' tables, a reply per call) is paid
once a chunk, and the fields every delivery's job hash shares are sent once.
KEYS, per run i (7 each, the i-th group): run hash <tag>:run:<run id>, run listing
  <tag>:idx:run, dispatch zset <tag>:dispatch, output stream <tag>:out:<run id>, RQ's job
  key of delivery 1, RQ's queue list of the run's queue, RQ's set of queue keys (rq:queues)
ARGV[1] count           n, the runs in the chunk
ARGV[2] shared          m, how many job hash field, value pairs every delivery has alike
ARGV[3] own             p, how many job hash fields differ per delivery
ARGV[4..]               the m shared pairs (field, value, ...), then the p names of the
                        fields that differ, then per run 12 + p values: run_id, doc,
                        request_id, queue, timeout_ms, max_deliveries, grace_ms, event,
                        retention_ms, lane, job_id, limit ("" for none), then its p values;
                        each as claim_run's ARGV of the same name
Returns:
  one reply per run, in order, each what claim_run answers:
  {"ok", created_ms, enqueued} | {"exists", doc, status} | {"corrupt", reason}
Writes, per run: what claim_run writes with KEYS[5..7] (XADD, ZADD listing, RPUSH, HSET
  run, HSET job, SADD when the list was empty; or ZADD dispatch when RQ already held a job
  with its id or its queue key is not a list).
]]
local n, m, p = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local names_at = 4 + 2 * m  -- first of the p per-delivery field names
local first = names_at + p  -- first value of run 1
local width = 12 + p

-- The job hash fields every delivery shares, read once; each run's own values follow them.
local shared = {}
for i = 4, 3 + 2 * m do shared[#shared + 1] = ARGV[i] end

-- As claim_run: the writes that can fail go first, each undone if a later one fails.
local function broken(key)
  return {'corrupt', key .. ' holds a ' .. redis.call('TYPE', key).ok}
end
local function undo_out(out, id)
  redis.call('XDEL', out, id)
  if redis.call('XLEN', out) == 0 then redis.call('DEL', out) end
end

local function claim(k, a)
  local run, listing, dispatch, out = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local job, queue, queues = KEYS[k + 5], KEYS[k + 6], KEYS[k + 7]
  local run_id, doc, req = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local existing = redis.call('HMGET', run, 'doc', 'req', 'status', 'created_ms', 'enq')
  if existing[1] then
    if existing[2] == req then
      local found = existing[5] == '1' and 1 or redis.call('EXISTS', job)
      return {'ok', tonumber(existing[4]), found}
    end
    return {'exists', existing[1], existing[3]}
  end
  local id = redis.pcall('XADD', out, '*', 't', 'queued', 'a', 1, 'd', ARGV[a + 7])
  if type(id) == 'table' then return broken(out) end
  local now_ms = tonumber(string.match(id, '^%d+'))
  local listed = redis.pcall('ZADD', listing, now_ms, run_id)
  if type(listed) == 'table' then
    undo_out(out, id)
    return broken(listing)
  end
  local enqueued, pushed = 0, nil
  if redis.call('EXISTS', job) == 0 then
    pushed = redis.pcall('RPUSH', queue, ARGV[a + 10])
    if type(pushed) ~= 'table' then enqueued = 1 end
  end
  if enqueued == 0 then
    local checked = redis.pcall('ZADD', dispatch, now_ms + tonumber(ARGV[a + 6]), run_id)
    if type(checked) == 'table' then
      redis.call('ZREM', listing, run_id)
      undo_out(out, id)
      return broken(dispatch)
    end
  end
  local fields = {'doc', doc, 'req', req, 'queue', ARGV[a + 3], 'status', 'queued',
    'attempt', 1, 'epoch', 0, 'created_ms', now_ms, 'max_deliveries', ARGV[a + 5],
    'retention_ms', ARGV[a + 8]}
  if ARGV[a + 4] ~= '0' then  -- as claim_run: no timeout and lane 0 are left out
    fields[#fields + 1] = 'timeout_ms'
    fields[#fields + 1] = ARGV[a + 4]
  end
  if ARGV[a + 9] ~= '0' then
    fields[#fields + 1] = 'lane'
    fields[#fields + 1] = ARGV[a + 9]
  end
  if enqueued == 1 then
    fields[#fields + 1] = 'enq'
    fields[#fields + 1] = 1
  end
  local limit = ARGV[a + 11]
  if limit ~= '' then
    fields[#fields + 1] = 'limit'
    fields[#fields + 1] = limit
  end
  redis.call('HSET', run, unpack(fields))
  if enqueued == 1 then
    local job_fields = {unpack(shared)}
    for j = 0, p - 1 do
      job_fields[#job_fields + 1] = ARGV[names_at + j]
      job_fields[#job_fields + 1] = ARGV[a + 12 + j]
    end
    redis.call('HSET', job, unpack(job_fields))
    if pushed == 1 then redis.pcall('SADD', queues, queue) end
  end
  return {'ok', now_ms, enqueued}
end

local replies = {}
for i = 0, n - 1 do
  replies[i + 1] = claim(7 * i, first + width * i)
end
return replies
