#!lua
--[[ claim_event: journal an inbound event before its run (insert-if-absent on its stable key).
KEYS[1] event hash      <tag>:evt:<event key>
KEYS[2] event listing   <tag>:evidx              zset event key -> received (server ms)
KEYS[3] pending zset    <tag>:evpending          event key -> when the controller starts it
KEYS[4] offer zset      <tag>:evoffer            event key -> when the controller delivers it
                                                 to waiting runs if its sender has not
ARGV[1] event_key       the stable key, derived from source and the provider's event id
ARGV[2] doc             EventRecord JSON, stored verbatim
ARGV[3] request_id      a resend with the same id answers "ok" again
ARGV[4] workflow        the triggered workflow; '' when no trigger matches (state unmatched)
ARGV[5] run_id          the run it starts (derived from the event key); '' when unmatched
ARGV[6] grace_ms        the controller starts a pending event after this long
ARGV[7] batch           BatchSlot JSON when the trigger batches its events (the batch the
                        controller appends a pending event to); '' otherwise
Returns:
  {"ok", received_ms}                    journaled by this call (or an earlier send of it)
  {"exists", doc, state, workflow, run}  the event was received before; nothing written
Writes (only when absent): HSET KEYS[1]; ZADD KEYS[2]; ZADD KEYS[3] (when a trigger matched);
  ZADD KEYS[4]
]]
local evt, listing, pending, offer = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local key, doc, req, workflow, run_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]

local existing = redis.call('HMGET', evt, 'doc', 'req', 'state', 'workflow', 'run',
  'received_ms')
if existing[1] then
  if existing[2] == req then return {'ok', tonumber(existing[6])} end
  return {'exists', existing[1], existing[3] or '', existing[4] or '', existing[5] or ''}
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = 'pending'
if workflow == '' then state = 'unmatched' end
redis.call('HSET', evt, 'doc', doc, 'req', req, 'state', state, 'workflow', workflow,
  'run', run_id, 'received_ms', now_ms)
if ARGV[7] ~= '' then redis.call('HSET', evt, 'batch', ARGV[7]) end
redis.call('ZADD', listing, now_ms, key)
if state == 'pending' then redis.call('ZADD', pending, now_ms + tonumber(ARGV[6]), key) end
redis.call('ZADD', offer, now_ms + tonumber(ARGV[6]), key)
return {'ok', now_ms}
