"""Workflows of tests/test_lean_transport.py: imported by it (for enqueueing and in-process
runs) and loaded by its worker processes (--source)."""

from __future__ import annotations

import time

import msgspec

import marbles_rq as mr


@mr.workflow
def lt_noop(ctx: mr.RunContext) -> str:
    return "ok"


class NapsInput(msgspec.Struct):
    steps: int = 3
    sleep_s: float = 0.5


@mr.step
def lt_nap(index: int, seconds: float) -> int:
    time.sleep(seconds)
    return index


@mr.workflow(max_deliveries=10)
def lt_naps(ctx: mr.RunContext, inp: NapsInput) -> int:
    return sum(lt_nap(i, inp.sleep_s) for i in range(inp.steps))
