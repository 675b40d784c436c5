#!lua
--[[ finish_grow: record the grown bucket count once every key has moved.
KEYS[1] meta hash       {<prefix>}:meta
ARGV[1] buckets         the new bucket count (must be the recorded grow_to)
ARGV[2] layout          the new layout version
ARGV[3] moved           keys moved in all (kept for `buckets show`)
Returns:
  {"ok"}                meta records the new count and layout; the growth marks are gone
  {"done"}              already finished (a rerun after a kill): nothing written
  {"changed", grow_to}  no growth to ARGV[1] is under way; nothing written
Writes (only for "ok"): HSET KEYS[1] buckets layout grown_from grown_moved; HDEL grow_*
]]
local meta = KEYS[1]
local cur = redis.call('HMGET', meta, 'buckets', 'grow_to', 'grow_from')
if not cur[2] then
  if cur[1] == ARGV[1] then return {'done'} end
  return {'changed', ''}
end
if cur[2] ~= ARGV[1] then return {'changed', cur[2]} end
redis.call('HSET', meta, 'buckets', ARGV[1], 'layout', ARGV[2], 'grown_from', cur[3] or '',
           'grown_moved', ARGV[3])
redis.call('HDEL', meta, 'grow_to', 'grow_from', 'grow_fence', 'grow_moved')
return {'ok'}
