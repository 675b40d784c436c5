#!lua
--[[ cancel_debounce: cancel the run of a debounce window before it is recorded: the window is
closed now, marked cancelled (its run is then recorded and cancelled at once, never
delivered); a window closed already but not yet recorded is marked the same way.
KEYS[1] window hash     <tag>:deb:<digest>
KEYS[2] due zset        <tag>:deb_due
KEYS[3] closed hash     <tag>:deb_closed
ARGV[1] run_id
Returns:
  {"cancelled"}   marked: the close records the run cancelled
  {"missing"}     no open or closed window has this run (recorded already, or none)
Writes: HSET KEYS[3]; DEL KEYS[1]; ZADD KEYS[2]
]]
local window, due, closed = KEYS[1], KEYS[2], KEYS[3]
local run_id = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('HEXISTS', closed, run_id) == 1 then
  redis.call('HSET', closed, run_id .. '|x', '1')
  return {'cancelled'}
end
local w = redis.call('HMGET', window, 'run', 'doc', 'in', 'n')
if w[1] ~= run_id then return {'missing'} end
redis.call('HSET', closed, run_id, w[2], run_id .. '|in', w[3], run_id .. '|n', w[4],
  run_id .. '|x', '1')
redis.call('DEL', window)
redis.call('ZADD', due, now, run_id)
return {'cancelled'}
