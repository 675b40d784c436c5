#!lua
--[[ append_output: add a line to a running run's output (stream.write, log lines), up to the
run's output cap; past it one "truncated" marker is written and later lines are dropped.
A line is written once per position in the body (its frame and its index there): a replay
of the body after a wake or a redelivery makes the same writes again, and those are no-ops,
also when the previous execution died between the write and its next commit.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] output stream   <tag>:out:<run id>
ARGV[1] epoch           the execution's fence
ARGV[2] type            output | log
ARGV[3] data            JSON data of the event
ARGV[4] seq             this execution's write number; one already applied answers "ok"
ARGV[5] max_entries     cap on the lines a run may write
ARGV[6] max_bytes       cap on the bytes of data a run may write
ARGV[7] frame           id of the entry of the frame that writes (hex; a step's includes its
                        try); "": a write with no position (always written)
ARGV[8] index           the write's index in that frame entry (0, 1, ...)
ARGV[9] data_bytes      the data's size as written ('' = #ARGV[3]): it is stored sealed
                        (payloads/codec.py), the cap is on what the body wrote
Returns:
  {"ok"}
  {"replayed"}            this position was written before (by this run's earlier
                          execution); nothing written
  {"capped"}              the run's output cap is reached; this line was dropped
  {"stale", epoch}        a newer execution owns the run; nothing written
  {"settled", status}     the run is finished; nothing written
Writes (only for a fresh "ok" or "capped"): HSET/HINCRBY KEYS[1] (wseq, the frame's field
  "o|<frame>": how many of its writes were made); XADD KEYS[2] (not once capped)
]]
local run, out = KEYS[1], KEYS[2]
local position = 'o|' .. ARGV[7]  -- "o|" (no position) is never written
local r = redis.call('HMGET', run, 'epoch', 'status', 'attempt', 'wseq', 'out_n', 'out_b',
  'out_cut', position)
if r[1] ~= ARGV[1] then return {'stale', tonumber(r[1] or '0')} end
if r[2] ~= 'running' then return {'settled', r[2] or ''} end
if tonumber(ARGV[4]) <= tonumber(r[4] or '0') then return {'ok'} end  -- a resend
local index = tonumber(ARGV[8])
if ARGV[7] ~= '' and index < (tonumber(r[8] or '0') or 0) then return {'replayed'} end
if ARGV[7] ~= '' then
  redis.call('HSET', run, 'wseq', ARGV[4], position, index + 1)
else
  redis.call('HSET', run, 'wseq', ARGV[4])
end
if r[7] == '1' then return {'capped'} end
local n, b = tonumber(r[5] or '0') or 0, tonumber(r[6] or '0') or 0
local size = tonumber(ARGV[9]) or #ARGV[3]
if n + 1 > tonumber(ARGV[5]) or b + size > tonumber(ARGV[6]) then
  redis.call('HSET', run, 'out_cut', '1')
  redis.call('XADD', out, '*', 't', 'truncated', 'a', r[3],
    'd', '{"lines":' .. n .. ',"bytes":' .. b .. ',"max_lines":' .. ARGV[5]
      .. ',"max_bytes":' .. ARGV[6] .. '}')
  return {'capped'}
end
redis.call('HSET', run, 'out_n', n + 1, 'out_b', b + size)
redis.call('XADD', out, '*', 't', ARGV[2], 'a', r[3], 'd', ARGV[3])
return {'ok'}
