#!lua
--[[ add_report: a run reports a milestone or a result: kept with the run and listed in the
feed. Keyed by its ledger position (or the key given), so a replay adds nothing twice.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] reports hash    <tag>:reports:<run id>    key -> ReportRecord JSON
KEYS[3] report index    <tag>:reportidx           "<run id>|<key>" -> reported (server ms)
KEYS[4] output stream   <tag>:out:<run id>
ARGV[1] epoch           the execution's fence
ARGV[2] run_id
ARGV[3] key             milestone:<n> | result:<n> | the key given
ARGV[4] doc             ReportRecord JSON
ARGV[5] event           JSON data of the "report" output event
Returns:
  {"ok"}                  added
  {"exists"}              a report with this key exists (a replay); nothing written
  {"stale", epoch}        a newer execution owns the run; nothing written
  {"settled", status}     the run is finished; nothing written
Writes (only for "ok"): HSET KEYS[2]; ZADD KEYS[3]; XADD KEYS[4]
]]
local run, reports, index, out = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local r = redis.call('HMGET', run, 'epoch', 'status', 'attempt')
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
if redis.call('HSETNX', reports, ARGV[3], ARGV[4]) == 0 then return {'exists'} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', index, now_ms, ARGV[2] .. '|' .. ARGV[3])
redis.call('XADD', out, '*', 't', 'report', 'a', r[3], 'd', ARGV[5])
return {'ok'}
