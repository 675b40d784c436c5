#!lua
--[[ singleton_enqueue: the decision of one enqueue of a singleton workflow, by compare-and-set
on the key's pointer to its unfinished run (the caller read it: ARGV[1]). The pointed run is
in the pointer's bucket, so its status is read here: a pointer to a finished or pruned run
is taken over (whoever finds it clears it); one to a run not yet recorded counts as
unfinished for ARGV[4] (its enqueuer records it right after this call).
KEYS[1] pointer         <tag>:one:<digest>       "<run id>|<set at ms>|<run it cancelled>"
KEYS[2] run hash        <tag>:run:<ARGV[1]> (the pointer itself when ARGV[1] is "")
ARGV[1] expect          the run id the caller read from the pointer ("" none)
ARGV[2] run_id          the new run's id
ARGV[3] mode            skip | cancel_running
ARGV[4] grace_ms        how long a pointer to an unrecorded run counts as unfinished
Returns:
  {"started", ""}                 the pointer is the new run's now
  {"cancelled_running", old}      old was unfinished: flagged cancelled; the pointer is the
                                  new run's now (the caller cancels old at once too)
  {"skipped", old}                old is unfinished; nothing written
  {"retry", current}              the pointer is not ARGV[1] any more; nothing written
Writes: SET KEYS[1]; HSET KEYS[2] (cancel = 1)
]]
local pointer, run = KEYS[1], KEYS[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('GET', pointer) or ''
local cur_id, set_ms, cancelled = string.match(cur, '^(.*)|(%d+)|(.*)$')
cur_id = cur_id or ''
if cur_id == ARGV[2] then  -- a resend
  if cancelled ~= '' then return {'cancelled_running', cancelled} end
  return {'started', ''}
end
if cur_id ~= ARGV[1] then return {'retry', cur_id} end
local old = ''
if cur_id ~= '' then
  local status = redis.call('HGET', run, 'status')
  local live = status == 'queued' or status == 'running' or status == 'waiting'
  if not status and now - tonumber(set_ms) < tonumber(ARGV[4]) then live = true end
  if live then
    if ARGV[3] == 'skip' then return {'skipped', cur_id} end
    if status then redis.call('HSET', run, 'cancel', '1') end
    old = cur_id
  end
end
redis.call('SET', pointer, ARGV[2] .. '|' .. now .. '|' .. old)
if old ~= '' then return {'cancelled_running', old} end
return {'started', ''}
