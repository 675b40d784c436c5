#!lua
--[[ hold_blob: register a holder of a blob (who will reference it), before the record that
references it is written; with the Redis backend the blob's bytes are written by the same
call (SET NX: content-addressed, so the same bytes are stored once). The holder's time is
refreshed on every put: the collection judges only holders older than its grace.
While a collection deletes the blob from a file or S3 store (`$del` set, see collect_blob),
no holder is added: the caller waits for the deletion to finish and writes the blob again.
A `$del` older than stale_ms is a collection that died mid-way: this put takes over.
KEYS[1] holders hash  {P:blob:<sha[:4]>}:holders:<sha>   holder -> server ms
KEYS[2] blob string   {P:blob:<sha[:4]>}:<sha>          (optional: Redis backend only)
ARGV[1] holder        run:<id> | art:<name> | ses:<id> | ...
ARGV[2] stale_ms
ARGV[3] data          (with KEYS[2]) the blob's bytes
Returns:
  {"new"}             the blob had no holders (new, or collected before): the caller writes it
  {"known"}           it had holders: the bytes are there unless a crash lost them mid-put
  {"deleting", ms}    a collection is deleting it since ms: nothing written, retry shortly
Writes: HSET KEYS[1] (HDEL of a stale $del); SET NX KEYS[2]
]]
local holders, holder = KEYS[1], ARGV[1]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local del = redis.call('HGET', holders, '$del')
if del then
  if now_ms - tonumber(del) < tonumber(ARGV[2]) then return {'deleting', del} end
  redis.call('HDEL', holders, '$del')
end
local status = 'known'
if redis.call('EXISTS', holders) == 0 then status = 'new' end
redis.call('HSET', holders, holder, now_ms)
if KEYS[2] then redis.call('SET', KEYS[2], ARGV[3], 'NX') end
return {status}
