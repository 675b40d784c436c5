#!lua
--[[ answer_ask: record the answer to a run's open question, compare-and-set on its revision
(the first answer wins), and only then wake the run.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] asks hash       <tag>:asks:<run id>
KEYS[3] feed zset       <tag>:feed
KEYS[4] waits zset      <tag>:waits
KEYS[5] dispatch zset   <tag>:dispatch
KEYS[6] output stream   <tag>:out:<run id>
ARGV[1] run_id
ARGV[2] key             the question's key
ARGV[3] rev             the revision the caller read (and validated the answer against)
ARGV[4] answer          JSON of the answer
ARGV[5] event           JSON data of the "answered" output event
ARGV[6] grace_ms        the woken run's dispatch check comes due after this long
ARGV[7] request_id      a resend with the same id answers what the first send answered
Returns:
  {"ok", attempt, queue}   recorded; attempt > 0: the run was woken as that delivery and the
                           caller enqueues it (0: it executes or is paused; it sees the answer
                           when it replays)
  {"missing"}              no such run
  {"unknown_key"}          the run never asked a question with this key
  {"closed", state}        answered, timed out or cancelled already, or past its timeout (on
                           the server clock) though not closed yet; nothing written
  {"conflict", rev}        answered meanwhile (the revision moved); nothing written
  {"settled", status}      the run is finished; nothing written
Writes (only for "ok"): HSET KEYS[2]; ZREM KEYS[3]; XADD KEYS[6]; when woken HSET/HINCRBY/HDEL
  KEYS[1], ZREM KEYS[4], ZADD KEYS[5]; HSET KEYS[1] wake_pending when it executes
]]
local run, asks, feed, waits, dispatch, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6]
local run_id, key = ARGV[1], ARGV[2]
local r = redis.pcall('HMGET', run, 'status', 'attempt', 'pause', 'queue')
if r.err or not r[1] then return {'missing'} end
local a = redis.pcall('HMGET', asks, key, key .. '|state', key .. '|rev', key .. '|req',
  key .. '|outcome', key .. '|timeout_at')
if a.err or not a[1] then return {'unknown_key'} end
if a[4] == ARGV[7] and a[5] then  -- a resend: the first send's answer
  local attempt, queue = string.match(a[5], '^(%d+)|(.*)$')
  return {'ok', tonumber(attempt), queue}
end
if a[2] ~= 'open' then return {'closed', a[2] or 'unknown'} end
if a[3] ~= ARGV[3] then return {'conflict', tonumber(a[3] or '0')} end
if r[1] == 'succeeded' or r[1] == 'failed' or r[1] == 'cancelled' then
  return {'settled', r[1]}
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- The timeout is a deadline on the server clock, as wake_run closes it (timeout_at <= now):
-- past it no answer is taken, even before the controller has closed the question and woken
-- the run. Otherwise a late answer would win or lose depending on how late the controller is.
local timeout_at = tonumber(a[6] or '0') or 0
if timeout_at > 0 and timeout_at <= now_ms then return {'closed', 'timed_out'} end
redis.call('HSET', asks, key .. '|state', 'answered', key .. '|answer', ARGV[4],
  key .. '|answered_ms', now_ms, key .. '|req', ARGV[7])
redis.call('HINCRBY', asks, key .. '|rev', 1)
redis.call('ZREM', feed, run_id .. '|' .. key)
redis.call('XADD', out, '*', 't', 'answered', 'a', r[2], 'd', ARGV[5])
local attempt = 0
if r[1] == 'waiting' and r[3] ~= '1' then
  -- A wake is a delivery that does not count against max deliveries (counted with deferrals).
  attempt = tonumber(r[2]) + 1
  redis.call('HSET', run, 'status', 'queued', 'attempt', attempt)
  redis.call('HINCRBY', run, 'deferred', 1)
  redis.call('HINCRBY', run, 'resumptions', 1)  -- status shows them apart
  redis.call('HDEL', run, 'wait_reason', 'wait_for', 'wait_since', 'wake_at', 'wake_pending')
  redis.call('ZREM', waits, run_id)
  redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[6]), run_id)
  redis.call('XADD', out, '*', 't', 'woken', 'a', attempt, 'd', '{"cause":"answer"}')
elseif r[1] == 'running' then
  redis.call('HSET', run, 'wake_pending', 1)
end
redis.call('HSET', asks, key .. '|outcome', attempt .. '|' .. (r[4] or ''))
return {'ok', attempt, r[4] or ''}
