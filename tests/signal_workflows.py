"""Workflows used only by tests/test_signals.py and bench/signal_latency.py (loaded by
workers with --source).

Every step counts its executions: it HINCRBYs field <name> of ``sg:exec:<run id>`` when its
body runs, so a count of 1 after kills, wakes and replays means "never re-run".

* `sg_once`: a step, `ctx.wait_for_signal("go")`, a step given the payload; returns both.
* `sg_collect`: `mr.wait_for_signal(name)` `n` times; returns the payloads in the order taken.
* `sg_timeout`: waits for signal "never" with `timeout_s`; returns whether it timed out.
* `sg_drain`: a step that waits for the test's go (``sg:gate:<run id>``), then
  `ctx.signals("items")`, then one `ctx.wait_for_signal("items")`; returns both.
* `sg_twins`: two parallel branches each wait for signal "twin".
* `sg_pingpong`: for `n` rounds, waits for signal "ping" and runs a step stamping when it
  started (bench/signal_latency.py measures signal -> that step's start).
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import redis

import marbles_rq as mr

EXEC_PREFIX = "sg:exec:"
GATE_PREFIX = "sg:gate:"
GATE_TIMEOUT_S = 60


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


def _count(name: str) -> None:
    _client().hincrby(EXEC_PREFIX + mr.current().run_id, name, 1)


@mr.step
def sg_prepare() -> str:
    _count("prepare")
    return "prepared"


@mr.step
def sg_finish(payload: Any) -> str:
    _count("finish")
    return f"finished with {payload!r}"


@mr.workflow
def sg_once(ctx: mr.RunContext) -> dict[str, Any]:
    prepared = sg_prepare()
    payload = ctx.wait_for_signal("go")
    finished = sg_finish(payload)
    return {"prepared": prepared, "payload": payload, "finished": finished}


class CollectInput(msgspec.Struct):
    n: int
    name: str = "item"


@mr.workflow
def sg_collect(ctx: mr.RunContext, inp: CollectInput) -> list[Any]:
    return [mr.wait_for_signal(inp.name) for _ in range(inp.n)]


class TimeoutInput(msgspec.Struct):
    timeout_s: float


@mr.workflow
def sg_timeout(ctx: mr.RunContext, inp: TimeoutInput) -> dict[str, Any]:
    started = time.time()
    try:
        ctx.wait_for_signal("never", timeout_s=inp.timeout_s)
    except mr.SignalTimeoutError as exc:
        return {"timed_out": True, "error": str(exc), "code": exc.code}
    return {"timed_out": False, "waited_s": time.time() - started}


@mr.step
def sg_gate() -> str:
    _count("gate")
    got = _client().blpop([GATE_PREFIX + mr.current().run_id], timeout=GATE_TIMEOUT_S)
    if got is None:
        raise RuntimeError("the test never opened the gate")
    return "open"


@mr.workflow
def sg_drain(ctx: mr.RunContext) -> dict[str, Any]:
    sg_gate()
    drained = ctx.signals("items")
    again = ctx.signals("items")  # nothing new between the two: empty, and replayed as such
    following = ctx.wait_for_signal("items")
    return {"drained": drained, "again": again, "next": following}


@mr.step
def sg_stamp(i: int) -> float:
    started = time.time()
    _client().rpush(f"sg:stamp:{mr.current().run_id}", f"{i}:{started}")
    return started


class PingInput(msgspec.Struct):
    n: int


@mr.workflow
def sg_pingpong(ctx: mr.RunContext, inp: PingInput) -> int:
    for i in range(inp.n):
        ctx.wait_for_signal("ping")
        sg_stamp(i)
    return inp.n


@mr.workflow
def sg_twins(ctx: mr.RunContext) -> list[Any]:
    """Two parallel branches wait for the same name: each must get its own signal."""
    return mr.parallel(lambda: mr.wait_for_signal("twin"), lambda: mr.wait_for_signal("twin"))
