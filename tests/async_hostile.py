"""Workflows used only by tests/test_async_hostile.py (loaded by workers with --source):
async bodies written the way a user may write them wrongly or unusually.

Every step counts its executions in ``ah:exec:<run id>`` (HINCRBY of its field).

* `ah_helpers`: `asyncio.gather` of two helper coroutines, each calling two steps in turn;
  the first helper's first step finishes last, so the second helpers reach their second
  step in the reverse order of their call; then a durable sleep (a replay from the top).
"""

from __future__ import annotations

import asyncio
import os

import redis

import marbles_rq as mr

EXEC_PREFIX = "ah:exec:"


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


def _count(name: str) -> int:
    return int(_client().hincrby(EXEC_PREFIX + mr.current().run_id, name, 1))


@mr.step
async def ah_fetch(i: int) -> int:
    _count(f"fetch{i}")
    await asyncio.sleep(0.3 if i == 0 else 0.01)  # the first called finishes last
    return i


@mr.step
async def ah_label(i: int) -> str:
    _count(f"label{i}")
    return f"item-{i}"


@mr.workflow
async def ah_helpers(ctx: mr.AsyncRunContext) -> list[str]:
    async def helper(i: int) -> str:
        fetched = await ah_fetch(i)
        ctx.stream.write(f"helper {i} fetched in {mr.current().run_id}\n")
        ctx.log.info("helper %s labels", i)
        return await ah_label(fetched)

    labels = await asyncio.gather(helper(0), helper(1))
    await ctx.sleep(0.1)  # parks: the run is replayed from the top when woken
    return list(labels)


RUNNING_KEY = "ah:running"
GATE_PREFIX = "ah:gate:"


@mr.step
def ah_first(x: int) -> int:
    _count("first")
    return x + 1


@mr.step
async def ah_wait_gate() -> str:
    """Marks itself running, then waits for the test's go; rides out a Redis outage (its
    polls fail meanwhile: the user's code, not the engine, talks to Redis here)."""
    run_id = mr.current().run_id
    _count("gate")
    client = _client()
    client.sadd(RUNNING_KEY, run_id)
    while True:
        try:
            if client.exists(GATE_PREFIX + run_id):
                return "opened"
        except redis.RedisError:
            pass
        await asyncio.sleep(0.05)


@mr.step
async def ah_after(x: str) -> str:
    _count("after")
    return x + "!"


@mr.workflow
async def ah_gated(ctx: mr.AsyncRunContext) -> str:
    first = await ah_first(1)
    opened = await ah_wait_gate()
    return f"{first} {await ah_after(opened)}"


@mr.step
async def ah_nap(i: int) -> int:
    client = _client()
    client.hincrby(EXEC_PREFIX + mr.current().run_id, f"nap{i}", 1)
    client.sadd(RUNNING_KEY, mr.current().run_id)
    await asyncio.sleep(0.05)
    return i


@mr.workflow
async def ah_naps(ctx: mr.AsyncRunContext, n: int) -> int:
    total = 0
    for i in range(n):
        total += await ah_nap(i)
    return total


@mr.workflow
async def ah_forgot_await(ctx: mr.AsyncRunContext) -> str:
    ctx.sleep(0.5)  # the await forgotten: it still parks, as mr.sleep does
    ctx.wait_for_signal("go")  # the await forgotten: it still waits, as mr.wait_for_signal
    return "done"


MARK_PREFIX = "ah:mark:"


@mr.step
def ah_slow_sync(x: int) -> int:
    """A sync step (an async body runs it in the thread pool): marks itself started, then
    waits for the test's gate."""
    import time

    run_id = mr.current().run_id
    _count("slow")
    client = _client()
    client.set(MARK_PREFIX + run_id + ":started", 1)
    while not client.exists(GATE_PREFIX + run_id):
        time.sleep(0.02)
    return x * 10


@mr.workflow
async def ah_park_mid_step(ctx: mr.AsyncRunContext) -> list[object]:
    """One gathered task parks (a signal) while its sibling is inside a sync step."""
    run_id = ctx.run_id
    client = _client()

    async def waiter() -> object:
        while not client.exists(MARK_PREFIX + run_id + ":started"):
            await asyncio.sleep(0.02)
        client.set(MARK_PREFIX + run_id + ":waiting", 1)
        return await ctx.wait_for_signal("go")

    async def worker() -> int:
        return int(await ah_slow_sync(4))

    return list(await asyncio.gather(waiter(), worker()))


@mr.workflow
async def ah_forgot_step(ctx: mr.AsyncRunContext) -> str:
    ah_label(1)  # the await forgotten: the step would never run
    return "done"



@mr.workflow
async def ah_sync_gated(ctx: mr.AsyncRunContext) -> int:
    """An async body inside a gated sync step (in the thread pool) after a finished one."""
    return int(await ah_slow_sync(await ah_first(1)))


@mr.workflow
async def ah_forgot_parallel(ctx: mr.AsyncRunContext) -> str:
    ctx.parallel(lambda: ah_label(1), lambda: ah_label(2))  # the await forgotten
    return "done"
