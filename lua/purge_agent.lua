#!lua
--[[ purge_agent: delete an agent and its provisioning key (the last step of a purge).
KEYS[1] provisioning key  <agents tag>:prov:<pkey>
KEYS[2] agent hash        <agents tag>:agent:<agent id>
KEYS[3] agent listing     <agents tag>:idx:agent
ARGV[1] agent_id
Returns:
  {"ok"}          deleted
  {"not_found"}   no such agent (already purged)
  {"moved"}       the agent's provisioning key is not KEYS[1]: re-read and call again
Writes: DEL KEYS[2]; ZREM KEYS[3]; DEL KEYS[1] if it maps to ARGV[1]
]]
local prov, agent, listing = KEYS[1], KEYS[2], KEYS[3]
local agent_id = ARGV[1]
local pkey = redis.call('HGET', agent, 'pkey')
if not pkey then
  redis.call('ZREM', listing, agent_id)
  return {'not_found'}
end
if string.sub(prov, -string.len(pkey) - 6) ~= ':prov:' .. pkey then return {'moved'} end
redis.call('DEL', agent)
redis.call('ZREM', listing, agent_id)
if redis.call('GET', prov) == agent_id then redis.call('DEL', prov) end
return {'ok'}
