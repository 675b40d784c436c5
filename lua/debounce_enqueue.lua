#!lua
--[[ debounce_enqueue: one enqueue of a debounced workflow: open a window (its run id is
chosen by the caller, in the bucket of the window's key) or merge into the open one. A window
whose close time has passed is closed first (handed to the controller, which records its run)
and a new one opened, so an enqueue never merges into a window that has closed.
KEYS[1] window hash     <tag>:deb:<digest>       run, doc, in, n, first, until, max, rev, req
KEYS[2] due zset        <tag>:deb_due            run id -> when the controller closes it
KEYS[3] runs hash       <tag>:deb_runs           run id -> digest (status finds the window)
KEYS[4] closed hash     <tag>:deb_closed         <run id>, <run id>|in, <run id>|n
ARGV[1] run_id          the run a new window makes (unused when merging)
ARGV[2] doc             RunRecord JSON of that run, stored verbatim
ARGV[3] input           this enqueue's input JSON (a new window's, or the last one wins)
ARGV[4] merged          with ARGV[5] a revision: the reducer's input, replacing the window's
ARGV[5] expect          "": the last input wins; else the revision the reducer read ("?"
                        when it has read none): a window at another one answers conflict
ARGV[6] window_ms       the quiet time: each enqueue moves the close to now + this
ARGV[7] max_ms          a window closes at the latest this long after it opened (0: never)
ARGV[8] digest          the key's digest (what the runs hash maps the run id to)
ARGV[9] request_id      a resend of the last merge answers as the first send did
Returns:
  {"started", run_id, n, until, max}   a window was opened with ARGV[1]
  {"merged", run_id, n, until, max}    merged into the open window of run_id
  {"conflict", run_id, rev, input}     ARGV[5] is not the window's revision; nothing written
Writes: HSET KEYS[1] (or DEL, closing it: HSET KEYS[4]); ZADD KEYS[2]; HSET KEYS[3]
]]
local window, due, runs, closed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local w = redis.call('HMGET', window, 'run', 'until', 'rev', 'req', 'n', 'max')
if w[1] and w[4] == ARGV[9] then  -- a resend
  return {w[1] == ARGV[1] and 'started' or 'merged', w[1], tonumber(w[5]), tonumber(w[2]),
    tonumber(w[6])}
end
if w[1] and now >= tonumber(w[2]) then
  local old = redis.call('HMGET', window, 'doc', 'in')
  redis.call('HSET', closed, w[1], old[1], w[1] .. '|in', old[2], w[1] .. '|n', w[5])
  redis.call('ZADD', due, now, w[1])
  redis.call('DEL', window)
  w = {}
end
if w[1] then
  if ARGV[5] ~= '' and ARGV[5] ~= w[3] then
    return {'conflict', w[1], w[3], redis.call('HGET', window, 'in')}
  end
  local input = ARGV[5] ~= '' and ARGV[4] or ARGV[3]
  local n, most = tonumber(w[5]) + 1, tonumber(w[6])
  local close = now + tonumber(ARGV[6])
  if most > 0 and close > most then close = most end
  redis.call('HSET', window, 'in', input, 'n', n, 'until', close, 'rev', tonumber(w[3]) + 1,
    'req', ARGV[9])
  redis.call('ZADD', due, close, w[1])
  return {'merged', w[1], n, close, most}
end
local close, most = now + tonumber(ARGV[6]), 0
if tonumber(ARGV[7]) > 0 then most = now + tonumber(ARGV[7]) end
redis.call('HSET', window, 'run', ARGV[1], 'doc', ARGV[2], 'in', ARGV[3], 'n', 1, 'first', now,
  'until', close, 'max', most, 'rev', 1, 'req', ARGV[9])
redis.call('HSET', runs, ARGV[1], ARGV[8])
redis.call('ZADD', due, close, ARGV[1])
return {'started', ARGV[1], 1, close, most}
