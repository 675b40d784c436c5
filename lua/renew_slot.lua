#!lua
--[[ renew_slot: a running execution extends its run's slot of a concurrency limit, right
after the lease renewal it makes anyway (flow control, marbles_rq/engine/flowctl.py).
KEYS[1] slots zset      {P:lim:<limit id>}:slots     run id -> slot expiry (server ms)
KEYS[2] holders hash    {P:lim:<limit id>}:holders   run id -> "<attempt>|<token>" holding it
ARGV[1] run_id
ARGV[2] attempt         the execution's delivery
ARGV[3] token           the execution's token (acquire_slot)
ARGV[4] ttl_ms          the slot expires this long from now unless renewed again
Returns:
  {"ok", retaken}       extended, and held under this execution's token; retaken 1 when the
                        hold had expired or was gone (the execution runs whatever the count:
                        it is counted again, so no other run starts in its place)
  {"stale", attempt}    a newer delivery of the run holds the slot; nothing written
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
redis.call('ZADD', slots, now_ms + ttl_ms, run_id)
redis.call('HSET', holders, run_id, attempt .. '|' .. token)
return {'ok', retaken}
