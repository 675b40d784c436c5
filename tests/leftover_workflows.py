"""Workflows for tests/test_leftovers.py: a parent parked on a timer whose child settles
after the timer came due, and a plain sleeper."""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import redis

import marbles_rq as mr

GATE_KEY = "lo:gate"  # a gated child's step returns once this key exists
GATE_S = 60.0  # at most (the test opens the gate long before)


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


def server_ms() -> int:
    secs, micros = _client().time()
    return int(secs) * 1000 + int(micros) // 1000


@mr.step
def lo_now() -> int:
    return server_ms()


@mr.step
def lo_gate(i: int) -> int:
    """Returns once the test opens the gate."""
    client, deadline = _client(), time.monotonic() + GATE_S
    while not client.exists(GATE_KEY) and time.monotonic() < deadline:
        time.sleep(0.05)
    return i * 10


class GatedIn(msgspec.Struct):
    i: int = 0


@mr.workflow
def lo_gated_child(ctx: mr.RunContext, inp: GatedIn) -> int:
    return lo_gate(inp.i)


class LateParentIn(msgspec.Struct):
    seconds: float = 1.0


@mr.workflow
def lo_late_parent(ctx: mr.RunContext, inp: LateParentIn) -> dict[str, Any]:
    """As the chaos test's cx_late_parent: starts a child, sleeps, then gathers it."""
    child = mr.start_child("lo_gated_child", {"i": 4}, key="g")
    mr.sleep(inp.seconds)
    return {"child": child.result(), "after": lo_now()}


@mr.workflow
def lo_sleeper(ctx: mr.RunContext, inp: LateParentIn) -> dict[str, Any]:
    mr.sleep(inp.seconds)
    return {"after": lo_now()}
