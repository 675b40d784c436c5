"""Workflows used only by tests/test_mutex.py and bench/locks.py (loaded by workers with
--source).

Each critical section appends JSON lines to the file the input names (one write each, with
O_APPEND: a total order across processes): ``enter`` and ``exit`` with the run id, the
executing process and the execution's epoch (the lock's fence), so the test can tell the
executions apart and check that no two were inside at once.

* `lk_contend`: the critical section is one step (enter, hold, exit).
* `lk_gated`: the step holds the lock until the test sets ``lk:gate:<run id>``.
* `lk_async`: `async with mr.lock(...)` around an async step.
* `lk_raises`: raises inside the block (the lock is released, the run fails).
* `lk_sleeps`: `mr.sleep` inside the block (parks holding it), then a step.
* `lk_bad`: an invalid key, from the input.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import msgspec
import redis

import marbles_rq as mr
from marbles_rq.engine.context import current_run

GATE_PREFIX = "lk:gate:"


class Job(msgspec.Struct):
    log: str = ""
    key: str = "shared"
    hold_s: float = 0.2
    lease_s: float = 5.0


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


def note(path: str, event: str) -> None:
    if not path:
        return
    run = current_run()
    assert run is not None
    line = json.dumps({"ev": event, "run": run.run_id, "epoch": run.ex.epoch,
                       "pid": os.getpid(), "t": time.time()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@mr.step
def lk_critical(path: str, hold_s: float) -> str:
    note(path, "enter")
    time.sleep(hold_s)
    note(path, "exit")
    return "ok"


@mr.step
def lk_wait_gate(path: str) -> str:
    note(path, "enter")
    gate = GATE_PREFIX + mr.current().run_id
    client = _client()
    while not client.exists(gate):  # the test opens it (a poll: test code)
        time.sleep(0.02)
    note(path, "exit")
    return "ok"


@mr.step
async def lk_critical_async(path: str, hold_s: float) -> str:
    note(path, "enter")
    await asyncio.sleep(hold_s)
    note(path, "exit")
    return "ok"


@mr.workflow
def lk_contend(ctx: mr.RunContext, job: Job) -> str:
    with mr.lock(job.key, lease_s=job.lease_s):
        lk_critical(job.log, job.hold_s)
    return "done"


@mr.workflow
def lk_gated(ctx: mr.RunContext, job: Job) -> str:
    with mr.lock(job.key, lease_s=job.lease_s):
        lk_wait_gate(job.log)
    return "done"


@mr.workflow
async def lk_async(ctx: mr.AsyncRunContext, job: Job) -> str:
    async with mr.lock(job.key, lease_s=job.lease_s):
        await lk_critical_async(job.log, job.hold_s)
    return "done"


@mr.workflow
def lk_raises(ctx: mr.RunContext, job: Job) -> str:
    with mr.lock(job.key, lease_s=job.lease_s):
        lk_critical(job.log, 0.0)
        raise ValueError("inside the lock")


@mr.workflow
def lk_sleeps(ctx: mr.RunContext, job: Job) -> str:
    with mr.lock(job.key, lease_s=job.lease_s):
        lk_critical(job.log, 0.0)
        mr.sleep(job.hold_s)
        lk_critical(job.log, 0.0)
    return "done"


@mr.workflow
def lk_bad(ctx: mr.RunContext, job: Job) -> str:
    with mr.lock(job.key, lease_s=job.lease_s):
        return "never"
