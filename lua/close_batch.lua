#!lua
--[[ close_batch: a sealed batch's run is recorded (or cannot be): the batch leaves the
sealed index and its items go (the run's input holds them).
KEYS[1] batch hash      <tag>:batch:<batch id>
KEYS[2] items list      <tag>:bitems:<batch id>
KEYS[3] sealed zset     <tag>:bsealed
KEYS[4] bucket fence    <tag>:ctl                    {epoch}: the newest controller seen here
ARGV[1] batch_id
ARGV[2] ctl_epoch       the calling controller's lease epoch; 0 for the sealer (not fenced)
ARGV[3] state           started | failed | retry (stays sealed, due again after retry_ms)
ARGV[4] note            why it failed or waits
ARGV[5] keep_ms         how long the batch hash is kept after it closes
ARGV[6] retry_ms        for retry: how long until the controller tries again
Returns:
  {"ok"}                written
  {"closed", state}     started or failed already; nothing written
  {"missing"}           no such batch (its index entry is dropped)
  {"fenced", epoch}     a newer controller acts on this bucket; nothing written
Writes: HSET KEYS[4] epoch (a controller); HSET/PEXPIRE KEYS[1], DEL KEYS[2], ZREM or ZADD
  KEYS[3]
]]
local batch, items, sealed, fence = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local batch_id, ctl_epoch, state = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local seen = 0
if ctl_epoch > 0 then
  seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0
  if seen > ctl_epoch then return {'fenced', seen} end
end
local current = redis.call('HGET', batch, 'state')
if not current then
  redis.call('ZREM', sealed, batch_id)
  return {'missing'}
end
if current ~= 'sealed' then
  redis.call('ZREM', sealed, batch_id)
  return {'closed', current}
end
if ctl_epoch > seen then redis.call('HSET', fence, 'epoch', ctl_epoch) end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if state == 'retry' then
  redis.call('HSET', batch, 'note', ARGV[4])
  redis.call('ZADD', sealed, now_ms + tonumber(ARGV[6]), batch_id)
  return {'ok'}
end
redis.call('HSET', batch, 'state', state, 'note', ARGV[4], 'closed_ms', now_ms)
redis.call('PEXPIRE', batch, tonumber(ARGV[5]))
redis.call('DEL', items)
redis.call('ZREM', sealed, batch_id)
return {'ok'}
