#!lua
--[[ settle_run: write a run's one terminal record; a repeat returns the first one.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] lease zset      <tag>:leases
KEYS[3] dispatch zset   <tag>:dispatch
KEYS[4] output stream   <tag>:out:<run id>
KEYS[5] finished zset   <tag>:finished           run id -> when it may be pruned (server ms)
ARGV[1] epoch           the execution's fence
ARGV[2] status          succeeded | failed | cancelled
ARGV[3] result          JSON text of the result ('' for none)
ARGV[4] error           JSON text of the error ('' for none)
ARGV[5] event           JSON data of the final output event
ARGV[6] run_id
ARGV[7] after_seq       optional: settle only once the execution's write number `after_seq`
                        was applied (the commit pipelined before this call: were it refused
                        unread, a NOSCRIPT after a restart, this settle must not land alone)
Returns:
  {"ok", finished_ms}
  {"settled", status, result, error}   already finished; the first terminal record
  {"stale", epoch}                     a newer execution owns the run, or this one's lease
                                       expired; nothing written
  {"timed_out"}                        "succeeded" asked after the run's deadline; nothing
                                       written (the caller settles it failed: RunTimeout)
  {"behind"}                           write `after_seq` was not applied; nothing written
  {"compensate"}                       "cancelled" asked of a run whose cancel asked for
                                       compensation; nothing written (the caller hands it
                                       over: hand_over_compensation)
Writes (only for "ok"): XADD KEYS[4] (its id's milliseconds are finished_ms: the server
  clock; TIME is read first, for the lease and the deadline of a run that has one); one
  HSET KEYS[1] (the epoch + 1 with the terminal record); ZREM KEYS[2]; ZADD KEYS[5]. Not KEYS[3]:
  a running run has no dispatch check (start_attempt removed it, and each script that
  writes one moves the run out of "running" or to a new epoch).
]]
local run, leases, dispatch, out, finished = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local r = redis.call('HMGET', run, 'epoch', 'status', 'result', 'error', 'attempt',
  'deadline_ms', 'retention_ms', 'wseq', 'compensate')
if r[2] == 'succeeded' or r[2] == 'failed' or r[2] == 'cancelled' then
  return {'settled', r[2], r[3] or '', r[4] or ''}
end
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then
  return redis.error_reply('settle_run: run is ' .. tostring(r[2]) .. ', not running')
end
if ARGV[7] and ARGV[7] ~= '' and tonumber(r[8] or '0') < tonumber(ARGV[7]) then
  return {'behind'}
end
-- A lease that expired ends the execution's writes (see commit_step): the reaper settles
-- or redelivers the run.
local t = redis.call('TIME')
local clock_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(redis.call('ZSCORE', leases, ARGV[6]) or '0') <= clock_ms then
  return {'stale', tonumber(r[1])}
end
if ARGV[2] == 'cancelled' and r[9] then return {'compensate'} end
local now_ms
local deadline = tonumber(r[6] or '0')
if ARGV[2] == 'succeeded' and deadline > 0 then
  now_ms = clock_ms
  if now_ms > deadline then return {'timed_out'} end
end
local id = redis.call('XADD', out, '*', 't', 'final', 'a', r[5], 'd', ARGV[5])
-- The event's id is at or after the server clock (a stream's ids never go back).
now_ms = math.max(now_ms or 0, tonumber(string.match(id, '^%d+')))
-- The epoch + 1 fences the execution itself: an effect claimed after the terminal record is
-- refused.
redis.call('HSET', run, 'status', ARGV[2], 'finished_ms', now_ms, 'result', ARGV[3],
  'error', ARGV[4], 'epoch', tonumber(r[1]) + 1)
redis.call('ZREM', leases, ARGV[6])
redis.call('ZADD', finished, now_ms + tonumber(r[7] or '604800000'), ARGV[6])
return {'ok', now_ms}
