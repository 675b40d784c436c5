#!lua
--[[ register_schedule: the controller records a schedule its source declares (first time:
registration time and cursor; a changed definition: a new cursor). Pause and history stay.
KEYS[1] schedule hash   <tag>:sched:<key>
KEYS[2] index zset      <tag>:sched_idx          key -> registration time (ms)
KEYS[3] due zset        <tag>:sched_due
KEYS[4] bucket fence    <tag>:ctl                {epoch}: the newest controller seen here
ARGV[1] key             the schedule key
ARGV[2] ctl_epoch       the calling controller's lease epoch
ARGV[3] fingerprint     of the definition (kind, timing, target, input)
ARGV[4] kind            interval | cron | calendar
ARGV[5] label           how the CLI shows its timing
ARGV[6] workflow        the target workflow
ARGV[7] cursor          the first due time, used when new or changed
ARGV[8] every_ms        interval schedules: the interval (0 otherwise)
Returns:
  {"created", now_ms}     registered now
  {"updated", now_ms}     the definition changed: new cursor
  {"same", now_ms}        unchanged (its due entry is restored unless paused)
  {"fenced", epoch}       a newer controller acts on this bucket; nothing written
Writes: HSET KEYS[1]; ZADD KEYS[2]; ZADD KEYS[3]; HSET KEYS[4]
]]
local state, index, due, fence = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local key, ctl_epoch = ARGV[1], tonumber(ARGV[2])

local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0  -- garbage reads as 0
if seen > ctl_epoch then return {'fenced', seen} end
local s = redis.call('HMGET', state, 'registered_ms', 'fp', 'paused', 'cursor')
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if seen < ctl_epoch then redis.call('HSET', fence, 'epoch', ctl_epoch) end

local outcome, cursor = 'same', s[4]
if not s[1] then
  outcome, cursor = 'created', ARGV[7]
  if tonumber(ARGV[8]) > 0 then cursor = tostring(now_ms + tonumber(ARGV[8])) end
  redis.call('HSET', state, 'registered_ms', now_ms)
  redis.call('ZADD', index, now_ms, key)
elseif s[2] ~= ARGV[3] then
  outcome, cursor = 'updated', ARGV[7]
end
redis.call('HSET', state, 'fp', ARGV[3], 'kind', ARGV[4], 'label', ARGV[5],
  'workflow', ARGV[6], 'cursor', cursor)
if s[3] ~= '1' then redis.call('ZADD', due, cursor, key) end
return {outcome, now_ms}
