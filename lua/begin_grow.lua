#!lua
--[[ begin_grow: mark a deployment as growing its bucket count, if no worker is alive.
KEYS[1] meta hash       {<prefix>}:meta
KEYS[2] workers         {<prefix>}:workers   zset: worker name -> when it is lost (server ms)
ARGV[1] buckets         the bucket count the caller read (the growth starts from it)
ARGV[2] to              the new bucket count
Returns:
  {"ok"}                          meta now has grow_to (or already had this one)
  {"workers", n, name}            n workers still beat (name: one of them); nothing written
  {"changed", buckets, grow_to}   meta is not what the caller read; nothing written
Writes (only for "ok"): HSET KEYS[1] grow_to grow_from
]]
local meta, workers = KEYS[1], KEYS[2]
local cur = redis.call('HMGET', meta, 'buckets', 'grow_to')
if cur[1] ~= ARGV[1] or (cur[2] and cur[2] ~= ARGV[2]) then
  return {'changed', cur[1] or '', cur[2] or ''}
end
if cur[2] then return {'ok'} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local alive = redis.call('ZRANGEBYSCORE', workers, '(' .. now_ms, '+inf', 'LIMIT', 0, 1)
if #alive > 0 then
  return {'workers', redis.call('ZCOUNT', workers, '(' .. now_ms, '+inf'), alive[1]}
end
redis.call('HSET', meta, 'grow_to', ARGV[2], 'grow_from', ARGV[1])
return {'ok'}
