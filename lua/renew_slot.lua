#!lua
--[[ renew_slot: a running execution extends its run's slot of a concurrency limit, right
before the lease renewal it makes anyway, which is capped at the slot's new expiry (flow
control, marbles_rq/engine/flowctl.py): a live lease always lies within a live hold.
KEYS[1] slots zset      {P:lim:<limit id>}:slots     run id -> slot expiry (server ms)
KEYS[2] holders hash    {P:lim:<limit id>}:holders   run id -> "<attempt>|<token>" holding it
ARGV[1] run_id
ARGV[2] attempt         the execution's delivery
ARGV[3] token           the execution's token (acquire_slot)
ARGV[4] ttl_ms          the slot expires this long from now unless renewed again
ARGV[5] limit           how many runs may hold a slot at once (the run's recorded limit)
Returns:
  {"ok", retaken, until}  extended to <until> (server ms), held under this execution's token;
                          retaken 1 when the hold had expired or was gone and a slot was
                          free (counted again)
  {"lost", held}          the hold had expired or was gone and every slot is held by other
                          live runs: the execution must stop (its lease, capped at the hold's
                          old expiry, has expired too); nothing written
  {"stale", attempt}      a newer delivery of the run holds the slot; nothing written
Writes (only for "ok"): ZADD KEYS[1], HSET KEYS[2]
]]
local slots, holders = KEYS[1], KEYS[2]
local run_id, attempt, token, ttl_ms = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local holder = redis.call('HGET', holders, run_id) or ''
local by = tonumber(string.match(holder, '^(%d+)|') or '0')
if by > attempt then return {'stale', by} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score = redis.call('ZSCORE', slots, run_id)
local retaken = (not score or tonumber(score) <= now_ms) and 1 or 0
if retaken == 1 then
  -- Taken again only if a slot is free: a hold that lapsed may have let another run start.
  local held = redis.call('ZCOUNT', slots, '(' .. now_ms, '+inf')
  if held >= tonumber(ARGV[5]) then return {'lost', held} end
end
redis.call('ZADD', slots, now_ms + ttl_ms, run_id)
redis.call('HSET', holders, run_id, attempt .. '|' .. token)
return {'ok', retaken, now_ms + ttl_ms}
