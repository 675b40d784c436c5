#!lua
--[[ note_event: an inbound event was journaled: keep it findable by its terms (source, type
or any type, and each top-level field with its value) for the lookback window, and answer
the waits indexed under those terms with their specs (the caller checks each spec in full
and delivers the event to each matching run with deliver_event, in the run's own slot).
KEYS[1] spec hash       {<prefix>:evwait}:spec              member -> the wait's spec JSON
  then pairs of keys, one pair per term of the event:
  {<prefix>:evwait}:r:<term digest>   recent events zset: event key -> received (server ms)
  {<prefix>:evwait}:w:<term digest>   waits zset (add_event_wait)
ARGV[1] event_key
ARGV[2] keep_ms         how long an event stays findable (the longest lookback)
ARGV[3] received_ms     when it was received (server ms); '' = now (its sender, at once)
Returns:
  {"ok", received_ms, member, spec, member, spec, ...}
Writes: ZADD, ZREMRANGEBYSCORE, PEXPIRE on each recent events zset
]]
local spec = KEYS[1]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local received = tonumber(ARGV[3]) or now_ms
local keep = tonumber(ARGV[2])
local members, seen = {}, {}
for i = 2, #KEYS - 1, 2 do
  local recent, waiting = KEYS[i], KEYS[i + 1]
  redis.call('ZADD', recent, received, ARGV[1])
  redis.call('ZREMRANGEBYSCORE', recent, '-inf', now_ms - keep)
  redis.call('PEXPIRE', recent, keep)
  for _, m in ipairs(redis.call('ZRANGE', waiting, 0, -1)) do
    if not seen[m] then
      seen[m] = true
      members[#members + 1] = m
    end
  end
end
local reply = {'ok', received}
for i = 1, #members, 1000 do  -- unpack() has a limit on how many values it returns
  local last = math.min(i + 999, #members)
  local specs = redis.call('HMGET', spec, unpack(members, i, last))
  for j = i, last do
    reply[#reply + 1] = members[j]
    reply[#reply + 1] = specs[j - i + 1] or ''
  end
end
return reply
