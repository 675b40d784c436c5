#!lua
--[[ renew_lease: extend a lease only if the caller still holds it (compare-and-extend).
KEYS[1] lease key       <tag>:lease:<name>   string "<epoch>|<token>"
ARGV[1] epoch           the epoch the caller acquired
ARGV[2] token           the caller's token
ARGV[3] ttl_ms          new remaining length in milliseconds, > 0
Returns:
  {"ok"}                 extended (idempotent: safe to resend)
  {"lost", current}      the lease is gone or held by another ("" when gone)
Writes (only for "ok"): PEXPIRE KEYS[1]
]]
local lease = KEYS[1]
local ttl_ms = tonumber(ARGV[3])
if not ttl_ms or ttl_ms <= 0 then return redis.error_reply('renew_lease: bad ttl_ms') end
local cur = redis.call('GET', lease)
if cur ~= ARGV[1] .. '|' .. ARGV[2] then return {'lost', cur or ''} end
redis.call('PEXPIRE', lease, ttl_ms)
return {'ok'}
