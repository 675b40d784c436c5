"""Workflows of bench/compensation.py: five trivial steps, with and without undos.

* ``cb_plain``      five steps, succeeds (the baseline);
* ``cb_declared``   five steps declared with ``compensate=``, succeeds (what registering
  costs when nothing fails);
* ``cb_explicit``   five steps, each followed by ``ctx.compensate``, succeeds;
* ``cb_fail``       five steps, then the body raises (a failure with nothing to undo);
* ``cb_fail_comp``  five steps declared with ``compensate=``, then the body raises: five
  undos run.
"""

from __future__ import annotations

import marbles_rq as mr


@mr.step
def cb_undo(i: int) -> int:
    return i


@mr.step
def cb_tick(i: int) -> int:
    return i


@mr.step(compensate=cb_undo)
def cb_booked(i: int) -> int:
    return i


@mr.workflow(max_deliveries=1000)
def cb_plain(ctx: mr.RunContext) -> int:
    return sum(cb_tick(i) for i in range(5))


@mr.workflow(max_deliveries=1000)
def cb_declared(ctx: mr.RunContext) -> int:
    return sum(cb_booked(i) for i in range(5))


@mr.workflow(max_deliveries=1000)
def cb_explicit(ctx: mr.RunContext) -> int:
    total = 0
    for i in range(5):
        total += cb_tick(i)
        ctx.compensate(cb_undo, i)
    return total


@mr.workflow(max_deliveries=1000)
def cb_fail(ctx: mr.RunContext) -> int:
    for i in range(5):
        cb_tick(i)
    raise RuntimeError("the body gives up")


@mr.workflow(max_deliveries=1000)
def cb_fail_comp(ctx: mr.RunContext) -> int:
    for i in range(5):
        cb_booked(i)
    raise RuntimeError("the body gives up")
