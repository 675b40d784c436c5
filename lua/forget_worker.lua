#!lua
--[[ forget_worker: take a worker off the liveness index: a worker that stops cleanly (nothing
left running), or a lost one whose runs the controller has handled.
KEYS[1] workers zset    {<prefix>}:workers      worker name -> when it is lost (server ms)
KEYS[2] lanes hash      optional: {<prefix>}:worker_lanes  worker name -> the lanes it serves
KEYS[3] versions hash   optional, with KEYS[2]: {<prefix>}:worker_versions  worker name ->
                        the workflow versions it serves
ARGV[1] worker          the worker's name
ARGV[2] cutoff_ms       remove it only if it is lost at or before this time (a worker that
                        beat again since, e.g. after SIGCONT, is kept); "" removes it anyway
Returns:
  {"ok"}                  removed
  {"kept"}                it beat again after the cutoff, or is not there; nothing written
Writes (only for "ok"): ZREM KEYS[1]; HDEL KEYS[2], KEYS[3] when given
]]
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return {'kept'} end
if ARGV[2] ~= '' and tonumber(score) > tonumber(ARGV[2]) then return {'kept'} end
redis.call('ZREM', KEYS[1], ARGV[1])
if KEYS[2] then redis.call('HDEL', KEYS[2], ARGV[1]) end
if KEYS[3] then redis.call('HDEL', KEYS[3], ARGV[1]) end
return {'ok'}
