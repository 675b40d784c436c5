#!lua
--[[ ensure_meta: record the deployment's bucket count at first use, or compare with it.
KEYS[1] meta hash       {<prefix>}:meta
ARGV[1] buckets         the bucket count this process was configured with
ARGV[2] layout          the key-layout version this process writes
Returns:
  {"ok", buckets, layout}          recorded now, or equal to what was recorded
  {"mismatch", buckets, layout}    the deployment was created with other values
Writes (first use only): HSET KEYS[1]
]]
local meta = KEYS[1]
local cur = redis.call('HMGET', meta, 'buckets', 'layout')
if cur[1] then
  if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then return {'mismatch', cur[1], cur[2] or ''} end
  return {'ok', cur[1], cur[2]}
end
redis.call('HSET', meta, 'buckets', ARGV[1], 'layout', ARGV[2])
return {'ok', ARGV[1], ARGV[2]}
