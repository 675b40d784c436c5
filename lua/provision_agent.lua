#!lua
--[[ provision_agent: map a provisioning key to a new agent, or return the agent it maps to.
KEYS[1] provisioning key  <agents tag>:prov:<pkey>      string: the agent id
KEYS[2] agent hash        <agents tag>:agent:<agent id> {doc, req, pkey, at}
KEYS[3] agent listing     <agents tag>:idx:agent        zset of agent ids
ARGV[1] agent_id          the id KEYS[2] was built from
ARGV[2] doc               the new agent's JSON text (used only when created)
ARGV[3] request_id        a resend with the same id answers "created" again
ARGV[4] provisioning_key
Returns:
  {"created", doc}          this call (or an earlier send of it) created the agent
  {"exists", doc}           the key already maps to ARGV[1]; doc is the stored agent
  {"moved", agent_id}       the key maps to another agent id: call again with its key
  {"taken"}                 ARGV[1] already belongs to another provisioning key
Writes (only for "created"): SET KEYS[1]; HSET KEYS[2]; ZADD KEYS[3]
]]
local prov, agent, listing = KEYS[1], KEYS[2], KEYS[3]
local agent_id, doc, req, pkey = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

local mapped = redis.call('GET', prov)
if mapped then
  if mapped ~= agent_id then return {'moved', mapped} end
  local stored = redis.call('HMGET', agent, 'doc', 'req')
  if not stored[1] then return {'moved', mapped} end  -- purged meanwhile; the caller re-reads
  if stored[2] == req then return {'created', stored[1]} end
  return {'exists', stored[1]}
end
if redis.call('EXISTS', agent) == 1 then return {'taken'} end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', prov, agent_id)
redis.call('HSET', agent, 'doc', doc, 'req', req, 'pkey', pkey, 'at', now_ms)
redis.call('ZADD', listing, now_ms, agent_id)
return {'created', doc}
