#!lua
--[[ acquire_lease: take a named lease with a fencing epoch, or report its holder.
KEYS[1] lease key       <tag>:lease:<name>   string "<epoch>|<token>", expires after ttl
KEYS[2] epoch counter   <tag>:epoch:<name>   integer, only ever incremented
KEYS[3] since           <tag>:since:<name>   string "<epoch>|<server ms>": when that epoch began
ARGV[1] token           unique per holder instance (e.g. host:pid:random)
ARGV[2] ttl_ms          lease length in milliseconds, > 0
ARGV[3] floor           optional: a fresh epoch is above this (the newest epoch a fence in
                        the lease's buckets holds, e.g. from another counter before the
                        lanes were split); the counter jumps past it. Absent or "": 0
Returns:
  {"ok", epoch, ttl_ms}          held by ARGV[1] now; a re-acquire by the same token
                                 extends it and keeps its epoch (safe to resend)
  {"held", epoch, token, pttl}   held by another token for pttl more milliseconds
Writes (only for "ok"): INCR KEYS[2] (SET past a floor), SET KEYS[3] (fresh acquire only); SET KEYS[1] PX ttl
]]
local lease, counter, since = KEYS[1], KEYS[2], KEYS[3]
local token, ttl_ms = ARGV[1], tonumber(ARGV[2])
if not ttl_ms or ttl_ms <= 0 then return redis.error_reply('acquire_lease: bad ttl_ms') end

local cur = redis.call('GET', lease)
if cur then
  local epoch, holder = string.match(cur, '^(%d+)|(.*)$')
  if holder == token then
    redis.call('PEXPIRE', lease, ttl_ms)
    return {'ok', tonumber(epoch), ttl_ms}
  end
  return {'held', tonumber(epoch), holder, redis.call('PTTL', lease)}
end
local epoch = redis.call('INCR', counter)
local floor = tonumber(ARGV[3] or '') or 0
if epoch <= floor then
  -- Still unique and increasing: the counter only moves up, and holds what was handed out.
  epoch = floor + 1
  redis.call('SET', counter, epoch)
end
redis.call('SET', lease, epoch .. '|' .. token, 'PX', ttl_ms)
local t = redis.call('TIME')
redis.call('SET', since, epoch .. '|' .. (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
return {'ok', epoch, ttl_ms}
