#!lua
--[[ purge_owned: delete a batch of one owner's records in one bucket, and their listings.
Run repeatedly (per bucket) until "remaining" is 0: each call is atomic, the sequence is
idempotent, so a crash midway leaves a state that the next run finishes.
KEYS[1]       owner set       <tag>:own:<owner>   members "<record key>|<listing key>|<member>"
KEYS[2i]      record key      of the i-th member in ARGV
KEYS[2i+1]    listing key     of the i-th member in ARGV
ARGV[i]       member          the i-th owner-set member, exactly as read
Returns:
  {"ok", removed, remaining}  removed = members purged by this call; remaining = SCARD after
Writes: DEL record; ZREM listing; SREM owner set -- only for members still in the owner set,
so records that are not (or no longer) the owner's are never touched.
]]
local owned = KEYS[1]
local n = #ARGV
if #KEYS ~= 2 * n + 1 then
  return redis.error_reply('purge_owned: expected 2 keys per member')
end
-- Validate every member against its keys before the first write.
local members = {}
for i = 1, n do
  local rec, listing, member = string.match(ARGV[i], '^(.-)|(.-)|(.*)$')
  if rec ~= KEYS[2 * i] or listing ~= KEYS[2 * i + 1] then
    return redis.error_reply('purge_owned: member ' .. i .. ' does not match its keys')
  end
  if redis.call('SISMEMBER', owned, ARGV[i]) == 1 then
    members[#members + 1] = {rec, listing, member, ARGV[i]}
  end
end
for _, m in ipairs(members) do
  redis.call('DEL', m[1])
  redis.call('ZREM', m[2], m[3])
  redis.call('SREM', owned, m[4])
end
return {'ok', #members, redis.call('SCARD', owned)}
