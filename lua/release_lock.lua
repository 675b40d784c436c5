#!lua
--[[ release_lock: a run gives a durable mutex back (flow/locks.py): its `with` block ended
(also on an exception), its run settled, or a waiter found the holder's run finished. Only
the holder releases: an older execution of the run (fenced by its epoch) or another run
cannot. Also drops a run from the lock's queue (a waiter whose run is gone).
KEYS[1] state hash      {P:lock:<id>}:state   (acquire_lock)
KEYS[2] queue zset      {P:lock:<id>}:queue   run id -> arrival number
ARGV[1] run_id          the holder giving it back ('' none: only drop ARGV[3])
ARGV[2] epoch           the holder's epoch; "<= N" releases the hold of any execution of the
                        run up to epoch N (a holder whose run finished)
ARGV[3] drop            a run id to remove from the queue ('' none)
Returns:
  {"ok", head}          released; head: the run now first in the queue ('' none), to wake
  {"not_held", head}    that execution holds no hold (another does, it lapsed and another
                        took it, or this is a resend): the hold is left as it is
Writes: HDEL/HSET KEYS[1] (only for "ok"); ZREM KEYS[2] (ARGV[3])
]]
local state, queue = KEYS[1], KEYS[2]
local run_id, want = ARGV[1], ARGV[2]
if ARGV[3] ~= '' then redis.call('ZREM', queue, ARGV[3]) end
local h = redis.call('HMGET', state, 'run', 'epoch')
local head = redis.call('ZRANGE', queue, 0, 0)[1] or ''
local by = tonumber(h[2] or '0') or 0
local upto = tonumber(string.match(want, '^<= (%d+)$') or '-1')
if run_id == '' or h[1] ~= run_id or not (tostring(by) == want or by <= upto) then
  return {'not_held', head}
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HDEL', state, 'run', 'epoch', 'since', 'until')
-- The head's wait for a free lock starts now (acquire_lock drops a head that never comes).
if head ~= '' then redis.call('HSET', state, 'free', now_ms) end
return {'ok', head}
