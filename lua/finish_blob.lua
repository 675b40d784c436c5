#!lua
--[[ finish_blob: after the controller deleted a blob's object from a file or S3 store,
end the deletion collect_blob began: the holders hash (only `$del` in it) goes, and puts
waiting on it go ahead (they write the object again).
KEYS[1] holders hash  {P:blob:<sha[:4]>}:holders:<sha>
Returns:
  {"ok"}              finished now
  {"gone"}            no deletion under way (finished before, or a put took a stale one over)
Writes: DEL KEYS[1]
]]
local holders = KEYS[1]
if redis.call('HEXISTS', holders, '$del') == 0 then return {'gone'} end
if redis.call('HLEN', holders) > 1 then
  redis.call('HDEL', holders, '$del')
  return {'gone'}
end
redis.call('DEL', holders)
return {'ok'}
