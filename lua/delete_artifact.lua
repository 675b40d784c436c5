#!lua
--[[ delete_artifact: remove one version of an artifact, or every version (artifacts/store.py).
The blobs they referenced are left to the controller's collection, which finds them no longer
referenced (the s:<sha> counts below). Version numbers are never reused: the counter stays.
KEYS[1] artifact hash   <tag>:art:<name>   (see put_artifact.lua)
ARGV[1] version         a version number, or "" for every version
Returns:
  {"ok", v...}           the versions removed
  {"unknown"}            no artifact of that name
  {"no_version", latest} the artifact has no such version: nothing removed
Writes (only for "ok"): HDEL/HSET/HINCRBY KEYS[1]
]]
local art = KEYS[1]
if redis.call('EXISTS', art) == 0 then return {'unknown'} end
local function drop(v)
  local doc = cjson.decode(redis.call('HGET', art, 'v:' .. v))
  redis.call('HDEL', art, 'v:' .. v)
  if doc['token'] then redis.call('HDEL', art, 't:' .. doc['token']) end
  if redis.call('HINCRBY', art, 's:' .. doc['blob'], -1) <= 0 then
    redis.call('HDEL', art, 's:' .. doc['blob'])
  end
end
local versions = {}
for _, field in ipairs(redis.call('HKEYS', art)) do
  if string.sub(field, 1, 2) == 'v:' then table.insert(versions, tonumber(string.sub(field, 3))) end
end
table.sort(versions)
local reply = {'ok'}
if ARGV[1] == '' then
  for _, v in ipairs(versions) do drop(v); table.insert(reply, v) end
  redis.call('HSET', art, 'latest', 0)
  return reply
end
local wanted = tonumber(ARGV[1])
if redis.call('HEXISTS', art, 'v:' .. wanted) == 0 then
  return {'no_version', tonumber(redis.call('HGET', art, 'latest') or '0')}
end
drop(wanted)
local latest = 0
for _, v in ipairs(versions) do if v ~= wanted and v > latest then latest = v end end
redis.call('HSET', art, 'latest', latest)
return {'ok', wanted}
