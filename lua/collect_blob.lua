#!lua
--[[ collect_blob: the garbage collection's judgement of one blob (controller/blob_gc.py).
The controller asked each holder older than its grace whether it still references the
blob; those that do not are removed here, each only if its time is the one the controller
read (a holder that put the blob again since is kept). When no holder is left:
  * Redis backend (KEYS[2] given): the bytes and the holders go now ("deleted");
  * file or S3 backend: `$del` is set (puts wait while it is there) and the controller
    deletes the object, then calls finish_blob ("delete").
A `$del` already there is a deletion that a killed controller left: "delete" again (every
step is idempotent).
KEYS[1] holders hash  {P:blob:<sha[:4]>}:holders:<sha>
KEYS[2] blob string   {P:blob:<sha[:4]>}:<sha>   (optional: Redis backend only)
ARGV    holder, ms, holder, ms, ...   the dead holders and the times read
Returns:
  {"kept", n}         n holders are left; nothing else written
  {"deleted"}         Redis backend: bytes and holders deleted
  {"delete"}          `$del` set: delete the object, then finish_blob
Writes: HDEL KEYS[1]; HSET KEYS[1] $del | DEL KEYS[1], KEYS[2]
]]
local holders = KEYS[1]
if redis.call('HEXISTS', holders, '$del') == 1 then return {'delete'} end
for i = 1, #ARGV, 2 do
  if redis.call('HGET', holders, ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', holders, ARGV[i])
  end
end
local left = redis.call('HLEN', holders)
if left > 0 then return {'kept', left} end
if KEYS[2] then
  redis.call('DEL', KEYS[2])
  return {'deleted'}
end
local t = redis.call('TIME')
redis.call('HSET', holders, '$del', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
return {'delete'}
