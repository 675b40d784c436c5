#!lua
--[[ purge_run: remove a finished run whose retention has passed: its hash, ledger, output,
questions, reports, signals, effect receipts and index entries. Nothing of it stays in Redis.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
KEYS[3] output stream   <tag>:out:<run id>
KEYS[4] run listing     <tag>:idx:run
KEYS[5] finished zset   <tag>:finished
KEYS[6] effect index    <tag>:effidx:<run id>      set of its receipt keys
KEYS[7] asks hash       <tag>:asks:<run id>
KEYS[8] reports hash    <tag>:reports:<run id>
KEYS[9] feed zset       <tag>:feed
KEYS[10] report index   <tag>:reportidx
KEYS[11] waits zset     <tag>:waits
KEYS[12] published hash <tag>:pub:<run id>
KEYS[13] event inbox    <tag>:evin:<run id>
KEYS[14] signals hash   <tag>:sig:<run id>
KEYS[15..] receipts     every member of KEYS[6], as read by the caller (ARGV[2] of them)
KEYS[15+r..] tag indexes <tag>:idx:tag:<key>=<value> of each of the run's tags, as read
ARGV[1] run_id
ARGV[2] receipts        how many receipt keys follow KEYS[14] (r)
ARGV[3] tags            the run's `tags` field as the caller read it ("" for none)
Returns:
  {"ok", keys_deleted}
  {"not_due"}             not finished, or its retention has not passed; nothing written
  {"retry"}               the effect index or the run's tags changed since they were read;
                          nothing written
Writes (only for "ok"): DEL KEYS[1], KEYS[2], KEYS[3], KEYS[6], KEYS[7], KEYS[8], KEYS[12],
  KEYS[13], KEYS[14], the receipts;
  ZREM KEYS[4], KEYS[5], KEYS[9], KEYS[10], KEYS[11], the tag indexes
]]
local run, steps, out, listing, finished, index = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6]
local asks, reports, feed, report_index, waits = KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]
local run_id = ARGV[1]
local due = redis.call('ZSCORE', finished, run_id)
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if not due or tonumber(due) > now_ms then return {'not_due'} end
local s = redis.pcall('HGET', run, 'status')
if s == 'queued' or s == 'running' or s == 'waiting' then return {'not_due'} end
local receipts = tonumber(ARGV[2])
if redis.call('SCARD', index) ~= receipts then return {'retry'} end
if (redis.call('HGET', run, 'tags') or '') ~= ARGV[3] then return {'retry'} end
for i = 15, 14 + receipts do
  if redis.call('SISMEMBER', index, KEYS[i]) == 0 then return {'retry'} end
end
for _, pair in ipairs({{asks, feed}, {reports, report_index}}) do
  for _, key in ipairs(redis.call('HKEYS', pair[1])) do
    if not string.find(key, '|', 1, true) then  -- keys never hold '|'; fields after it do
      redis.call('ZREM', pair[2], run_id .. '|' .. key)
    end
  end
end
redis.call('ZREM', feed, run_id .. '|!failed_step')  -- a failed step's entry (park_run)
local n = 0
for _, i in ipairs({1, 2, 3, 6, 7, 8}) do n = n + redis.call('DEL', KEYS[i]) end
n = n + redis.call('DEL', KEYS[12], KEYS[13], KEYS[14])  -- published, event inbox, signals
for i = 15, 14 + receipts do n = n + redis.call('DEL', KEYS[i]) end
for i = 15 + receipts, #KEYS do redis.call('ZREM', KEYS[i], run_id) end
redis.call('ZREM', listing, run_id)
redis.call('ZREM', finished, run_id)
redis.call('ZREM', waits, run_id)
return {'ok', n}
