"""Workflows whose recorded runs tests/test_replay_check.py replays against changed copies of
this file (the tests write those copies, edited, to tmp_path). Every step counts its
executions in Redis (``rc:exec:<run id>``): a replay check must never run one."""

from __future__ import annotations

import inspect
import os

import redis

import marbles_rq as mr
from marbles_rq.engine import authoring

# An explicit version keeps `shipping`'s old and patched source on one version (a patch is how
# a body changes without a new one), where versions exist.
SAME_VERSION = ({"version": "1"} if "version" in inspect.signature(authoring.workflow).parameters
                else {})

EXEC_PREFIX = "rc:exec:"


def _count(name: str) -> None:
    run = mr.current()
    client = redis.Redis.from_url(os.environ["MARBLES_REDIS_URL"])
    try:
        client.hincrby(EXEC_PREFIX + run.run_id, name, 1)
    finally:
        client.close()


@mr.step("rc_fetch")  # named apart from examples/etl.py's `fetch`: steps share one registry
def fetch(n: int) -> int:
    _count("fetch")
    return n + 1


@mr.step
def check(n: int) -> int:
    _count("check")
    return n * 10


@mr.step
def weigh(n: int) -> int:
    _count("weigh")
    return n + 7


@mr.step
def pack(n: int, colour: str) -> str:
    _count("pack")
    return f"{n}-{colour}"


@mr.workflow()
def order(ctx: mr.RunContext, n: int) -> dict[str, object]:
    a = fetch(n)
    b = check(a)
    c = weigh(b)
    colour = ctx.ask.question("Colour?", choices=["red", "blue"], key="colour")
    ctx.log.info("packing in %s", colour)
    label = pack(c, colour)
    return {"label": label, "colour": colour}


@mr.workflow()
def nudged(ctx: mr.RunContext) -> str:
    payload = ctx.wait_for_signal("go")
    return pack(int(payload["n"]), "green")


@mr.workflow()
def child_sum(ctx: mr.RunContext, n: int) -> int:
    return fetch(n)


@mr.workflow()
def parent(ctx: mr.RunContext, n: int) -> list[int]:
    children = [mr.start_child("child_sum", n + i, key=f"k{i}") for i in range(2)]
    return list(mr.gather(*children))


@mr.workflow(**SAME_VERSION)
def shipping(ctx: mr.RunContext, n: int) -> str:
    a = fetch(n)
    # (the patched deploy adds `weigh` here: tests/test_replay_check.py PATCH)
    colour = ctx.ask.question("Colour?", choices=["red", "blue"], key="colour")
    size = ctx.ask.question("Size?", choices=["S", "L"], key="size")
    return pack(a, colour + size)
