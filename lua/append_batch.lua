#!lua
--[[ append_batch: put an accepted event in its group's open batch, once; seal the batch when
it is full (by count, or because this event's bytes would take it past the input limit).
KEYS[1] group hash      <tag>:bgrp:<group>           seq, n, bytes, opened_ms, due_ms, ...
KEYS[2] items list      <tag>:bitems:<batch id>      the open batch's events (caller's seq)
KEYS[3] member key      <tag>:bmem:<event key>       the batch the event went to
KEYS[4] batch hash      <tag>:batch:<batch id>       written when the batch seals
KEYS[5] due zset        <tag>:bdue                   group -> when its open batch seals by time
KEYS[6] sealed zset     <tag>:bsealed                batch id -> when the controller starts it
ARGV[1] group           evb-<24 hex digits>
ARGV[2] seq             the open batch the caller expects (its batch id is <group>-<seq>;
                        a new group's first batch is numbered with the server's ms)
ARGV[3] event_key       the event's stable key
ARGV[4] item            the event's Event JSON as stored (perhaps sealed), stored verbatim
ARGV[5] max_size        events per batch
ARGV[6] max_wait_ms     how long after its first event a batch seals
ARGV[7] max_bytes       the most bytes of items a batch holds (its run's input limit)
ARGV[8] grace_ms        the controller starts a sealed batch's run after this long
ARGV[9] keep_ms         how long the member key is kept, and an idle group
ARGV[10] workflow       the trigger's workflow
ARGV[11] trigger        the trigger, "<source>" or "<source>/<type>"
ARGV[12] key            the batch key's value ('' = one batch per trigger)
ARGV[13] item_bytes     the item's size in the batch run's input ('' = #ARGV[4]): an item is
                        stored sealed (payloads/codec.py), the limit is on the input
Returns:
  {"added", batch_id, n}     appended; the batch stays open
  {"sealed", batch_id, n}    appended, and the batch is full: sealed, the caller starts its run
  {"exists", batch_id}       the event is in that batch already; nothing written
  {"moved", seq[, sealed]}   the open batch is another (sealed meanwhile, or the group is
                             new): call again with this seq; `sealed`: this call sealed that
                             batch because this event did not fit (the caller starts it)
Writes: HSET/PEXPIRE KEYS[1]; RPUSH KEYS[2]; SET KEYS[3] PX; ZADD KEYS[5]; when sealed: HSET KEYS[4],
  HDEL KEYS[1], ZREM KEYS[5], ZADD KEYS[6]
]]
local grp, items, member, batch, due, sealed = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6]
local group, event_key, item = ARGV[1], ARGV[3], ARGV[4]
local max_size, max_wait, max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local size = tonumber(ARGV[13]) or #item

local found = redis.call('GET', member)
if found then return {'exists', found} end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local g = redis.call('HMGET', grp, 'seq', 'n', 'bytes', 'opened_ms')
local seq = tonumber(g[1])
if not seq then
  -- A new group (or one idle past keep_ms, expired) numbers its batches from now, so a
  -- batch id (a run id) never names an earlier batch's run again.
  redis.call('HSET', grp, 'seq', now_ms, 'n', 0, 'bytes', 0)
  redis.call('PEXPIRE', grp, tonumber(ARGV[9]))
  return {'moved', now_ms}
end
if seq ~= tonumber(ARGV[2]) then return {'moved', seq} end
local n, bytes, opened = tonumber(g[2]) or 0, tonumber(g[3]) or 0, tonumber(g[4]) or 0
local batch_id = group .. '-' .. seq

local function seal(by)
  redis.call('HSET', batch, 'group', group, 'seq', seq, 'n', n, 'bytes', bytes,
    'opened_ms', opened, 'sealed_ms', now_ms, 'sealed_by', by, 'state', 'sealed',
    'workflow', ARGV[10], 'trigger', ARGV[11], 'key', ARGV[12])
  redis.call('HSET', grp, 'seq', seq + 1, 'n', 0, 'bytes', 0)
  redis.call('HDEL', grp, 'opened_ms', 'due_ms')
  redis.call('ZREM', due, group)
  redis.call('ZADD', sealed, now_ms + tonumber(ARGV[8]), batch_id)
end

-- The list's brackets and commas count too: n items take n + 1 bytes more.
if n > 0 and bytes + size + n + 2 > max_bytes then
  seal('bytes')
  return {'moved', seq + 1, batch_id}
end
if n == 0 then
  opened = now_ms
  redis.call('HSET', grp, 'seq', seq, 'opened_ms', now_ms, 'due_ms', now_ms + max_wait,
    'workflow', ARGV[10], 'trigger', ARGV[11], 'key', ARGV[12])
  redis.call('ZADD', due, now_ms + max_wait, group)
end
redis.call('RPUSH', items, item)
redis.call('SET', member, batch_id, 'PX', tonumber(ARGV[9]))
n, bytes = n + 1, bytes + size
redis.call('HSET', grp, 'n', n, 'bytes', bytes)
redis.call('PEXPIRE', grp, tonumber(ARGV[9]))
if n >= max_size then
  seal('size')
  return {'sealed', batch_id, n}
end
return {'added', batch_id, n}
