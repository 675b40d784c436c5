#!lua
--[[ declare_artifact: make an artifact known before any version exists (a worker, for each
`mr.artifact(...)` its source declares at module level), so listings show it. Idempotent.
KEYS[1] artifact hash   <tag>:art:<name>   (see put_artifact.lua)
KEYS[2] listing zset    <tag>:idx:art      name -> created (server ms)
ARGV[1] name
ARGV[2] media_type      the declared media type ("" leaves it as it is)
Returns:
  {"ok", 1}              declared now
  {"ok", 0}              it was known already (its media type updated if given)
Writes: HSETNX/HSET KEYS[1]; ZADD NX KEYS[2]
]]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local fresh = redis.call('HSETNX', KEYS[1], 'created_ms', now_ms)
redis.call('HSETNX', KEYS[1], 'n', 0)
redis.call('HSETNX', KEYS[1], 'latest', 0)
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'media_type', ARGV[2]) end
redis.call('ZADD', KEYS[2], 'NX', now_ms, ARGV[1])
return {'ok', fresh}
