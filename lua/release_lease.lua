#!lua
--[[ release_lease: give a lease up only if the caller still holds it (compare-and-delete).
KEYS[1] lease key       <tag>:lease:<name>   string "<epoch>|<token>"
ARGV[1] epoch           the epoch the caller acquired
ARGV[2] token           the caller's token
Returns:
  {"ok"}                 released
  {"not_held"}           gone already or held by another; nothing written (safe to resend)
Writes (only for "ok"): DEL KEYS[1]
]]
local lease = KEYS[1]
if redis.call('GET', lease) ~= ARGV[1] .. '|' .. ARGV[2] then return {'not_held'} end
redis.call('DEL', lease)
return {'ok'}
