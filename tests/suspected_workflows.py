"""Workflows loaded by the worker processes of tests/test_suspected.py (--source).

``sus_limited_parent`` (limit 1) starts a child, then blocks in a step after announcing it
on the list ``sus:holding`` (the test kills its worker there); ``sus_queued_kid`` is that
child, left queued while the only worker is busy.
"""

from __future__ import annotations

import os
import time

import redis

import marbles_rq as mr

HOLDING = "sus:holding"
HOLD_S = 120.0  # the test kills the process long before


def _redis() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


@mr.step
def sus_block() -> None:
    _redis().rpush(HOLDING, f"{mr.current().run_id}|{mr.current().attempt}|{os.getpid()}")
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
        time.sleep(0.05)


@mr.workflow
def sus_queued_kid(ctx: mr.RunContext) -> str:
    return "kid"


@mr.workflow(concurrency=1)
def sus_limited_parent(ctx: mr.RunContext) -> None:
    mr.start_child("sus_queued_kid", key="kid")
    sus_block()
