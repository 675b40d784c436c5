#!lua
--[[ pause_schedule: an operator pauses or resumes a schedule; recorded, so it survives
restarts. Pausing a declared schedule no controller has registered yet records the pause.
KEYS[1] schedule hash   <tag>:sched:<key>
KEYS[2] index zset      <tag>:sched_idx
KEYS[3] due zset        <tag>:sched_due
ARGV[1] key             the schedule key
ARGV[2] paused          '1' pause, '0' resume
ARGV[3] declared        '1' when the caller's source declares the key
Returns:
  {"ok", was}             done; `was` is the previous pause flag ('1' or '0')
  {"unknown"}             neither registered nor declared; nothing written
Writes: HSET KEYS[1]; ZADD KEYS[2] (a new pause); ZADD/ZREM KEYS[3]
]]
local state, index, due = KEYS[1], KEYS[2], KEYS[3]
local key = ARGV[1]
local s = redis.call('HMGET', state, 'registered_ms', 'cursor', 'paused')
if not s[1] and ARGV[3] ~= '1' then return {'unknown'} end
local was = s[3] or '0'
redis.call('HSET', state, 'paused', ARGV[2])
if ARGV[2] == '1' then
  redis.call('ZREM', due, key)
  if not s[1] then
    local t = redis.call('TIME')
    redis.call('ZADD', index, tonumber(t[1]) * 1000, key)
  end
elseif s[2] then
  redis.call('ZADD', due, s[2], key)
end
return {'ok', was}
