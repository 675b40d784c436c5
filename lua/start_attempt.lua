#!lua
--[[ start_attempt: a worker begins executing delivery <attempt> of a run. It takes the
run's lease under a new epoch (the fence every later write of this execution checks) and
returns the record and the ledger, so replay needs no other read.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>     step key -> StepRecord JSON
KEYS[3] lease zset      <tag>:leases             run id -> lease expiry (server ms)
KEYS[4] dispatch zset   <tag>:dispatch
KEYS[5] output stream   <tag>:out:<run id>
KEYS[6] finished zset   <tag>:finished           run id -> when it may be pruned (server ms)
ARGV[1] run_id
ARGV[2] attempt         the delivery number the RQ job carries
ARGV[3] ttl_ms          lease length
ARGV[4] worker          name of the executing worker (for status and output)
ARGV[5] final_cancel    JSON data of the final event if the run turns out cancelled
ARGV[6] final_timeout   JSON data of the final event if the run's deadline has passed
ARGV[7] token           unique per start call; a resend that finds its own start answers "ok"
ARGV[8] slot            "1": the caller holds the run's concurrency slot (acquire_slot); else
                        a run recorded with a limit is not started (needs_slot)
ARGV[9] cap_ms          0, or the lease ends at most at this (server ms): the expiry of the
                        caller's slot, so a live lease always lies within a live hold
Returns:
  {"ok", epoch, doc, deadline_ms, ledger, now_ms, attempt, resumptions, kind}
                              ledger = flat {key, record, ...}; now_ms: the server clock at
                              the start (timers are on it); attempt: 1 + redeliveries (the
                              delivery number less the deliveries that do not count: wakes,
                              hand-backs, holds); resumptions: wakes after a park; kind: what
                              made this execution: first | redelivery (attempt grew since the
                              previous start) | resumption (a wake since it) | handback
  {"missing"}                 no such run
  {"settled", status}         the run is finished; this delivery is a no-op
  {"stale_attempt", attempt}  a newer delivery exists; this one is a no-op
  {"busy", epoch}             another execution of this delivery holds a live lease
  {"cancelled"}               cancel was requested before it started: settled cancelled now
                              (unless that cancel asked for compensation: its phase marker
                              goes into the ledger, the flag is lifted, and it starts)
  {"timed_out"}               its deadline passed: settled failed now
  {"waiting"}                 the run is parked; this delivery is a no-op (a wake makes a
                              new one)
  {"paused"}                  a pause was asked: parked now (reason paused), nothing started
  {"corrupt", reason}         the run's hash is unreadable; nothing written
  {"needs_slot", limit}       the run has a concurrency limit (its `limit` field, recorded by
                              claim_run: "<limit>|<limit id>|<label>") and ARGV[8] is not
                              "1": take a slot, then start again; nothing written
Writes: only for a fresh ok, cancelled, timed_out or paused (HSET/HINCRBY KEYS[1], HSETNX
  KEYS[2] and HDEL KEYS[1] for a cancel that asked for compensation, ZADD/ZREM
  KEYS[3], ZREM KEYS[4], XADD KEYS[5], ZADD KEYS[6] when settled). A fresh ok: XADD KEYS[5],
  one HSET KEYS[1], ZADD KEYS[3], and ZREM KEYS[4] unless
  the run never started and its first delivery was enqueued with its record (field "enq":
  no dispatch check was written). The ledger is not read for a run that never started
  (epoch 0: nothing can have written it).
]]
local run, steps, leases, dispatch, out, finished = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6]
local run_id, attempt, ttl_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])

local r = redis.pcall('HMGET', run, 'doc', 'status', 'attempt', 'epoch', 'cancel',
  'deadline_ms', 'timeout_ms', 'start_token', 'retention_ms', 'pause', 'started_ms', 'note',
  'enq', 'limit', 'holds', 'deferred', 'resumptions', 'start_seen', 'start_kind', 'compensate')
if r.err then return {'corrupt', 'the run key is not a hash'} end
if not r[1] then return {'missing'} end
local status = r[2]
if status == 'succeeded' or status == 'failed' or status == 'cancelled' then
  return {'settled', status}
end
for i, name in pairs({[3] = 'attempt', [4] = 'epoch', [6] = 'deadline_ms', [7] = 'timeout_ms',
                      [9] = 'retention_ms'}) do
  -- Whole numbers only: Lua's tonumber also takes 1.5, 1e999, inf, nan and 0x10.
  if r[i] and not (string.match(r[i], '^%d+$') and #r[i] <= 15) then
    return {'corrupt', 'field ' .. name .. ' is not a whole number'}
  end
end
if not r[3] or r[3] == '0' then return {'corrupt', 'field attempt is missing or 0'} end
if status == 'waiting' then return {'waiting'} end
if status ~= 'queued' and status ~= 'running' then
  return {'corrupt', 'field status is ' .. tostring(status)}
end
if attempt ~= tonumber(r[3]) then return {'stale_attempt', tonumber(r[3])} end

local deadline = tonumber(r[6] or '0')
-- The server clock: read here when a lease or a deadline must be checked before any write,
-- else once it is needed (clock()).
local now_ms
if status == 'running' or deadline > 0 then
  local t = redis.call('TIME')
  now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Attempts count only deliveries that replace a vanished execution (the same count that
-- max deliveries limits); a resumption after a park is counted apart.
local tries = math.max(1, tonumber(r[3]) - (tonumber(r[16] or '0') or 0))
local resumed = tonumber(r[17] or '0') or 0
if status == 'running' and r[8] == ARGV[7] then  -- our own start, resent
  return {'ok', tonumber(r[4]), r[1], tonumber(r[6] or '0'), redis.call('HGETALL', steps),
    now_ms, tries, resumed, r[19] or 'first'}
end
if status == 'running' then
  local lease_until = tonumber(redis.call('ZSCORE', leases, run_id) or '0')
  if lease_until > now_ms then return {'busy', tonumber(r[4])} end
end

local function settle(final_status, error_json, final_event)
  redis.call('HSET', run, 'status', final_status, 'finished_ms', now_ms)
  if error_json then redis.call('HSET', run, 'error', error_json) end
  -- Fences whatever still holds the old epoch (a zombie's effect claims included).
  redis.call('HINCRBY', run, 'epoch', 1)
  redis.call('HDEL', run, 'note')
  redis.call('ZREM', leases, run_id)
  redis.call('ZREM', dispatch, run_id)
  redis.call('ZADD', finished, now_ms + tonumber(r[9] or '604800000'), run_id)
  redis.call('XADD', out, '*', 't', 'final', 'a', attempt, 'd', final_event)
end
local function clock()
  if not now_ms then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now_ms
end
if r[5] == '1' and r[20] then
  -- Its execution vanished after a cancel that asked for compensation: this one compensates.
  redis.call('HSETNX', steps, '|compensate', r[20])
  redis.call('HDEL', run, 'cancel', 'compensate')
elseif r[5] == '1' then
  clock()
  settle('cancelled', nil, ARGV[5])
  return {'cancelled'}
end
if deadline > 0 and now_ms > deadline then
  settle('failed', '{"type":"RunTimeout","message":"the run passed its timeout"}', ARGV[6])
  return {'timed_out'}
end

if r[10] == '1' then
  clock()
  redis.call('HSET', run, 'status', 'waiting', 'wait_reason', 'paused', 'wait_for', '{}',
    'wait_since', now_ms, 'wake_at', 0)
  redis.call('HINCRBY', run, 'epoch', 1)
  redis.call('HDEL', run, 'note', 'worker')
  redis.call('ZREM', leases, run_id)
  redis.call('ZREM', dispatch, run_id)
  redis.call('XADD', out, '*', 't', 'parked', 'a', attempt, 'd', '{"reason":"paused"}')
  return {'paused'}
end

-- Flow control: after every check that settles or parks without running (those need no
-- slot), before the first write of a real start.
if r[14] and r[14] ~= '' and ARGV[8] ~= '1' then return {'needs_slot', r[14]} end

local epoch = tonumber(r[4] or '0') + 1
-- What made this execution, from the counts the previous start saw ("<tries>|<resumptions>").
local kind = 'first'
if r[11] then  -- it started before
  local seen_tries, seen_resumed = string.match(r[18] or '', '^(%d+)|(%d+)$')
  if seen_tries and tries > tonumber(seen_tries) then kind = 'redelivery'
  elseif seen_tries and resumed > tonumber(seen_resumed) then kind = 'resumption'
  elseif seen_tries then kind = 'handback'
  else kind = 'redelivery' end  -- started before these counts were kept
end
redis.call('XADD', out, '*', 't', 'attempt_started', 'a', attempt,
  'd', cjson.encode({epoch = epoch, worker = ARGV[4], attempt = tries, resumptions = resumed,
    kind = kind}))
-- The server clock itself, never the event's id: a stream's ids never go back, so after the
-- clock stepped back they run ahead of it, and the execution judges its timers on now_ms (a
-- timer due later would be seen fired, a new one set that much late).
clock()
local fields = {'epoch', epoch, 'status', 'running', 'worker', ARGV[4], 'start_token', ARGV[7],
  'wseq', 0, 'start_seen', tries .. '|' .. resumed, 'start_kind', kind}
if deadline == 0 and tonumber(r[7] or '0') > 0 then
  deadline = now_ms + tonumber(r[7])
  fields[#fields + 1] = 'deadline_ms'
  fields[#fields + 1] = deadline
end
if not r[11] then
  fields[#fields + 1] = 'started_ms'
  fields[#fields + 1] = now_ms
end
redis.call('HSET', run, unpack(fields))
if r[12] or r[15] then redis.call('HDEL', run, 'note', 'holds') end
local cap = tonumber(ARGV[9] or '0') or 0
redis.call('ZADD', leases, (cap > 0 and cap < now_ms + ttl_ms) and cap or now_ms + ttl_ms, run_id)
local fresh = r[4] == '0' and attempt == 1
if not (fresh and r[13] == '1') then redis.call('ZREM', dispatch, run_id) end
return {'ok', epoch, r[1], deadline, fresh and {} or redis.call('HGETALL', steps), now_ms,
  tries, resumed, kind}
