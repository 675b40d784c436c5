#!lua
--[[ dispatch_done: the controller checked a run's dispatch entry (its delivery is in RQ now,
or the run has moved on). Remove the entry, unless the run was handed a new delivery since
the check read it (a redelivery or a deferral re-adds the entry for that delivery).
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] dispatch zset   <tag>:dispatch
ARGV[1] run_id
ARGV[2] attempt         the delivery the check saw ('' if the run was not queued)
Returns:
  {"ok"}                  removed
  {"kept"}                a newer delivery is waiting to be dispatched; nothing written
Writes (only for "ok"): ZREM KEYS[2]
]]
local run, dispatch = KEYS[1], KEYS[2]
local r = redis.pcall('HMGET', run, 'status', 'attempt')
if not r.err and r[1] == 'queued' and r[2] ~= ARGV[2] then return {'kept'} end
redis.call('ZREM', dispatch, ARGV[1])
return {'ok'}
