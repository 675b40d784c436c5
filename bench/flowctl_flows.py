"""Workflows for bench/flowctl.py (loaded by its workers with --source, and by the driver):
one trivial step each, without and with a concurrency limit that never fills."""

from __future__ import annotations

import marbles_rq as mr


@mr.step
def tick(i: int) -> int:
    return i


@mr.workflow(max_deliveries=1000)
def one_step(ctx: mr.RunContext) -> int:
    return tick(0)


@mr.workflow(max_deliveries=1000, concurrency=1000)
def one_step_limited(ctx: mr.RunContext) -> int:
    return tick(0)


@mr.workflow(max_deliveries=1000, concurrency=1000, concurrency_key="customer")
def one_step_keyed(ctx: mr.RunContext, inp: dict) -> int:  # type: ignore[type-arg]
    return tick(0)
