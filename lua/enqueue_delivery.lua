#!lua
--[[ enqueue_delivery: put one delivery on its RQ queue in one round trip, as RQ's own unique
enqueue does (the job hash, then its id on the queue list, and the queue in RQ's set of
queues), refusing a job id that RQ already holds. The key names and the job hash's fields
are RQ's, built by RQ (marbles_rq/transport/dispatch.py): this script only writes them.
KEYS[1] job hash        RQ's job key of the delivery (rq:job:<job id>)
KEYS[2] queue list      RQ's key of the queue (rq:queue:<prefix>.<queue>)
KEYS[3] queues set      RQ's set of queue keys (rq:queues)
ARGV[1] job_id          the delivery's RQ job id, pushed on the queue list
ARGV[2] fields          how many field, value pairs follow
ARGV[3..]               the job hash: field, value, ... (Job.to_dict of the delivery's job)
Returns:
  {"ok"}                  enqueued
  {"exists"}              RQ holds a job with this id already; nothing written
  an error                KEYS[2] holds another type than a list; nothing written
Writes (only for "ok"): RPUSH KEYS[2]; HSET KEYS[1]; SADD KEYS[3] if the list was empty
]]
local job, queue, queues = KEYS[1], KEYS[2], KEYS[3]
if redis.call('EXISTS', job) == 1 then return {'exists'} end
-- The id first: RPUSH is the only write here that can fail (a queue key of another type), and
-- Redis does not roll a script back; no worker can pop it before the hash exists.
local pushed = redis.pcall('RPUSH', queue, ARGV[1])
if type(pushed) == 'table' and pushed.err then
  return redis.error_reply('enqueue_delivery: ' .. pushed.err)
end
local n = tonumber(ARGV[2])
redis.call('HSET', job, unpack(ARGV, 3, 2 + 2 * n))
-- RQ's enqueue adds the queue to its set of queues every time; here only when the list was
-- empty (new, or emptied): a queue that holds jobs was added when its first one came, and
-- the workers add the queues they serve with each registration renewal (transport/lean.py).
if pushed == 1 then redis.pcall('SADD', queues, queue) end
return {'ok'}
