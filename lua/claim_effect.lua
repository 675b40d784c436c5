#!lua
--[[ claim_effect: reserve an effect under its idempotency key (insert-if-absent receipt),
fenced by the epoch of the scope (a run) it is claimed for and, for a run, by the
execution's lease.
KEYS[1] receipt hash    <tag>:eff:<scope>:<key>      {doc, req, at}
KEYS[2] scope fence     the scope's hash whose `epoch` field is the current attempt's epoch
                        (for a run: the run hash, whose `status` is also checked)
KEYS[3] effect index    <tag>:effidx:<scope>         set of the scope's receipt keys (pruning)
KEYS[4] lease zset      <tag>:leases                 run id -> lease expiry (server ms); only
                        with ARGV[5] (a scope that is not a run passes three keys)
ARGV[1] doc             the receipt's JSON text
ARGV[2] request_id      a resend with the same id answers "ok" again
ARGV[3] epoch           the claimer's epoch, or '' for an unfenced claim
ARGV[4] required        "1": the fence record must exist (a run's hash: missing means the
                        run was purged, and nothing of it may come back); else a scope
                        whose fence was never raised reads as epoch 0
ARGV[5] lease_member    the run id whose lease in KEYS[4] must be live, or '' for none
Returns:
  {"ok", at_ms}               this call (or an earlier send of it) holds the receipt
  {"exists", doc}             the effect was already claimed; doc is the first receipt
  {"stale_epoch", current}    a newer attempt owns the scope, or the run has finished, or
                              (required) its fence record is gone, or (ARGV[5]) the
                              execution's lease expired; nothing written
Writes (only for a fresh "ok"): HSET KEYS[1]; SADD KEYS[3]
]]
local receipt, fence, index = KEYS[1], KEYS[2], KEYS[3]
local doc, req, epoch = ARGV[1], ARGV[2], ARGV[3]

local existing = redis.call('HMGET', receipt, 'doc', 'req', 'at')
if existing[1] and existing[2] == req then return {'ok', tonumber(existing[3])} end  -- a resend
if epoch ~= '' then
  local f = redis.call('HMGET', fence, 'epoch', 'status')
  if not f[1] and ARGV[4] == '1' then return {'stale_epoch', 0} end
  local current = tonumber(f[1] or '0') or 0
  if current > tonumber(epoch) then return {'stale_epoch', current} end
  if f[2] == 'succeeded' or f[2] == 'failed' or f[2] == 'cancelled' then
    return {'stale_epoch', current}
  end
  -- An expired lease ends the execution's writes, as in commit_step: a frozen execution
  -- that thaws (its slot maybe another run's now) claims nothing before its first refusal.
  if ARGV[5] ~= '' then
    local t = redis.call('TIME')
    if tonumber(redis.call('ZSCORE', KEYS[4], ARGV[5]) or '0') <=
        tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then
      return {'stale_epoch', current}
    end
  end
end
if existing[1] then return {'exists', existing[1]} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', receipt, 'doc', doc, 'req', req, 'at', now_ms)
redis.call('SADD', index, receipt)
return {'ok', now_ms}
