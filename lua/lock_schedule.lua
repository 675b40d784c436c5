#!lua
--[[ lock_schedule: take or release a schedule's tick lock (one tick at a time per key).
KEYS[1] schedule lock   <tag>:lock:schedule:<key>
ARGV[1] holder          who takes or releases it
ARGV[2] ttl_ms          > 0 takes it for this long; 0 releases it if `holder` has it
Returns:
  {"ok"}                  taken (or already ours) / released
  {"held", holder}        someone else has it; nothing written
Writes: SET/DEL KEYS[1]
]]
local lock, holder, ttl = KEYS[1], ARGV[1], tonumber(ARGV[2])
local current = redis.call('GET', lock)
if current and current ~= holder then return {'held', current} end
if ttl > 0 then
  redis.call('SET', lock, holder, 'PX', ttl)
elseif current then
  redis.call('DEL', lock)
end
return {'ok'}
