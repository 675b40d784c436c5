"""Workflows used only by tests/test_published.py and tests/test_event_waits.py (loaded by
workers with --source).

Every step counts its executions: it HINCRBYs field <name> of ``pw:exec:<run id>`` when its
body runs (a replayed step returns its recorded result without running). A gated step waits
until the test pushes a token to ``pw:gate:<run id>``, so a test decides when it ends.

* `pw_publish`: publishes ``stage`` = "one", runs a gated step, publishes ``stage`` = "two"
  and ``late`` = {"n": 2}.
* `pw_wait_event`: a step, a wait for a "shop" event of type "paid" matching {"order": order}
  (lookback and timeout from the input), a step; returns the event (or {"timed_out": true}).
* `pw_wait_twice`: two waits for the same match in a row; returns both events' ids.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import redis

import marbles_rq as mr
from marbles_rq.engine.event_waits import EventWaitTimeoutError

EXEC_PREFIX = "pw:exec:"
GATE_PREFIX = "pw:gate:"
GATE_TIMEOUT_S = 60


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


def _count(name: str) -> None:
    _client().hincrby(EXEC_PREFIX + mr.current().run_id, name, 1)


@mr.step
def pw_gate() -> str:
    _count("gate")
    run_id = mr.current().run_id
    client = _client()
    # Short blocking reads: a worker's sockets time out after a few seconds.
    for _ in range(GATE_TIMEOUT_S):
        if client.blpop([GATE_PREFIX + run_id], timeout=1) is not None:
            return "opened"
    raise TimeoutError("the test never opened the gate")


@mr.step
def pw_before() -> str:
    _count("before")
    return "before"


@mr.step
def pw_after(event_id: str) -> str:
    _count("after")
    return f"after {event_id}"


@mr.workflow
def pw_publish(ctx: mr.RunContext) -> str:
    ctx.publish("stage", "one")
    pw_gate()
    mr.publish("stage", "two")
    ctx.publish("late", {"n": 2})
    return "done"


class WaitInput(msgspec.Struct):
    order: str
    lookback_s: float | None = None
    timeout_s: float | None = None


@mr.workflow
def pw_wait_event(ctx: mr.RunContext, args: WaitInput) -> dict[str, Any]:
    pw_before()
    try:
        event = ctx.wait_for_event("shop", type="paid", match={"order": args.order},
                                   lookback_s=args.lookback_s, timeout_s=args.timeout_s)
    except EventWaitTimeoutError:
        return {"timed_out": True}
    pw_after(event.id)
    return {"id": event.id, "key": event.key, "source": event.source, "type": event.type,
            "payload": event.payload}


@mr.workflow
def pw_wait_twice(ctx: mr.RunContext, args: WaitInput) -> list[str]:
    first = mr.wait_for_event("shop", type="paid", match={"order": args.order})
    second = mr.wait_for_event("shop", type="paid", match={"order": args.order})
    return [first.id, second.id]

