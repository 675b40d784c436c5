#!lua
--[[ drop_event_wait: remove a wait that ended (an event delivered, its timeout, its run gone)
from the index of waits for events.
KEYS[1] term zset       {<prefix>:evwait}:w:<term digest>
KEYS[2] spec hash       {<prefix>:evwait}:spec
ARGV[1] member          "<run id>|<wait key>"
Returns:
  {"ok", removed}         removed: 1 if it was indexed
Writes: ZREM KEYS[1]; HDEL KEYS[2]
]]
local n = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return {'ok', n}
