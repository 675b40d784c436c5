#!lua
--[[ park_run: an execution stops because its run must wait (a question, a timer, a child
run, a pause). The run holds no worker while it waits: its lease is dropped and its epoch
raised, and it is woken later as a new delivery that replays the ledger. What the wait needs
(the ledger entries of its timers, its new questions) is written in the same call. A wake
that came while the run was still executing (a child settled meanwhile) requeues it at once.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] lease zset      <tag>:leases
KEYS[3] dispatch zset   <tag>:dispatch
KEYS[4] output stream   <tag>:out:<run id>
KEYS[5] waits zset      <tag>:waits               run id -> when the controller looks at it
KEYS[6] ledger hash     <tag>:steps:<run id>
KEYS[7] asks hash       <tag>:asks:<run id>
KEYS[8] feed zset       <tag>:feed                open questions "<run id>|<key>" -> asked ms
KEYS[9] signals hash    <tag>:sig:<run id>        a signal it parks for that is buffered
                                                  already requeues it (send_signal)
KEYS[10] notices zset   <tag>:notices             pause notifications to send -> due ms
ARGV[1] epoch           the execution's fence
ARGV[2] run_id
ARGV[3] reason          question | timer | child | retry | failed_step (paused wins when a
                        pause was asked); failed_step lists "<run id>|!failed_step" in the
                        feed
ARGV[4] wake_at_ms      when the controller wakes it (server ms); 0 = only from outside
ARGV[5] wait_for        JSON shown by status: what the run waits for ({"children": [...]}
                        makes a child's wake_pending requeue it; {"signals": [names]} one
                        of those names with a signal not taken yet)
ARGV[6] grace_ms        a requeued run's dispatch check comes due after this long
ARGV[7] event           JSON data of the "parked" output event
ARGV[8] n_ledger        how many (key, record) pairs follow, written to the ledger
ARGV[9] n_asks          how many (key, doc, timeout_ms) triples follow them: questions,
                        recorded open unless recorded already
ARGV[10] notice         JSON of a pause notification to queue in KEYS[10] when it parks
                        ('' none)
ARGV[11..]              the pairs, then the triples
Returns:
  {"ok", wake_at_ms}             parked: status waiting
  {"requeued", attempt, queue}   woken while it executed by what it parks on (wake_pending:
                                 '1' anything, 'child' a child, 'lock' a lock released;
                                 a signal it waits for that
                                 is buffered already), or parking for a pause
                                 (reason paused) that a resume lifted meanwhile: queued
                                 again as <attempt>; the caller enqueues that delivery
  {"cancelled"}                  cancel was requested: nothing written, settle it cancelled
  {"stale", epoch}               a newer execution owns the run; nothing written
  {"settled", status}            the run is finished; nothing written
Writes: HSET/HINCRBY/HDEL KEYS[1]; ZREM KEYS[2]; ZADD KEYS[3] (requeued); XADD KEYS[4];
  ZADD KEYS[5]; HSET KEYS[6]; HSET KEYS[7]; ZADD KEYS[8]; KEYS[9] is only read; ZADD KEYS[10]
]]
local run, leases, dispatch, out, waits, steps, asks, feed, sigs, notices = KEYS[1], KEYS[2],
  KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local run_id = ARGV[2]
local r = redis.call('HMGET', run, 'epoch', 'status', 'attempt', 'cancel', 'pause',
  'wake_pending', 'queue')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
if r[4] == '1' then return {'cancelled'} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local wake_at = tonumber(ARGV[4])
local n_ledger, n_asks = tonumber(ARGV[8]), tonumber(ARGV[9])
local i = 11
for _ = 1, n_ledger do
  redis.call('HSET', steps, ARGV[i], ARGV[i + 1])
  i = i + 2
end
for _ = 1, n_asks do
  local key, timeout_ms = ARGV[i], tonumber(ARGV[i + 2])
  if redis.call('HSETNX', asks, key, ARGV[i + 1]) == 1 then
    redis.call('HSET', asks, key .. '|state', 'open', key .. '|rev', 1, key .. '|asked_ms',
      now_ms)
    if timeout_ms > 0 then redis.call('HSET', asks, key .. '|timeout_at', now_ms + timeout_ms) end
    redis.call('ZADD', feed, now_ms, run_id .. '|' .. key)
  end
  -- A question that times out wakes the run then (server clock), recorded or not.
  if redis.call('HGET', asks, key .. '|state') == 'open' then
    local due = tonumber(redis.call('HGET', asks, key .. '|timeout_at') or '0')
    if due > 0 and (wake_at == 0 or due < wake_at) then wake_at = due end
  end
  i = i + 3
end
local reason = ARGV[3]
local paused = r[5] == '1'
if paused then reason = 'paused' end
-- It parks for a pause that a resume has lifted already (the resume landed between the
-- "paused" reply and this call, and found nothing parked to wake): go again now, or
-- nothing would ever wake it.
local lifted = ARGV[3] == 'paused' and not paused
redis.call('HINCRBY', run, 'epoch', 1)  -- this execution is over; its writes are refused now
redis.call('HDEL', run, 'worker', 'note')
redis.call('ZREM', leases, run_id)
redis.call('XADD', out, '*', 't', 'parked', 'a', r[3], 'd', ARGV[7])
-- A wake that came while it executed: '1' (an answer) goes again whatever it parks on;
-- 'child' (a settled child) only when it parks waiting for children. A child's wake that
-- landed before the execution read that child's result is spent: parking on a timer
-- after it must not requeue the run at once (an extra delivery, the timer seen "woken").
local wait_for = cjson.decode(ARGV[5])
local pending = lifted or r[6] == '1' or (r[6] == 'child' and wait_for.children ~= nil)
  or (r[6] == 'lock' and wait_for.lock ~= nil)
-- A signal it waits for that came after the execution looked, before this park (send_signal
-- found it running and woke nothing): go again now, or it would wait for a signal it has.
if not pending and type(wait_for.signals) == 'table' then
  for _, name in ipairs(wait_for.signals) do
    local s = redis.call('HMGET', sigs, name .. '|n', name .. '|c')
    if tonumber(s[1] or '0') > tonumber(s[2] or '0') then pending = true end
  end
end
if r[6] and not pending and not paused then redis.call('HDEL', run, 'wake_pending') end
if pending and not paused then
  -- Something it waits for happened while it executed: go again now. A wake is a delivery
  -- that does not count against max deliveries (counted with deferrals).
  local attempt = tonumber(r[3]) + 1
  redis.call('HSET', run, 'status', 'queued', 'attempt', attempt)
  redis.call('HINCRBY', run, 'deferred', 1)
  redis.call('HINCRBY', run, 'resumptions', 1)  -- status shows them apart
  redis.call('HDEL', run, 'wake_pending')
  redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[6]), run_id)
  redis.call('XADD', out, '*', 't', 'woken', 'a', attempt,
    'd', lifted and '{"cause":"resume"}' or '{"cause":"wake_pending"}')
  return {'requeued', attempt, r[7]}
end
redis.call('HSET', run, 'status', 'waiting', 'wait_reason', reason, 'wait_for', ARGV[5],
  'wait_since', now_ms, 'wake_at', wake_at)
if ARGV[3] == 'failed_step' then
  redis.call('ZADD', feed, 'NX', now_ms, run_id .. '|!failed_step')
  if ARGV[10] ~= '' then redis.call('ZADD', notices, now_ms, ARGV[10]) end
end
if wake_at > 0 then redis.call('ZADD', waits, wake_at, run_id) end
return {'ok', wake_at}
