#!lua
--[[ take_rate: a run asks a rate limit to let it through (flow/rate_limits.py). GCRA (a
generic cell rate algorithm) on the server's clock: the limit keeps a theoretical arrival
time (tat); a caller passes when now >= tat - tolerance, and then tat = max(tat, now) +
interval. Burst 1 (tolerance 0) spaces admissions at least one interval apart, so no window
of one period holds more than its rate. A limit's keys are its own, under its own hash tag,
so this is one script on one slot whatever the runs' buckets.
Runs refused wait in a FIFO per limit, in order of arrival; only its head may pass, and a
newcomer never passes a non-empty queue. A head that has not come back for stale_ms after
its turn (its run was cancelled, or lost) is dropped, so one run cannot block its limit;
it is queued again at the tail if it comes back.
An admission is remembered for keep_ms under the caller's token (run id and call place):
the same token asking again (a resend, or a redelivery whose ledger lost the admission)
gets the same admission, and takes nothing more.
KEYS[1] state hash      {P:rate:<id>}:state     tat (us), head and since when (us), last
                                                admission (ms), admissions, seq, released
                                                (the arrival number up to which queued
                                                runs were released)
KEYS[2] queue zset      {P:rate:<id>}:queue     token -> arrival number (the FIFO)
KEYS[3] admitted zset   {P:rate:<id>}:admitted  token -> admission (server ms)
ARGV[1] token           "<run id>|<ledger key>": one per call place of a run
ARGV[2] interval_us     microseconds per admission (the rate)
ARGV[3] burst           how many may pass at once after a quiet spell (>= 1)
ARGV[4] stale_ms        a head this late for its turn is dropped
ARGV[5] keep_ms         how long an admission is remembered
ARGV[6] lookahead_us    runs whose turn is this near (none at a rate slower than that) are released:
                        the caller wakes them (the queue's head chain), or, newly queued
                        there, set their timer at their turn themselves
Returns:
  {"admitted", at_ms, 1, token...}
                                 let through at at_ms (server ms); 1: just now, 0: earlier
                                 (a token admitted before: nothing taken); then the tokens
                                 released now, for the caller to wake
  {"held", turn_ms, position, queued, near}
                                 not yet: queued (or kept) at <position> (0: the head);
                                 its turn comes at about turn_ms (server ms), at the
                                 earliest: if the runs ahead of it take theirs on time;
                                 near 1: released (its timer may be set at its turn), 0: it
                                 waits for the chain's wake (its timer is a safety net)
Writes: HSET KEYS[1]; ZADD/ZREM KEYS[2]; ZADD/ZREMRANGEBYSCORE KEYS[3]
]]
local state, queue, admitted = KEYS[1], KEYS[2], KEYS[3]
local token = ARGV[1]
local interval, burst = tonumber(ARGV[2]), tonumber(ARGV[3])
local stale_us, keep_ms = tonumber(ARGV[4]) * 1000, tonumber(ARGV[5])
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)
local function us(n) return string.format('%.0f', n) end

local seen = redis.call('ZSCORE', admitted, token)
if seen then return {'admitted', tonumber(seen), 0} end
redis.call('ZREMRANGEBYSCORE', admitted, '-inf', '(' .. (now_ms - keep_ms))

local s = redis.call('HMGET', state, 'tat', 'head', 'since', 'seq', 'released')
local released = tonumber(s[5] or '0') or 0
-- How many runs the lookahead spans; 0 (a slow rate): every held run sets its own timer at
-- its turn (the chain's latency is nothing against the interval).
local near = math.floor(tonumber(ARGV[6]) / interval)
local tat = tonumber(s[1] or '0') or 0
local tol = (burst - 1) * interval
local ready = tat - tol  -- the earliest instant the next admission may take place
local head, since = s[2] or '', tonumber(s[3] or '0') or 0

-- The head as the queue has it now; a new head's turn is counted from when it became one.
local function front()
  local first = redis.call('ZRANGE', queue, 0, 0)[1]
  if first ~= head then
    head, since = first or '', now_us
    redis.call('HSET', state, 'head', head, 'since', us(since))
  end
  return first
end
local first = front()
for _ = 1, 10 do
  if not first or first == token then break end
  if now_us <= math.max(ready, since) + stale_us then break end
  redis.call('ZREM', queue, first)
  first = front()
end

if (not first or first == token) and now_us >= ready then
  redis.call('ZREM', queue, token)
  redis.call('ZADD', admitted, now_ms, token)
  redis.call('HSET', state, 'tat', us(math.max(tat, now_us) + interval), 'last', now_ms)
  redis.call('HINCRBY', state, 'admissions', 1)
  front()
  -- The runs whose turn comes within the lookahead, not released yet: the caller wakes
  -- them now, so each held run is woken about once, near its turn, in order.
  local reply = {'admitted', now_ms, 1}
  if near == 0 then return reply end
  local window = redis.call('ZRANGE', queue, 0, near - 1, 'WITHSCORES')
  for j = 1, #window, 2 do
    local seq = tonumber(window[j + 1])
    if seq > released then
      reply[#reply + 1] = window[j]
      released = seq
    end
  end
  redis.call('HSET', state, 'released', released)
  return reply
end
local mine = tonumber(redis.call('ZSCORE', queue, token) or '0')
if mine == 0 then
  mine = tonumber(s[4] or '0') + 1
  redis.call('HSET', state, 'seq', mine)
  redis.call('ZADD', queue, mine, token)
  first = front()
end
local position = redis.call('ZRANK', queue, token)
-- Queued within the lookahead: every run ahead of it was released (by the chain, or queued
-- there too), so it is released as well.
if position < near and mine > released then
  released = mine
  redis.call('HSET', state, 'released', released)
end
-- Never later than the run's real turn (those ahead cannot pass faster than the rate), so a
-- held run is never woken late by its estimate; one woken early asks again and parks until
-- its new, nearer estimate.
local turn = math.max(ready, now_us) + position * interval
return {'held', math.ceil(turn / 1000), position, redis.call('ZCARD', queue),
  (near == 0 or mine <= released) and 1 or 0}
