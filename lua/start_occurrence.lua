#!lua
--[[ start_occurrence: mark a claimed occurrence started once its run is recorded.
KEYS[1] occurrence hash <tag>:occ:<key>@<nominal ms>
KEYS[2] open zset       <tag>:occ_open
KEYS[3] bucket fence    <tag>:ctl                {epoch}: the newest controller seen here
ARGV[1] occurrence_id   <key>@<nominal ms>
ARGV[2] ctl_epoch       the calling controller's lease epoch; '' for a manual roll
ARGV[3] keep_ms         how long the started occurrence is kept (then it expires)
Returns:
  {"ok"}                  started (or it was already)
  {"gone"}                no such occurrence; nothing written
  {"fenced", epoch}       a newer controller acts on this bucket; nothing written
Writes: HSET KEYS[1] (+ PEXPIRE); ZREM KEYS[2]
]]
local occ, open, fence = KEYS[1], KEYS[2], KEYS[3]
local ctl_epoch = tonumber(ARGV[2])
local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0  -- garbage reads as 0
if ctl_epoch and seen > ctl_epoch then return {'fenced', seen} end
local status = redis.call('HGET', occ, 'status')
if not status then
  redis.call('ZREM', open, ARGV[1])  -- debris: nothing to start
  return {'gone'}
end
if status ~= 'started' then
  local t = redis.call('TIME')
  redis.call('HSET', occ, 'status', 'started',
    'started_ms', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
  redis.call('PEXPIRE', occ, ARGV[3])
end
redis.call('ZREM', open, ARGV[1])
return {'ok'}
