"""Workflows used only by tests/test_hardening.py (loaded by workers with --source).

* `h_timeout_steps`: short steps until its 1.2 s timeout passes; the run fails RunTimeout
  at a step boundary while its executor lives on.
* `h_marker`: one step that RPUSHes ``{run, attempt, pid}`` to ``h:marker`` right away, then
  works for a second: a test counts how often the effect ran and in which process.
"""

from __future__ import annotations

import json
import os
import time

import redis

import marbles_rq as mr

MARKER_KEY = "h:marker"


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


@mr.step
def h_tick(i: int) -> int:
    time.sleep(0.3)
    return i


@mr.workflow(timeout_s=1.2)
def h_timeout_steps(ctx: mr.RunContext) -> None:
    for i in range(40):
        h_tick(i)


@mr.step
def h_mark() -> int:
    run = mr.current()
    _client().rpush(MARKER_KEY, json.dumps({"run": run.run_id, "attempt": run.attempt,
                                             "pid": os.getpid()}))
    time.sleep(1.0)
    return os.getpid()


@mr.workflow
def h_marker(ctx: mr.RunContext) -> int:
    return int(h_mark())


@mr.workflow
def h_many_lines(ctx: mr.RunContext, inp: dict[str, int]) -> int:
    for i in range(inp["lines"]):
        ctx.stream.write(f"line {i}")
    return inp["lines"]


@mr.step
def h_exits() -> None:
    import sys

    sys.exit(3)


@mr.workflow
def h_sys_exit(ctx: mr.RunContext) -> None:
    h_exits()
