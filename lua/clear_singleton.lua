#!lua
--[[ clear_singleton: a singleton's run finished: clear the key's pointer if it still points
to that run (compare-and-set: a newer run's pointer stays).
KEYS[1] pointer         <tag>:one:<digest>
ARGV[1] run_id
Returns:
  {"cleared"} | {"kept"}
Writes: DEL KEYS[1]
]]
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, #ARGV[1] + 1) == ARGV[1] .. '|' then
  redis.call('DEL', KEYS[1])
  return {'cleared'}
end
return {'kept'}
