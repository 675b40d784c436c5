#!lua
--[[ release_slot: a run gives its slot of a concurrency limit back: its execution settled,
parked or stopped, or the controller redelivered it after its worker was lost (flow control,
marbles_rq/engine/flowctl.py). Only the holder releases: a newer delivery of the same run
(a wake racing the park) or a newer execution of the same delivery keeps its hold.
KEYS[1] slots zset      {P:lim:<limit id>}:slots     run id -> slot expiry (server ms)
KEYS[2] holders hash    {P:lim:<limit id>}:holders   run id -> "<attempt>|<token>" holding it
ARGV[1] run_id
ARGV[2] holder          "<attempt>|<token>" of the execution giving it back, or "<attempt>|*"
                        (the controller, for a vanished execution of that delivery)
Returns:
  {"ok"}                released
  {"not_held"}          that holder holds no slot (another does, it expired and was pruned,
                        or this is a resend): nothing written
Writes (only for "ok"): ZREM KEYS[1], HDEL KEYS[2]
]]
local slots, holders = KEYS[1], KEYS[2]
local run_id, want = ARGV[1], ARGV[2]
local holder = redis.call('HGET', holders, run_id)
if not holder then return {'not_held'} end
local attempt, any = string.match(want, '^(%d+)|(.*)$')
if holder ~= want and not (any == '*' and string.match(holder, '^(%d+)|') == attempt) then
  return {'not_held'}
end
redis.call('ZREM', slots, run_id)
redis.call('HDEL', holders, run_id)
return {'ok'}
