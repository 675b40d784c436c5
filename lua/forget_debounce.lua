#!lua
--[[ forget_debounce: a closed debounce window's run is recorded; drop what the window left.
KEYS[1] due zset        <tag>:deb_due
KEYS[2] runs hash       <tag>:deb_runs
KEYS[3] closed hash     <tag>:deb_closed
ARGV[1] run_id
Returns:
  {"ok"}
Writes: ZREM KEYS[1]; HDEL KEYS[2], KEYS[3]
]]
local run_id = ARGV[1]
redis.call('HDEL', KEYS[3], run_id, run_id .. '|in', run_id .. '|n', run_id .. '|x')
redis.call('ZREM', KEYS[1], run_id)
redis.call('HDEL', KEYS[2], run_id)
return {'ok'}
