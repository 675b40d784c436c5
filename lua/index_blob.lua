#!lua
--[[ index_blob: enter a blob in the index the garbage collection walks, before the blob is
written (payloads/blobs.py): an index entry without its blob is only dropped by the
collection, never a blob without its entry. A put of a blob already indexed moves its next
look to no sooner than `look_ms` from now, so a collection that read the entry as due before
this put never removes it (reindex_blob refuses a moved entry).
KEYS[1] index zset   {P:blobs}:index   sha -> when the collection looks at it next (server ms)
KEYS[2] sizes hash   {P:blobs}:sizes   sha -> size in bytes
KEYS[3] stats hash   {P:blobs}:stats   blobs, bytes, collected
ARGV[1] sha          the blob's sha256 (hex)
ARGV[2] size         bytes
ARGV[3] look_ms      from now, when the collection looks at it first (its grace)
Returns:
  {"new"}            indexed now (counted in blobs and bytes)
  {"known"}          indexed already; its next look is no sooner than now + look_ms
Writes: ZADD KEYS[1]; for "new" also HSET KEYS[2], HINCRBY KEYS[3]
]]
local index, sizes, stats = KEYS[1], KEYS[2], KEYS[3]
local sha, size = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local look = now_ms + tonumber(ARGV[3])
local was = redis.call('ZSCORE', index, sha)
if was then
  if tonumber(was) < look then redis.call('ZADD', index, 'XX', look, sha) end
  return {'known'}
end
redis.call('ZADD', index, look, sha)
redis.call('HSET', sizes, sha, size)
redis.call('HINCRBY', stats, 'blobs', 1)
redis.call('HINCRBY', stats, 'bytes', size)
return {'new'}
