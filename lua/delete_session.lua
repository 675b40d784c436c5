#!lua
--[[ delete_session: remove a session and its transcript, whoever uses it (`sessions delete`,
`Client.delete_session`). A corrupt record is deleted too: deleting is how it is repaired.
KEYS[1] session hash    <tag>:ses:<id>
KEYS[2] messages        <tag>:sesmsg:<id>
KEYS[3] keys hash       <tag>:seskey:<id>
KEYS[4] owners set      <tag>:sesown:<id>
KEYS[5] listing zset    <tag>:idx:ses
ARGV[1] id              the session id
Returns:
  {"deleted", messages}   the count of messages it held
  {"missing"}             no such session; nothing written
Writes: DEL KEYS[1..4]; ZREM KEYS[5]
]]
local ses, messages, idem, owners, listing = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local existed = redis.call('EXISTS', ses)
local n = redis.call('XLEN', messages)
redis.call('DEL', ses, messages, idem, owners)
redis.call('ZREM', listing, ARGV[1])
if existed == 0 then return {'missing'} end
return {'deleted', n}
