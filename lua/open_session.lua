#!lua
--[[ open_session: create-or-get a session (a conversation transcript) by id, and record who
uses it. Creating under an id that already exists returns the existing one, unchanged; a
record whose document cannot be decoded is never overwritten (nothing written, "corrupt").
KEYS[1] session hash    <tag>:ses:<id>       doc (SessionRecord JSON), n (messages so far),
                                              created_ms, last_ms, keep ("1": created
                                              outside any run, kept until deleted)
KEYS[2] owners set      <tag>:sesown:<id>    run ids that opened it (retention)
KEYS[3] listing zset    <tag>:idx:ses         session id -> created (server ms)
ARGV[1] id              the session id
ARGV[2] doc             the SessionRecord JSON to create it with
ARGV[3] owner           the run id opening it ("" outside a run)
ARGV[4] keep            "1" when a client creates it (kept until deleted), else "0"
Returns:
  {"created", doc, 0}
  {"exists", doc, n}      the existing session (its owners now include ARGV[3])
  {"corrupt"}             its document cannot be decoded; nothing written
Writes: created: HSET KEYS[1] doc n created_ms last_ms keep; ZADD KEYS[3]; SADD KEYS[2] (owner);
  exists: SADD KEYS[2] (owner)
]]
local ses, owners, listing = KEYS[1], KEYS[2], KEYS[3]
local found = redis.call('HMGET', ses, 'doc', 'n')
if found[1] then
  local ok, decoded = pcall(cjson.decode, found[1])
  if not ok or type(decoded) ~= 'table' then return {'corrupt'} end
  if ARGV[3] ~= '' then redis.call('SADD', owners, ARGV[3]) end
  return {'exists', found[1], tonumber(found[2] or '0')}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local doc = ARGV[2]
redis.call('HSET', ses, 'doc', doc, 'n', 0, 'created_ms', now, 'last_ms', now, 'keep', ARGV[4])
redis.call('ZADD', listing, now, ARGV[1])
if ARGV[3] ~= '' then redis.call('SADD', owners, ARGV[3]) end
return {'created', doc, 0}
