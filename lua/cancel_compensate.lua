#!lua
--[[ cancel_compensate: cancel a run and undo what it did: its registered compensations run
(in a delivery of their own) before it ends cancelled. A running run is flagged: its
execution stops at its next boundary as for any cancel, then hands the run over
(hand_over_compensation); should it vanish first, the reaper redelivers it and its next start
writes the phase marker (start_attempt). A run that started before and is waiting or queued
gets the marker in its ledger now, and a waiting one a new delivery. A run that never started
has nothing to undo: it is settled cancelled at once, as cancel_run does.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
KEYS[3] lease zset      <tag>:leases
KEYS[4] dispatch zset   <tag>:dispatch
KEYS[5] output stream   <tag>:out:<run id>
KEYS[6] finished zset   <tag>:finished
KEYS[7] waits zset      <tag>:waits
KEYS[8] asks hash       <tag>:asks:<run id>
KEYS[9] feed zset       <tag>:feed
ARGV[1] run_id
ARGV[2] marker          StepRecord JSON of the phase marker (ledger key "|compensate")
ARGV[3] event           JSON data of the output event (the final one when settled now)
ARGV[4] request_id      a resend with the same id answers what the first send answered
ARGV[5] grace_ms        a woken run's dispatch check comes due after this long
Returns:
  {"requested"}             running: it stops, then compensates in a new delivery
  {"woken", attempt, queue} it was waiting: queued as <attempt> to compensate; the caller
                            enqueues it
  {"queued"}                it was queued after it had started: its owed delivery compensates
  {"cancelled"}             it never started: settled cancelled now
  {"settled", status}       already finished; nothing written
  {"compensating", ends}    compensating already (ends: failed | cancelled, the phase
                            marker's status); nothing written
  {"missing"}               no such run
  {"corrupt", reason}       an index key of the bucket holds another type; nothing written
Writes: HSET/HINCRBY/HDEL KEYS[1]; HSETNX KEYS[2]; ZREM KEYS[3], KEYS[7], KEYS[9]; ZADD/ZREM
  KEYS[4]; XADD KEYS[5]; ZADD KEYS[6] when settled; HSET KEYS[8]
]]
local run, steps, leases, dispatch, out, finished, waits, asks, feed = KEYS[1], KEYS[2],
  KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local run_id, marker, ev, req = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local r = redis.call('HMGET', run, 'status', 'attempt', 'cancel', 'cancel_req', 'cancel_outcome',
  'retention_ms', 'epoch', 'queue', 'compensate')
if not r[1] then return {'missing'} end
if r[4] == req and r[5] then  -- a resend: the first send's answer
  if r[5] == 'woken' then return {'woken', tonumber(r[2]), r[8]} end
  return {r[5]}
end
if r[1] == 'succeeded' or r[1] == 'failed' or r[1] == 'cancelled' then
  return {'settled', r[1]}
end
-- Compensating already (its body failed, or a cancel asked before): the undos are under
-- way and the marker says how the run ends; waking it would only cut an undo's retry wait.
if redis.call('TYPE', steps).ok == 'hash' then
  local current = redis.call('HGET', steps, '|compensate')
  if current then return {'compensating', cjson.decode(current).status or 'failed'} end
end
if r[1] == 'running' then
  if r[9] then return {'requested'} end  -- asked already
  redis.call('HSET', run, 'cancel', '1', 'compensate', marker, 'cancel_req', req,
    'cancel_outcome', 'requested')
  redis.call('XADD', out, '*', 't', 'cancel_requested', 'a', r[2], 'd', ev)
  return {'requested'}
end
for k, want in pairs({[leases] = 'zset', [dispatch] = 'zset', [finished] = 'zset',
                      [out] = 'stream', [waits] = 'zset', [asks] = 'hash', [feed] = 'zset',
                      [steps] = 'hash'}) do
  local kind = redis.call('TYPE', k).ok
  if kind ~= 'none' and kind ~= want then return {'corrupt', k .. ' holds a ' .. kind} end
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function close_asks()
  local fields = redis.call('HGETALL', asks)
  for j = 1, #fields, 2 do
    if fields[j + 1] == 'open' and string.sub(fields[j], -6) == '|state' then
      local key = string.sub(fields[j], 1, -7)
      redis.call('HSET', asks, fields[j], 'cancelled')
      redis.call('HINCRBY', asks, key .. '|rev', 1)
      redis.call('ZREM', feed, run_id .. '|' .. key)
    end
  end
end
if r[1] == 'queued' and (r[7] or '0') == '0' then
  -- Never started: no step ran, so none registered an undo.
  redis.call('HSET', run, 'status', 'cancelled', 'cancel', '1', 'finished_ms', now_ms,
    'cancel_req', req, 'cancel_outcome', 'cancelled')
  redis.call('HDEL', run, 'note', 'wait_reason', 'wait_for', 'wait_since', 'wake_at')
  redis.call('HINCRBY', run, 'epoch', 1)
  redis.call('ZREM', leases, run_id)
  redis.call('ZREM', dispatch, run_id)
  redis.call('ZREM', waits, run_id)
  close_asks()
  redis.call('ZADD', finished, now_ms + (tonumber(r[6] or '') or 604800000), run_id)
  redis.call('XADD', out, '*', 't', 'final', 'a', r[2], 'd', ev)
  return {'cancelled'}
end
redis.call('HSETNX', steps, '|compensate', marker)
if r[1] == 'queued' then
  redis.call('HSET', run, 'cancel_req', req, 'cancel_outcome', 'queued')
  redis.call('HDEL', run, 'pause')
  redis.call('XADD', out, '*', 't', 'compensating', 'a', r[2], 'd', ev)
  return {'queued'}
end
-- Waiting: its waits end now (questions closed); a delivery that does not count against
-- max deliveries runs the compensations.
close_asks()
local attempt = tonumber(r[2]) + 1
redis.call('HSET', run, 'status', 'queued', 'attempt', attempt, 'cancel_req', req,
  'cancel_outcome', 'woken')
redis.call('HINCRBY', run, 'deferred', 1)
redis.call('HDEL', run, 'wait_reason', 'wait_for', 'wait_since', 'wake_at', 'wake_pending',
  'pause')
redis.call('ZREM', waits, run_id)
redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[5]), run_id)
redis.call('XADD', out, '*', 't', 'compensating', 'a', attempt, 'd', ev)
return {'woken', attempt, r[8]}
