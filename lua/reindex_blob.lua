#!lua
--[[ reindex_blob: the garbage collection's last step for one blob: a blob still held is
looked at again later; a deleted one leaves the index (and the counts). Either only if its
entry still has the score the controller read: a put since (index_blob) moved it, and the
blob is then looked at again at the moved time instead.
KEYS[1] index zset   {P:blobs}:index
KEYS[2] sizes hash   {P:blobs}:sizes
KEYS[3] stats hash   {P:blobs}:stats
ARGV[1] sha
ARGV[2] seen         the score read
ARGV[3] next_ms      > 0: look again then (server ms); 0: remove (the blob was deleted)
Returns:
  {"kept"}           rescored
  {"removed"}        removed, counted in `collected`
  {"moved"}          the score is not `seen` (or the entry is gone): nothing written
Writes: ZADD XX | ZREM KEYS[1], HDEL KEYS[2], HINCRBY KEYS[3]
]]
local index, sizes, stats, sha = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local score = redis.call('ZSCORE', index, sha)
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return {'moved'} end
local next_ms = tonumber(ARGV[3])
if next_ms > 0 then
  redis.call('ZADD', index, 'XX', next_ms, sha)
  return {'kept'}
end
redis.call('ZREM', index, sha)
local size = tonumber(redis.call('HGET', sizes, sha) or '0')
redis.call('HDEL', sizes, sha)
redis.call('HINCRBY', stats, 'blobs', -1)
redis.call('HINCRBY', stats, 'bytes', -size)
redis.call('HINCRBY', stats, 'collected', 1)
return {'removed'}
