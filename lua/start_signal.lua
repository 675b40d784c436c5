#!lua
--[[ start_signal: signal-with-start. Records the run if its id is new (as claim_run does,
enqueueing its first delivery in the same call when the store and RQ share one standalone
Redis) and appends the signal to it, in one call: the signal can never be dropped between
a check for the run and its start, and a run that starts sees it buffered. If the run
exists, the signal is delivered to it as send_signal does (waking it when it is parked
waiting for that name); a finished run refuses it.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] run listing     <tag>:idx:run            zset run id -> created (server ms)
KEYS[3] dispatch zset   <tag>:dispatch           run id -> when the controller checks it
KEYS[4] output stream   <tag>:out:<run id>
KEYS[5] signals hash    <tag>:sig:<run id>
KEYS[6] waits zset      <tag>:waits
KEYS[7] request marker  <tag>:req:<request id>     the first send's reply, for a resend
KEYS[8] job hash        optional: RQ's job key of delivery 1 (rq:job:<job id>)
KEYS[9] queue list      optional: RQ's key of the run's queue (rq:queue:<prefix>.<queue>)
KEYS[10] queues set     optional: RQ's set of queue keys (rq:queues)
ARGV[1] run_id
ARGV[2] doc             RunRecord JSON, stored verbatim (used only if the run is new)
ARGV[3] request_id      kept as the new run's `req`, as claim_run does
ARGV[4] queue           RQ queue name
ARGV[5] timeout_ms      run timeout from its first start, 0 = none
ARGV[6] max_deliveries  give up after this many deliveries (poison runs)
ARGV[7] grace_ms        how long the enqueuer has before the controller dispatches it (also
                        the dispatch check of a run the signal wakes)
ARGV[8] event           JSON data of the "queued" output event
ARGV[9] retention_ms    how long the run is kept after it finishes, then pruned
ARGV[10] lane           the run's lane (transport/lanes.py)
ARGV[11] limit          the run's concurrency limit "<limit>|<limit id>|<label>", "" none
ARGV[12] name           the signal's name
ARGV[13] payload        the signal's payload, JSON, stored verbatim
ARGV[14] event_head     JSON text of the "signal" output event without its end (the script
                        appends the sequence number and '}')
ARGV[15] marker_ms      how long the request marker is kept
ARGV[16] max_buffered   refuse when this many signals of the name wait to be taken
ARGV[17] job_id         with KEYS[8..10]: delivery 1's RQ job id, pushed on the queue list
ARGV[18] fields         with KEYS[8..10]: how many field, value pairs follow
ARGV[19..]              with KEYS[8..10]: the job hash: field, value, ...
Returns:
  {"created", seq, enqueued}    the run was recorded by this call with signal <seq> (1)
                                buffered; enqueued as claim_run's
  {"exists", seq, attempt, queue, doc, status}  the run existed: signal <seq> was appended
                                to it; attempt > 0: it was woken as that delivery and the
                                caller enqueues it on <queue>
  {"settled", status, doc}      the run existed and is finished; nothing written
  {"full", buffered}            too many signals of the name wait already; nothing written
  {"corrupt", reason}           an index key of the bucket holds another type; nothing written
Writes: as claim_run for a new run (XADD KEYS[4]; ZADD KEYS[2]; HSET KEYS[1]; RPUSH KEYS[9],
  HSET KEYS[8], SADD KEYS[10], or ZADD KEYS[3]); then, new or not, HSET KEYS[5], XADD
  KEYS[4], SET KEYS[7]; for an existing run waiting for the name as send_signal
  (HSET/HINCRBY/HDEL KEYS[1], ZREM KEYS[6], ZADD KEYS[3])
]]
local run, listing, dispatch, out, sigs, waits, marker = KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  KEYS[5], KEYS[6], KEYS[7]
local job, queue, queues = KEYS[8], KEYS[9], KEYS[10]
local run_id, doc, name = ARGV[1], ARGV[2], ARGV[12]

local seen = redis.call('GET', marker)
if seen then  -- a resend: the first send's reply
  local kind, a, b, c = string.match(seen, '^(%a+)|(%d+)|(%d+)|(.*)$')
  if kind == 'created' then return {'created', tonumber(a), tonumber(b)} end
  local e = redis.call('HMGET', run, 'doc', 'status')
  return {'exists', tonumber(a), tonumber(b), c, e[1] or '', e[2] or ''}
end

local function append(now_ms, attempt_field)
  local s = redis.call('HMGET', sigs, name .. '|n')
  local seq = tonumber(s[1] or '0') + 1
  redis.call('HSET', sigs, name .. '|n', seq, name .. '|' .. seq, ARGV[13],
    name .. '|' .. seq .. '|at', now_ms)
  redis.call('XADD', out, '*', 't', 'signal', 'a', attempt_field, 'd', ARGV[14] .. seq .. '}')
  return seq
end

local existing = redis.call('HMGET', run, 'doc', 'status', 'attempt', 'pause', 'queue',
  'wait_for')
if existing[1] then
  local status = existing[2]
  if status == 'succeeded' or status == 'failed' or status == 'cancelled' then
    return {'settled', status, existing[1]}
  end
  local s = redis.call('HMGET', sigs, name .. '|n', name .. '|c')
  local buffered = tonumber(s[1] or '0') - tonumber(s[2] or '0')
  if buffered >= tonumber(ARGV[16]) then return {'full', buffered} end
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local seq = append(now_ms, existing[3])
  local wanted = false
  if status == 'waiting' and existing[4] ~= '1' then
    local ok, wait_for = pcall(cjson.decode, existing[6] or '{}')
    if ok and type(wait_for) == 'table' and type(wait_for.signals) == 'table' then
      for _, n in ipairs(wait_for.signals) do
        if n == name then wanted = true end
      end
    end
  end
  local attempt = 0
  if wanted then
    attempt = tonumber(existing[3]) + 1
    redis.call('HSET', run, 'status', 'queued', 'attempt', attempt)
    redis.call('HINCRBY', run, 'deferred', 1)
    redis.call('HINCRBY', run, 'resumptions', 1)
    redis.call('HDEL', run, 'wait_reason', 'wait_for', 'wait_since', 'wake_at', 'wake_pending')
    redis.call('ZREM', waits, run_id)
    redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[7]), run_id)
    redis.call('XADD', out, '*', 't', 'woken', 'a', attempt, 'd', '{"cause":"signal"}')
    status = 'queued'
  end
  local q = existing[5] or ''
  redis.call('SET', marker, 'exists|' .. seq .. '|' .. attempt .. '|' .. q, 'PX', ARGV[15])
  return {'exists', seq, attempt, q, existing[1], status}
end

-- A new run: recorded as claim_run records it (the writes that can fail first, each undone
-- if a later one fails), then its first signal.
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
if redis.call('TYPE', sigs).ok ~= 'none' and redis.call('TYPE', sigs).ok ~= 'hash' then
  undo_out()
  return broken(sigs)
end
local listed = redis.pcall('ZADD', listing, now_ms, run_id)
if type(listed) == 'table' then
  undo_out()
  return broken(listing)
end
local enqueued, pushed = 0, nil
if job and redis.call('EXISTS', job) == 0 then
  pushed = redis.pcall('RPUSH', queue, ARGV[17])
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
local fields = {'doc', doc, 'req', ARGV[3], 'queue', ARGV[4], 'status', 'queued', 'attempt', 1,
  'epoch', 0, 'created_ms', now_ms, 'timeout_ms', ARGV[5], 'max_deliveries', ARGV[6],
  'retention_ms', ARGV[9], 'lane', ARGV[10]}
if enqueued == 1 then
  fields[#fields + 1] = 'enq'
  fields[#fields + 1] = 1
end
if ARGV[11] ~= '' then
  fields[#fields + 1] = 'limit'
  fields[#fields + 1] = ARGV[11]
end
redis.call('HSET', run, unpack(fields))
if enqueued == 1 then
  local n = tonumber(ARGV[18])
  redis.call('HSET', job, unpack(ARGV, 19, 18 + 2 * n))
  if pushed == 1 then redis.pcall('SADD', queues, queue) end
end
local seq = append(now_ms, 1)
redis.call('SET', marker, 'created|' .. seq .. '|' .. enqueued .. '|', 'PX', ARGV[15])
return {'created', seq, enqueued}
