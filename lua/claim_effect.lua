#!lua
--[[ claim_effect: reserve an effect under its idempotency key (insert-if-absent receipt),
fenced by the epoch of the scope (a run) it is claimed for.
KEYS[1] receipt hash    <tag>:eff:<scope>:<key>      {doc, req, at}
KEYS[2] scope fence     the scope's hash whose `epoch` field is the current attempt's epoch
ARGV[1] doc             the receipt's JSON text
ARGV[2] request_id      a resend with the same id answers "ok" again
ARGV[3] epoch           the claimer's epoch, or '' for an unfenced claim
Returns:
  {"ok", at_ms}               this call (or an earlier send of it) holds the receipt
  {"exists", doc}             the effect was already claimed; doc is the first receipt
  {"stale_epoch", current}    a newer attempt owns the scope; nothing written
Writes (only for a fresh "ok"): HSET KEYS[1]
]]
local receipt, fence = KEYS[1], KEYS[2]
local doc, req, epoch = ARGV[1], ARGV[2], ARGV[3]

if epoch ~= '' then
  local current = tonumber(redis.call('HGET', fence, 'epoch') or '0')
  if current > tonumber(epoch) then return {'stale_epoch', current} end
end
local existing = redis.call('HMGET', receipt, 'doc', 'req', 'at')
if existing[1] then
  if existing[2] == req then return {'ok', tonumber(existing[3])} end
  return {'exists', existing[1]}
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', receipt, 'doc', doc, 'req', req, 'at', now_ms)
return {'ok', now_ms}
