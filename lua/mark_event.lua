#!lua
--[[ mark_event: move a pending event on once its run is recorded (or it cannot have one).
KEYS[1] event hash      <tag>:evt:<event key>
KEYS[2] pending zset    <tag>:evpending
KEYS[3] bucket fence    <tag>:ctl                {epoch}: the newest controller seen here
ARGV[1] event_key
ARGV[2] ctl_epoch       the calling controller's lease epoch; 0 for the sender (not fenced)
ARGV[3] state           started | batched | failed | retry (stays pending, due again after
                        retry_ms)
ARGV[4] note            why it failed or waits ('' for started)
ARGV[5] retry_ms        for retry: how long until the controller tries again
ARGV[6] run             batched: the batch (and run) the event went to; '' otherwise
Returns:
  {"ok"}                    written
  {"not_pending", state}    started, failed or unmatched already; nothing written
  {"missing"}               no such event; nothing written
  {"fenced", epoch}         a newer controller acts on this bucket; nothing written
Writes: HSET KEYS[1] state, note (run); ZREM or ZADD KEYS[2]; HSET KEYS[3] epoch (a controller)
]]
local evt, pending, fence = KEYS[1], KEYS[2], KEYS[3]
local key, ctl_epoch, state, note = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]

local seen = 0
if ctl_epoch > 0 then
  seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0  -- garbage reads as 0
  if seen > ctl_epoch then return {'fenced', seen} end
end
local current = redis.call('HGET', evt, 'state')
if not current then
  redis.call('ZREM', pending, key)  -- debris of a pruned or deleted event
  return {'missing'}
end
if current ~= 'pending' then
  redis.call('ZREM', pending, key)
  return {'not_pending', current}
end

if ctl_epoch > seen then redis.call('HSET', fence, 'epoch', ctl_epoch) end
if state == 'retry' then
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', evt, 'note', note)
  redis.call('ZADD', pending, now_ms + tonumber(ARGV[5]), key)
  return {'ok'}
end
redis.call('HSET', evt, 'state', state, 'note', note)
if ARGV[6] ~= '' then redis.call('HSET', evt, 'run', ARGV[6]) end
redis.call('ZREM', pending, key)
return {'ok'}
