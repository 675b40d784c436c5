#!lua
--[[ seed_ledger: give a run that is about to be recorded (a rerun) the recorded results of
the steps it must not execute again. Sent in one MULTI/EXEC with the claim_run that records
the run, so either both land or neither: a delivery of the new run never starts without
the ledger it was given. When a run with this id exists already, nothing is written (its
claim_run in the same transaction answers "exists"), so another run's ledger is never
touched.
KEYS[1] run hash        <tag>:run:<run id>
KEYS[2] ledger hash     <tag>:steps:<run id>
ARGV[1..]               step key, StepRecord JSON, step key, StepRecord JSON, ...
Returns:
  {"ok", n}       n entries written
  {"exists"}      the run exists; nothing written
  {"corrupt", reason}  KEYS[2] holds another type; nothing written (claim_run then records
                  the run without the ledger, so the caller must not send the claim alone:
                  it checks the ledger key's type first, see engine/rerun.py)
Writes: HSET KEYS[2]
]]
local run, steps = KEYS[1], KEYS[2]
if redis.call('EXISTS', run) == 1 then return {'exists'} end
local kind = redis.call('TYPE', steps).ok
if kind ~= 'none' and kind ~= 'hash' then return {'corrupt', steps .. ' holds a ' .. kind} end
if #ARGV == 0 then return {'ok', 0} end
redis.call('HSET', steps, unpack(ARGV))
return {'ok', #ARGV / 2}
