#!lua
--[[ acquire_slot: take one slot of a concurrency limit for a delivery of a run, before the
run starts (flow control, marbles_rq/engine/flowctl.py). A limit's slots are its own keys,
under their own hash tag, so this is one script on one slot whatever the runs' buckets.
A slot is held by a run (one per run, whatever its delivery) until its expiry, which the
execution's lease renewals extend (renew_slot) and its settle or park ends (release_slot);
a holder that vanished (kill -9) frees it when the expiry passes, and each acquire prunes
what expired first.
KEYS[1] slots zset      {P:lim:<limit id>}:slots     run id -> slot expiry (server ms)
KEYS[2] holders hash    {P:lim:<limit id>}:holders   run id -> "<attempt>|<token>" holding it
ARGV[1] run_id
ARGV[2] attempt         the delivery asking; a newer delivery of the run replaces an older
                        one's hold (the older execution is fenced out of the run anyway)
ARGV[3] token           unique per execution: only its holder releases a hold
ARGV[4] limit           how many runs may hold a slot at once (>= 1)
ARGV[5] ttl_ms          the slot expires this long from now unless renewed
Returns:
  {"ok", held, until}   the run holds a slot now (held: slots held, this one included), until
                        <until> (server ms: start_attempt caps the lease there). A live hold
                        of the same delivery (a resend, or a duplicate delivery) answers ok
                        and keeps its token; start_attempt then decides
  {"full", held}        every slot is held by another live run; only expired holds pruned
  {"stale", attempt}    a newer delivery of the run holds the slot; only expired holds pruned
Writes: ZREM/HDEL of expired holds (at most 100 per call); for "ok": ZADD KEYS[1], HSET KEYS[2]
]]
local slots, holders = KEYS[1], KEYS[2]
local run_id, attempt, token = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local limit, ttl_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Bounded: a limit whose holders all vanished at once is pruned over a few calls; what is
-- left over is not counted meanwhile (ZCOUNT of live expiries below).
local expired = redis.call('ZRANGEBYSCORE', slots, '-inf', now_ms, 'LIMIT', 0, 100)
if #expired > 0 then
  redis.call('ZREM', slots, unpack(expired))
  redis.call('HDEL', holders, unpack(expired))
end

local mine = redis.call('ZSCORE', slots, run_id)
local holder = redis.call('HGET', holders, run_id) or ''
local by = tonumber(string.match(holder, '^(%d+)|') or '0')
if mine and tonumber(mine) > now_ms then
  if by > attempt then return {'stale', by} end
  if by == attempt then  -- this delivery holds it already: keep the holder's token
    redis.call('ZADD', slots, now_ms + ttl_ms, run_id)
    return {'ok', redis.call('ZCOUNT', slots, '(' .. now_ms, '+inf'), now_ms + ttl_ms}
  end
else
  local held = redis.call('ZCOUNT', slots, '(' .. now_ms, '+inf')
  if held >= limit then return {'full', held} end
end
redis.call('ZADD', slots, now_ms + ttl_ms, run_id)
redis.call('HSET', holders, run_id, attempt .. '|' .. token)
return {'ok', redis.call('ZCOUNT', slots, '(' .. now_ms, '+inf'), now_ms + ttl_ms}
