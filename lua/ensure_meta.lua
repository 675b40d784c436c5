#!lua
--[[ ensure_meta: record a deployment's key layout at first use; return what is recorded.
KEYS[1] meta hash       {<prefix>}:meta
ARGV[1] buckets         the bucket count to create the deployment with
ARGV[2] layout          the key-layout version to create it with
ARGV[3] lanes           the lane count to create it with
Returns:
  {buckets, layout, lanes, grow_to}   what the deployment recorded (just now, or before);
                                      lanes "" for a deployment older than lanes (one lane),
                                      grow_to "" unless a bucket growth is under way
Writes (first use only): HSET KEYS[1] buckets layout lanes
The caller adopts the reply, and refuses only a value it was given explicitly that differs.
]]
local meta = KEYS[1]
if redis.call('HEXISTS', meta, 'buckets') == 0 then
  redis.call('HSET', meta, 'buckets', ARGV[1], 'layout', ARGV[2], 'lanes', ARGV[3])
end
local cur = redis.call('HMGET', meta, 'buckets', 'layout', 'lanes', 'grow_to')
return {cur[1], cur[2] or '1', cur[3] or '', cur[4] or ''}
