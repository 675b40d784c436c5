#!lua
--[[ send_signal: append a signal to a run's signals of its name (durable, numbered in the
order they arrive) and, if the run is parked waiting for a signal of that name, wake it in
the same call. A signal sent before the run waits for it stays buffered until it is taken
(take_signal); a run that is executing checks the buffer when it parks (park_run), so a
signal that lands between its look and its park is not missed.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] signals hash    <tag>:sig:<run id>         <name>|n, <name>|c, <name>|<seq>[|at]
KEYS[3] waits zset      <tag>:waits
KEYS[4] dispatch zset   <tag>:dispatch
KEYS[5] output stream   <tag>:out:<run id>
KEYS[6] request marker  <tag>:req:<request id>     the first send's reply, for a resend
ARGV[1] run_id
ARGV[2] name            the signal's name (no '|')
ARGV[3] payload         JSON, stored verbatim
ARGV[4] event_head      JSON text of the "signal" output event without its end: the script
                        appends the sequence number and '}'
ARGV[5] grace_ms        the woken run's dispatch check comes due after this long
ARGV[6] marker_ms       how long the request marker is kept
ARGV[7] max_buffered    refuse when this many signals of the name wait to be taken
Returns:
  {"ok", seq, attempt, queue}  appended as signal <seq> of its name; attempt > 0: the run
                               was woken as that delivery and the caller enqueues it on
                               <queue> (0: queued, executing, paused or waiting for
                               something else; it takes the signal when it next asks)
  {"missing"}                  no such run; nothing written
  {"settled", status}          the run is finished; nothing written
  {"full", buffered}           too many signals of the name wait already; nothing written
Writes (only for "ok"): HSET KEYS[2]; XADD KEYS[5]; SET KEYS[6]; when woken HSET/HINCRBY/HDEL
  KEYS[1], ZREM KEYS[3], ZADD KEYS[4]
]]
local run, sigs, waits, dispatch, out, marker = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6]
local run_id, name = ARGV[1], ARGV[2]
local seen = redis.call('GET', marker)
if seen then  -- a resend: the first send's reply
  local seq, attempt, queue = string.match(seen, '^(%d+)|(%d+)|(.*)$')
  return {'ok', tonumber(seq), tonumber(attempt), queue}
end
local r = redis.pcall('HMGET', run, 'status', 'attempt', 'pause', 'queue', 'wait_for')
if r.err or not r[1] then return {'missing'} end
if r[1] == 'succeeded' or r[1] == 'failed' or r[1] == 'cancelled' then
  return {'settled', r[1]}
end
local s = redis.call('HMGET', sigs, name .. '|n', name .. '|c')
local sent, taken = tonumber(s[1] or '0'), tonumber(s[2] or '0')
if sent - taken >= tonumber(ARGV[7]) then return {'full', sent - taken} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local seq = sent + 1
redis.call('HSET', sigs, name .. '|n', seq, name .. '|' .. seq, ARGV[3],
  name .. '|' .. seq .. '|at', now_ms)
redis.call('XADD', out, '*', 't', 'signal', 'a', r[2], 'd', ARGV[4] .. seq .. '}')
-- Only a run parked waiting for this name goes on now; one waiting for anything else (a
-- timer, a question, another name) finds the signal buffered when it asks for it.
local wanted = false
if r[1] == 'waiting' and r[3] ~= '1' then
  local ok, wait_for = pcall(cjson.decode, r[5] or '{}')
  if ok and type(wait_for) == 'table' and type(wait_for.signals) == 'table' then
    for _, n in ipairs(wait_for.signals) do
      if n == name then wanted = true end
    end
  end
end
local attempt = 0
if wanted then
  -- A wake is a delivery that does not count against max deliveries (counted with deferrals).
  attempt = tonumber(r[2]) + 1
  redis.call('HSET', run, 'status', 'queued', 'attempt', attempt)
  redis.call('HINCRBY', run, 'deferred', 1)
  redis.call('HINCRBY', run, 'resumptions', 1)  -- status shows them apart
  redis.call('HDEL', run, 'wait_reason', 'wait_for', 'wait_since', 'wake_at', 'wake_pending')
  redis.call('ZREM', waits, run_id)
  redis.call('ZADD', dispatch, now_ms + tonumber(ARGV[5]), run_id)
  redis.call('XADD', out, '*', 't', 'woken', 'a', attempt, 'd', '{"cause":"signal"}')
end
redis.call('SET', marker, seq .. '|' .. attempt .. '|' .. (r[4] or ''), 'PX', ARGV[6])
return {'ok', seq, attempt, r[4] or ''}
