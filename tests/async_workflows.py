"""Workflows used only by tests/test_async_workflows.py (loaded by workers with --source).

Every step counts its executions: it HINCRBYs field <name> of ``aw:exec:<run id>`` when its
body runs, so a count of 1 after kills and replays means "never re-run".

* `aw_fanout`: `asyncio.gather` of async steps that finish in reverse order, a sync step
  through `ctx.step`, a sync `@mr.step` awaited, `await mr.sleep`, `await
  ctx.wait_for_signal("go")`; returns all of it.
* `aw_gated`: an async step that marks itself running (``aw:running``, a set) and waits for
  the test's go (``aw:gate:<run id>``), then a second step; for kill -9 and concurrency.
* `aw_forever`: a step that marks itself started, then awaits for an hour (cancel test).
* `aw_mixed`: a sync workflow that calls an async step, and an async step calling a sync one.
* `aw_parallel`: `await ctx.parallel(...)` over two branches, each waiting for a signal.
* `aw_retry`: an async step that fails twice, then succeeds (retries=2).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import redis

import marbles_rq as mr

EXEC_PREFIX = "aw:exec:"
GATE_PREFIX = "aw:gate:"
RUNNING_KEY = "aw:running"
STARTED_PREFIX = "aw:started:"


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


def _count(name: str) -> int:
    return int(_client().hincrby(EXEC_PREFIX + mr.current().run_id, name, 1))


@mr.step
async def aw_double(x: int) -> int:
    _count(f"double{x}")
    await asyncio.sleep(0.05 * (3 - x))  # the first called finishes last
    return 2 * x


@mr.step
def aw_add(x: int) -> int:
    _count(f"add{x}")
    return x + 1


@mr.workflow
async def aw_fanout(ctx: mr.AsyncRunContext) -> dict[str, Any]:
    doubled = await asyncio.gather(*(aw_double(i) for i in range(3)))
    through_ctx = await ctx.step(aw_add, 10)
    awaited_sync = await aw_add(20)
    await mr.sleep(0.2)
    payload = await ctx.wait_for_signal("go", timeout_s=120)
    return {"doubled": doubled, "ctx": through_ctx, "sync": awaited_sync, "payload": payload}


@mr.step
async def aw_wait_gate() -> str:
    run_id = mr.current().run_id
    _count("gate")
    client = _client()
    client.sadd(RUNNING_KEY, run_id)
    while not client.exists(GATE_PREFIX + run_id):
        await asyncio.sleep(0.02)
    return "opened"


@mr.step
async def aw_after(x: str) -> str:
    _count("after")
    return x + "!"


@mr.workflow
async def aw_gated(ctx: mr.AsyncRunContext) -> str:
    first = await ctx.step(aw_add, 1)
    opened = await aw_wait_gate()
    return f"{first} {await aw_after(opened)}"


@mr.step
async def aw_long() -> str:
    _client().set(STARTED_PREFIX + mr.current().run_id, 1)
    _count("long")
    await asyncio.sleep(3600)
    _count("long_done")
    return "never"


@mr.workflow
async def aw_forever(ctx: mr.AsyncRunContext) -> str:
    return await aw_long()


@mr.step
async def aw_outer(x: int) -> int:
    _count("outer")
    return await aw_add(x) * 10  # a sync step, called from an async step: awaited


@mr.workflow
def aw_mixed(ctx: mr.RunContext, x: int = 1) -> list[int]:
    return [aw_outer(x), aw_add(x)]  # an async step from a sync body runs to its end


@mr.step
async def aw_branch_done(name: str, payload: Any) -> str:
    _count(f"branch_{name}")
    return f"{name}:{payload}"


@mr.workflow
async def aw_parallel(ctx: mr.AsyncRunContext) -> list[str]:
    async def branch(name: str) -> str:
        payload = await ctx.wait_for_signal(name)
        return str(await aw_branch_done(name, payload))

    return list(await ctx.parallel(lambda: branch("left"), lambda: branch("right")))


@mr.step(retries=2, delay_s=0.05, jitter=False)
async def aw_flaky() -> int:
    tries = _count("flaky")
    if tries < 3:
        raise RuntimeError(f"try {tries} fails")
    return tries


@mr.workflow
async def aw_retry(ctx: mr.AsyncRunContext) -> int:
    return int(await aw_flaky())
