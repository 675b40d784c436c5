#!lua
--[[ settle_notice: the controller tried to POST a pause notification (controller/notices.py):
delivered or out of tries, it leaves the outbox; else it is put back with one more try,
due again later. Fenced by the controller's epoch in the bucket, as every duty's write.
KEYS[1] notices zset    <tag>:notices             notification JSON -> when due (server ms)
KEYS[2] bucket fence    <tag>:ctl                 {epoch}: the newest controller seen here
ARGV[1] ctl_epoch       the calling controller's lease epoch
ARGV[2] member          the notification as it was read
ARGV[3] next            the notification with its tries counted, to put back ('' = remove)
ARGV[4] due_ms          when the next try is due (server ms)
Returns:
  {"ok"}                 removed, or put back
  {"gone"}               not in the outbox any more (another pass settled it); nothing written
  {"fenced", epoch}      a newer controller acts on this bucket; nothing written
Writes: ZREM/ZADD KEYS[1]; HSET KEYS[2]
]]
local notices, fence = KEYS[1], KEYS[2]
local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0
if seen > tonumber(ARGV[1]) then return {'fenced', seen} end
if seen < tonumber(ARGV[1]) then redis.call('HSET', fence, 'epoch', ARGV[1]) end
if redis.call('ZREM', notices, ARGV[2]) == 0 then return {'gone'} end
if ARGV[3] ~= '' then redis.call('ZADD', notices, tonumber(ARGV[4]), ARGV[3]) end
return {'ok'}
