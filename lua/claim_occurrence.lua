#!lua
--[[ claim_occurrence: claim one occurrence of a schedule and move its cursor past it, in one
step (journal first: the occurrence exists before the cursor leaves it). Insert-if-absent.
KEYS[1] schedule hash   <tag>:sched:<key>        cursor, history, paused, buffered
KEYS[2] due zset        <tag>:sched_due          key -> when the controller looks next
KEYS[3] occurrence hash <tag>:occ:<key>@<nominal ms>
KEYS[4] open zset       <tag>:occ_open           occurrence ids claimed, not yet started
KEYS[5] bucket fence    <tag>:ctl                {epoch}: the newest controller seen here
KEYS[6] schedule lock   <tag>:lock:schedule:<key>
ARGV[1] key             the schedule key
ARGV[2] ctl_epoch       the calling controller's lease epoch; '' for a manual roll (unfenced)
ARGV[3] expected        the cursor the caller read; '' for a manual roll (forced)
ARGV[4] nominal_ms      the occurrence's nominal time
ARGV[5] occurrence_id   <key>@<nominal ms>
ARGV[6] run_id          the run id derived from the occurrence
ARGV[7] cursor          the new cursor; '' keeps it
ARGV[8] due_ms          the new due score; '' keeps it
ARGV[9] holder          the lock holder allowed to claim ('' = the lock must be free)
ARGV[10] from_buffer    '1': this fires the buffered occurrence (clears it)
ARGV[11] finish_run     a finished run whose outcome goes into the history ('' = none)
ARGV[12] last_finish    its finish time (ms)
ARGV[13] last_status    its status
Returns:
  {"ok", now_ms}          claimed (or an earlier send of this claim was)
  {"exists", run_id}      the occurrence was claimed before, for another run; nothing written
  {"moved", cursor}       the cursor is not where the caller read it; nothing written
  {"paused"}              the schedule is paused: its due entry is dropped, nothing else
  {"locked", holder}      another holder has the schedule's lock; nothing written
  {"missing"}             the schedule is not registered; nothing written
  {"fenced", epoch}       a newer controller acts on this bucket; nothing written
Writes: HSET KEYS[1]; ZADD/ZREM KEYS[2]; HSET KEYS[3]; ZADD KEYS[4]; HSET KEYS[5]
]]
local state, due, occ, open, fence, lock = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local key, epoch_arg, expected = ARGV[1], ARGV[2], ARGV[3]
local occ_id, run_id = ARGV[5], ARGV[6]

local ctl_epoch = tonumber(epoch_arg)
local seen = tonumber(redis.call('HGET', fence, 'epoch') or '0') or 0  -- garbage reads as 0
if ctl_epoch and seen > ctl_epoch then return {'fenced', seen} end
local existing = redis.call('HGET', occ, 'run_id')
if existing then
  if existing == run_id then
    return {'ok', tonumber(redis.call('HGET', occ, 'claimed_ms'))}  -- a resend
  end
  return {'exists', existing}
end
local s = redis.call('HMGET', state, 'registered_ms', 'cursor', 'paused')
if not s[1] then return {'missing'} end
local holder = redis.call('GET', lock)
if holder and holder ~= ARGV[9] then return {'locked', holder} end
if expected ~= '' then
  if s[3] == '1' then
    redis.call('ZREM', due, key)
    return {'paused'}
  end
  if (s[2] or '') ~= expected then return {'moved', s[2] or ''} end
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ctl_epoch and seen < ctl_epoch then redis.call('HSET', fence, 'epoch', ctl_epoch) end
redis.call('HSET', occ, 'key', key, 'nominal_ms', ARGV[4], 'run_id', run_id,
  'status', 'claimed', 'claimed_ms', now_ms)
redis.call('ZADD', open, now_ms, occ_id)
redis.call('HSET', state, 'last_run', run_id, 'last_nominal', ARGV[4], 'last_start', now_ms)
if ARGV[7] ~= '' then redis.call('HSET', state, 'cursor', ARGV[7]) end
if ARGV[10] == '1' then redis.call('HDEL', state, 'buffered') end
if ARGV[11] ~= '' then
  redis.call('HSET', state, 'fin_run', ARGV[11], 'last_finish', ARGV[12],
    'last_status', ARGV[13])
end
if ARGV[8] ~= '' and s[3] ~= '1' then redis.call('ZADD', due, ARGV[8], key) end
return {'ok', now_ms}
