#!lua
--[[ put_artifact: add a version to an artifact (artifacts/store.py), with its optional
compare-and-set and its idempotency token, in one step. The content's blob was written to
the blob store before this call (payloads/blobs.py): a version never references a blob that
is missing. An artifact's keys are all under the bucket tag of its name, so this is one
script on one slot.
KEYS[1] artifact hash   <tag>:art:<name>   n (last version number given: numbers are never
                                           reused), latest (highest version kept; 0: none),
                                           created_ms, media_type (declared),
                                           v:<n> -> ArtifactVersionRecord JSON,
                                           t:<token> -> n (a recorded put's version),
                                           s:<blob sha> -> versions referencing that blob
KEYS[2] listing zset    <tag>:idx:art      name -> created (server ms)
ARGV[1] name
ARGV[2] token           "<run id>|<ledger key>" of a put inside a run; "" from outside
ARGV[3] expect          "" (no check) or the version the writer read as latest (0: none)
ARGV[4] doc             ArtifactVersionRecord JSON (its number is the field name)
ARGV[5] blob            the blob's sha256 (as stored)
ARGV[6] keep            0: keep every version; N: drop the oldest beyond the newest N
Returns:
  {"ok", n, dropped...}  version n written; then the versions dropped by keep
  {"exists", n}          this token already wrote version n (a redelivered step, a resend):
                         nothing written
  {"conflict", latest}   expect was given and latest differs: nothing written
Writes (only for "ok"): HSET/HINCRBY/HDEL KEYS[1]; ZADD NX KEYS[2]
]]
local art, index = KEYS[1], KEYS[2]
local token = ARGV[2]
if token ~= '' then
  local seen = redis.call('HGET', art, 't:' .. token)
  if seen then return {'exists', tonumber(seen)} end
end
local latest = tonumber(redis.call('HGET', art, 'latest') or '0')
if ARGV[3] ~= '' and tonumber(ARGV[3]) ~= latest then return {'conflict', latest} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = redis.call('HINCRBY', art, 'n', 1)
redis.call('HSET', art, 'v:' .. n, ARGV[4], 'latest', n)
redis.call('HSETNX', art, 'created_ms', now_ms)
redis.call('HINCRBY', art, 's:' .. ARGV[5], 1)
if token ~= '' then redis.call('HSET', art, 't:' .. token, n) end
redis.call('ZADD', index, 'NX', now_ms, ARGV[1])
local reply = {'ok', n}
local keep = tonumber(ARGV[6])
if keep > 0 then
  local kept = {}
  for _, field in ipairs(redis.call('HKEYS', art)) do
    if string.sub(field, 1, 2) == 'v:' then table.insert(kept, tonumber(string.sub(field, 3))) end
  end
  table.sort(kept)
  for i = 1, #kept - keep do
    local v = kept[i]
    local doc = cjson.decode(redis.call('HGET', art, 'v:' .. v))
    redis.call('HDEL', art, 'v:' .. v)
    if doc['token'] then redis.call('HDEL', art, 't:' .. doc['token']) end
    if redis.call('HINCRBY', art, 's:' .. doc['blob'], -1) <= 0 then
      redis.call('HDEL', art, 's:' .. doc['blob'])
    end
    table.insert(reply, v)
  end
end
return reply
