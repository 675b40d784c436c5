#!lua
--[[ close_debounce: the controller closes a debounce window that came due, and reads what its
run is to be; answered again (closed) until forget_debounce, so a controller killed before it
recorded the run leaves the window to the next leader. Recording the run is insert-if-absent
on its id: the window's run starts exactly once however often this answers closed.
KEYS[1] window hash     <tag>:deb:<digest>
KEYS[2] due zset        <tag>:deb_due
KEYS[3] runs hash       <tag>:deb_runs
KEYS[4] closed hash     <tag>:deb_closed
ARGV[1] run_id          the window's run
Returns:
  {"closed", doc, input, n, cancelled}   closed (by this call or before): record doc with
                              input; cancelled "1" when cancel_debounce cancelled the window
  {"open", until}             merged since it was found due: it closes then (rescored)
  {"gone"}                    no such window (its run was recorded); index entries removed
Writes: HSET KEYS[4], DEL KEYS[1], ZADD KEYS[2] (closing); ZREM KEYS[2], HDEL KEYS[3] (gone)
]]
local window, due, runs, closed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local run_id = ARGV[1]
local c = redis.call('HMGET', closed, run_id, run_id .. '|in', run_id .. '|n', run_id .. '|x')
if c[1] then return {'closed', c[1], c[2], tonumber(c[3]), c[4] or ''} end
local w = redis.call('HMGET', window, 'run', 'until', 'doc', 'in', 'n')
if w[1] == run_id then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if now < tonumber(w[2]) then
    redis.call('ZADD', due, tonumber(w[2]), run_id)
    return {'open', tonumber(w[2])}
  end
  redis.call('HSET', closed, run_id, w[3], run_id .. '|in', w[4], run_id .. '|n', w[5])
  redis.call('ZADD', due, now, run_id)
  redis.call('DEL', window)
  return {'closed', w[3], w[4], tonumber(w[5]), ''}
end
redis.call('ZREM', due, run_id)
redis.call('HDEL', runs, run_id)
return {'gone'}
