"""Workflows used only by tests/test_kill.py (loaded by workers with --source).

`zchain` is examples/chain.py with its writer's identity on everything it writes, so a test
can tell which delivery (attempt, process) wrote what -- the run's own output events carry
the run's *current* attempt, not the writer's -- and with its effect claims logged:

* before its sleep, each step RPUSHes ``{attempt, pid, key}`` to ``zchain:sleeping`` (a test
  waits for it, then stops or kills the process while it sleeps);
* the sleep ends at a deadline taken before that marker, so a process that was stopped past
  the deadline claims its effect right after it is continued;
* every effect claim RPUSHes ``{attempt, pid, key, outcome}`` to ``zchain:claims``
  (outcome ``won``, ``exists``, or ``refused:<reason>`` when the execution was fenced);
* a won claim RPUSHes the key to ``zchain:receipts`` (the effect).

`zresend` stalls Redis (a busy Lua script, from another connection) right before the
execution's own calls -- its ``stream.write`` and its step commit -- so that, with a short
``MARBLES_SOCKET_TIMEOUT``, those calls time out and are resent while the first send is
still queued behind the stall.
"""

from __future__ import annotations

import json
import os
import threading
import time

import msgspec
import redis

import marbles_rq as mr

SLEEPING_KEY = "zchain:sleeping"
CLAIMS_KEY = "zchain:claims"
RECEIPTS_KEY = "zchain:receipts"


class ZChainInput(msgspec.Struct):
    steps: int
    sleep_s: float = 0.0


def _client() -> redis.Redis:
    # MARBLES_TEST_EFFECTS_URL: where the effects go when the store is a cluster (whose URL
    # a plain client cannot open), e.g. tests/test_lanes.py's cluster test.
    return redis.Redis.from_url(os.environ.get("MARBLES_TEST_EFFECTS_URL") or os.environ.get(
        "MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


@mr.step
def zlink(index: int, sleep_s: float) -> dict[str, object]:
    run = mr.current()
    key = run.idempotency_key
    me = {"attempt": run.attempt, "pid": os.getpid(), "key": key}
    target = _client()
    deadline = time.monotonic() + sleep_s
    target.rpush(SLEEPING_KEY, json.dumps(me))
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))
    outcome = "error"
    try:
        won = run.claim_effect(key)
        outcome = "won" if won else "exists"
        if won:
            target.rpush(RECEIPTS_KEY, key)
    except BaseException as exc:  # StopExecution (fenced) is a BaseException
        outcome = f"refused:{getattr(exc, 'reason', type(exc).__name__)}"
        raise
    finally:
        target.rpush(CLAIMS_KEY, json.dumps({**me, "outcome": outcome}))
    run.stream.write({**me, "index": index})
    return me


@mr.workflow
def zchain(ctx: mr.RunContext, inp: ZChainInput) -> dict[str, object]:
    done = [zlink(i, inp.sleep_s) for i in range(inp.steps)]
    return {"steps": inp.steps, "done": done}


BUSY_LUA = """
local t0 = redis.call('TIME')
local start = t0[1] * 1000000 + t0[2]
while true do
  local t = redis.call('TIME')
  if t[1] * 1000000 + t[2] - start > tonumber(ARGV[1]) then return 1 end
end
"""


class ZResendInput(msgspec.Struct):
    steps: int = 2
    stall_ms: int = 500


def _stall(ms: int) -> None:
    """Keep Redis busy for `ms` from another connection; return once the stall runs."""
    threading.Thread(target=lambda: _client().eval(BUSY_LUA, 0, ms * 1000), daemon=True).start()
    time.sleep(0.05)  # the busy script is executing by now


@mr.step
def zstalled(index: int, stall_ms: int) -> int:
    run = mr.current()
    _stall(stall_ms)
    run.stream.write({"index": index, "attempt": run.attempt})  # queued behind the stall
    _stall(stall_ms)
    return index  # its commit is queued behind the stall


@mr.workflow
def zresend(ctx: mr.RunContext, inp: ZResendInput) -> list[int]:
    return [zstalled(i, inp.stall_ms) for i in range(inp.steps)]
