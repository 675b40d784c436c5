#!lua
--[[ tag_run: record search tags on a run and index it under each (key, value), in one call.
Tags merge: a key given again takes the new value (its old index entry is removed). A
finished run keeps the tags it had.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2..] tag indexes   <tag>:idx:tag:<key>=<value>, one per tag of ARGV[2], in its order
KEYS[2+n..] old indexes the same keys for the values the run had before, as read by the
                        caller, in the order of ARGV[4]'s keys (may be none)
ARGV[1] run_id
ARGV[2] tags            JSON object {key: value} to merge (n entries)
ARGV[3] max_tags        the most tags a run may carry after the merge
ARGV[4] seen            the run's `tags` field as the caller read it ("" for none)
Returns:
  {"ok", count}           recorded; count: the run's tags after the merge
  {"too_many", count}     the merge would leave more than max_tags; nothing written
  {"retry"}               the run's tags changed since the caller read them; nothing written
  {"missing"}             no such run
Writes (only for "ok"): HSET KEYS[1] tags; ZADD KEYS[2..1+n]; ZREM KEYS[2+n..]
]]
local run = KEYS[1]
local r = redis.pcall('HMGET', run, 'status', 'created_ms', 'tags')
if r.err or not r[1] then return {'missing'} end
if (r[3] or '') ~= ARGV[4] then return {'retry'} end
local have = {}
if r[3] and r[3] ~= '' then have = cjson.decode(r[3]) end
local new = cjson.decode(ARGV[2])
local n = 0
for _ in pairs(new) do n = n + 1 end
local count = 0
local merged = {}
for k, v in pairs(have) do merged[k] = v end
for k, v in pairs(new) do merged[k] = v end
for _ in pairs(merged) do count = count + 1 end
if count > tonumber(ARGV[3]) then return {'too_many', count} end
local score = tonumber(r[2]) or 0
-- KEYS[2..1+n] are the new indexes; the rest the old values' indexes, replaced by them.
for i = 2, 1 + n do
  redis.call('ZADD', KEYS[i], score, ARGV[1])
end
for i = 2 + n, #KEYS do
  local replaced = true
  for j = 2, 1 + n do
    if KEYS[j] == KEYS[i] then replaced = false end
  end
  if replaced then redis.call('ZREM', KEYS[i], ARGV[1]) end
end
redis.call('HSET', run, 'tags', cjson.encode(merged))
return {'ok', count}
