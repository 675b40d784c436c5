"""Workflows of tests/test_metrics.py: one that succeeds, one that fails, one that sleeps on a
durable timer, and one fired by a schedule every second."""

from __future__ import annotations

import marbles_rq as mr


@mr.step
def mstep(x: int) -> int:
    return x + 1


@mr.step
def mboom() -> None:
    raise ValueError("boom")


@mr.workflow
def mok(ctx: mr.RunContext) -> int:
    return mstep(1)


@mr.workflow
def mfail(ctx: mr.RunContext) -> None:
    mboom()


@mr.workflow
def mnap(ctx: mr.RunContext) -> int:
    mr.sleep(0.3)  # parks the run on a timer; the controller wakes it
    return mstep(2)


@mr.schedule(every="1s")
@mr.workflow
def mtick(ctx: mr.RunContext) -> int:
    return mstep(3)
