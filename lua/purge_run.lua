#!lua
--[[ purge_run: remove a finished run whose retention has passed: its hash, ledger, output,
effect receipts and index entries. Nothing of it stays in Redis.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
KEYS[3] output stream   <tag>:out:<run id>
KEYS[4] run listing     <tag>:idx:run
KEYS[5] finished zset   <tag>:finished
KEYS[6] effect index    <tag>:effidx:<run id>      set of its receipt keys
KEYS[7..] receipts      every member of KEYS[6], as read by the caller
ARGV[1] run_id
Returns:
  {"ok", keys_deleted}
  {"not_due"}             not finished, or its retention has not passed; nothing written
  {"retry"}               the effect index changed since it was read; nothing written
Writes (only for "ok"): DEL KEYS[1], KEYS[2], KEYS[3], KEYS[6], KEYS[7..]; ZREM KEYS[4], KEYS[5]
]]
local run, steps, out, listing, finished, index = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6]
local run_id = ARGV[1]
local due = redis.call('ZSCORE', finished, run_id)
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if not due or tonumber(due) > now_ms then return {'not_due'} end
local s = redis.pcall('HGET', run, 'status')
if s == 'queued' or s == 'running' or s == 'waiting' then return {'not_due'} end
if redis.call('SCARD', index) ~= #KEYS - 6 then return {'retry'} end
for i = 7, #KEYS do
  if redis.call('SISMEMBER', index, KEYS[i]) == 0 then return {'retry'} end
end
local n = 0
for i = 1, #KEYS do
  if i ~= 4 and i ~= 5 then n = n + redis.call('DEL', KEYS[i]) end
end
redis.call('ZREM', listing, run_id)
redis.call('ZREM', finished, run_id)
return {'ok', n}
