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
"""

from __future__ import annotations

import json
import os
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
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


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
