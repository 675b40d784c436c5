#!lua
--[[ renew_lock: the execution holding a durable mutex extends its hold, right before the
lease renewal it makes anyway, which is capped at the hold's new expiry (flow/locks.py): a
live lease always lies within a live hold, so the scripts refuse the writes of an execution
whose hold lapsed.
KEYS[1] state hash      {P:lock:<id>}:state   (acquire_lock)
ARGV[1] run_id
ARGV[2] epoch           the renewing execution's epoch
ARGV[3] ttl_ms          the hold lapses this long from now unless renewed again
Returns:
  {"ok", until}         extended to <until> (server ms); a lapsed hold nobody took since is
                        taken again
  {"lost", holder}      another run holds it now, or it lapsed and is free with runs queued
                        (one of them may hold it by now: the execution must stop); nothing
                        written
  {"stale", epoch}      a newer execution of the run holds it; nothing written
Writes (only for "ok"): HSET KEYS[1]
]]
local state = KEYS[1]
local run_id, epoch, ttl_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h = redis.call('HMGET', state, 'run', 'epoch', 'until', 'free')
if h[1] == run_id then
  local by = tonumber(h[2] or '0') or 0
  if by > epoch then return {'stale', by} end
  if by < epoch then return {'lost', run_id} end  -- an older execution's: not this one's
  redis.call('HSET', state, 'until', now_ms + ttl_ms)
  return {'ok', now_ms + ttl_ms}
end
return {'lost', h[1] or ''}
