"""Workflows for the rerun-order and retention tests; loaded with
--source tests/rerun_workflows.py.

`ordered` runs three steps whose execution order is not their names' order (zeta, then
alpha, then mid); each counts its executions in Redis (INCR `ordered:<step>` at
MARBLES_REDIS_URL), so a test sees which steps a rerun executed again.

`gathering` starts children of `short_child` (retention 1 s), asks a question, and only
then gathers them: a parent that waits longer than its children's retention.
"""

from __future__ import annotations

import os

import redis

import marbles_rq as mr


def _counter() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


@mr.step
def zeta(n: int) -> int:
    _counter().incr("ordered:zeta")
    return n + 1


@mr.step
def alpha(n: int) -> int:
    _counter().incr("ordered:alpha")
    return n * 10


@mr.step
def mid(n: int) -> int:
    _counter().incr("ordered:mid")
    return n + 3


@mr.workflow
def ordered(ctx: mr.RunContext, n: int) -> int:
    return mid(alpha(zeta(n)))


@mr.workflow(retention_s=1)
def short_child(ctx: mr.RunContext, n: int) -> int:
    return n * 2


@mr.workflow
def gathering(ctx: mr.RunContext, n: int) -> list[int]:
    children = [mr.start_child("short_child", i) for i in range(n)]
    ctx.ask.approval("Gather?", key="go")
    return [c.result() for c in children]
