#!lua
--[[ seal_batch: the controller seals a group's open batch whose wait has ended.
KEYS[1] group hash      <tag>:bgrp:<group>
KEYS[2] batch hash      <tag>:batch:<batch id>       batch id = <group>-<seq>
KEYS[3] due zset        <tag>:bdue
KEYS[4] sealed zset     <tag>:bsealed
KEYS[5] bucket fence    <tag>:ctl                    {epoch}: the newest controller seen here
ARGV[1] group
ARGV[2] seq             the open batch the controller read
ARGV[3] ctl_epoch       the calling controller's lease epoch
ARGV[4] grace_ms        its run is the sealed index's again after this long (the controller
                        starts it at once; this covers a controller killed before it does)
Returns:
  {"sealed", n}         sealed by time
  {"not_due", due_ms}   its wait has not ended (the due index is set to it)
  {"gone"}              that batch is not open any more (sealed by size, or empty); the
                        group's due entry is dropped unless a batch is open
  {"fenced", epoch}     a newer controller acts on this bucket; nothing written
Writes: HSET KEYS[5] epoch; when sealed: HSET KEYS[2], HSET/HDEL KEYS[1], ZREM KEYS[3],
  ZADD KEYS[4]; else ZADD or ZREM KEYS[3]
]]
local grp, batch, due, sealed, fence = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local group, ctl_epoch = ARGV[1], tonumber(ARGV[3])
local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0
if seen > ctl_epoch then return {'fenced', seen} end
if ctl_epoch > seen then redis.call('HSET', fence, 'epoch', ctl_epoch) end

local g = redis.call('HMGET', grp, 'seq', 'n', 'bytes', 'opened_ms', 'due_ms', 'workflow',
  'trigger', 'key')
local seq, n = tonumber(g[1]) or 0, tonumber(g[2]) or 0
if n == 0 then
  redis.call('ZREM', due, group)
  return {'gone'}
end
if seq ~= tonumber(ARGV[2]) then
  redis.call('ZADD', due, tonumber(g[5]) or 0, group)
  return {'gone'}
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due_ms = tonumber(g[5]) or 0
if due_ms > now_ms then
  redis.call('ZADD', due, due_ms, group)
  return {'not_due', due_ms}
end
redis.call('HSET', batch, 'group', group, 'seq', seq, 'n', n, 'bytes', g[3] or 0,
  'opened_ms', g[4] or 0, 'sealed_ms', now_ms, 'sealed_by', 'time', 'state', 'sealed',
  'workflow', g[6] or '', 'trigger', g[7] or '', 'key', g[8] or '')
redis.call('HSET', grp, 'seq', seq + 1, 'n', 0, 'bytes', 0)
redis.call('HDEL', grp, 'opened_ms', 'due_ms')
redis.call('ZREM', due, group)
redis.call('ZADD', sealed, now_ms + tonumber(ARGV[4]), group .. '-' .. seq)
return {'sealed', n}
