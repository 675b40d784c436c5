"""Workflows used only by tests/test_flow_control.py (loaded by workers with --source).

Each body records what it did in plain Redis lists of the test's server (MARBLES_REDIS_URL),
on the local clock (every process of a test runs on this machine):

* ``flowctl:spans``: one ``{run, attempt, pid, start, end}`` per finished `work` step, so a
  test can count how many bodies overlapped;
* ``flowctl:starts``: run ids in the order their bodies started (priorities);
* ``flowctl:sleeping``: ``{run, attempt, pid}`` when `solo`'s second step starts its sleep
  (a test kills the worker then);
* ``flowctl:execs``: every execution of a `solo` step (``<run>|<step>|<attempt>``), and the
  set ``flowctl:receipts`` of its effects (idempotency keys), to show nothing ran twice.
"""

from __future__ import annotations

import json
import os
import time

import msgspec
import redis

import marbles_rq as mr

SPANS = "flowctl:spans"
STARTS = "flowctl:starts"
SLEEPING = "flowctl:sleeping"
EXECS = "flowctl:execs"
RECEIPTS = "flowctl:receipts"
GATE = "flowctl:gate"


class Work(msgspec.Struct):
    sleep_s: float = 0.3
    customer: str = "none"


def _redis() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


@mr.step
def work(sleep_s: float) -> float:
    run = mr.current()
    start = time.time()
    time.sleep(sleep_s)
    end = time.time()
    _redis().rpush(SPANS, json.dumps({"run": run.run_id, "attempt": run.attempt,
                                      "pid": os.getpid(), "start": start, "end": end}))
    return end


@mr.workflow(concurrency=2)
def limited(ctx: mr.RunContext, inp: Work) -> float:
    return work(inp.sleep_s)  # type: ignore[no-any-return]


@mr.workflow(concurrency=1, concurrency_key="customer")
def per_customer(ctx: mr.RunContext, inp: dict) -> float:  # type: ignore[type-arg]
    # A plain dict input: the key's field is checked by flow control itself at enqueue.
    return work(float(inp.get("sleep_s", 0.3)))  # type: ignore[no-any-return]


@mr.step
def effect(index: int, sleep_s: float) -> int:
    run = mr.current()
    target = _redis()
    target.rpush(EXECS, f"{run.run_id}|{index}|{run.attempt}")
    if sleep_s:
        target.rpush(SLEEPING, json.dumps({"run": run.run_id, "attempt": run.attempt,
                                           "pid": os.getpid()}))
        time.sleep(sleep_s)
    target.sadd(RECEIPTS, run.idempotency_key)  # the effect, idempotent on its key
    return index


@mr.workflow(concurrency=1)
def solo(ctx: mr.RunContext, inp: Work) -> int:
    effect(0, 0.0)
    return effect(1, inp.sleep_s)  # type: ignore[no-any-return]


@mr.workflow()
def ordered(ctx: mr.RunContext) -> None:
    _redis().rpush(STARTS, ctx.run_id)


@mr.workflow(priority=7)
def urgent(ctx: mr.RunContext) -> None:
    _redis().rpush(STARTS, ctx.run_id)


@mr.workflow()
def blocker(ctx: mr.RunContext) -> None:
    """Holds its worker until the test sets GATE."""
    target = _redis()
    target.rpush(STARTS, ctx.run_id)
    while not target.exists(GATE):
        time.sleep(0.02)
