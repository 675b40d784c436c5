"""Workflows of the tracing tests (tests/test_tracing.py): a parent with two steps and a
child, loaded by the real worker the end-to-end test starts."""

from __future__ import annotations

import marbles_rq as mr


@mr.step
def tr_fetch(n: int) -> int:
    return n + 1


@mr.step
def tr_double(n: int) -> int:
    return n * 2


@mr.step
def tr_child_step(n: int) -> int:
    return n + 100


@mr.workflow("tr_child")
def tr_child(ctx: mr.RunContext, inp: dict[str, int]) -> int:
    return tr_child_step(inp["n"])


@mr.workflow("tr_parent")
def tr_parent(ctx: mr.RunContext, inp: dict[str, int]) -> list[int]:
    a = tr_fetch(inp["n"])
    b = tr_double(a)
    ctx.log.info("steps done: %s", b)
    (child,) = mr.gather(mr.start_child("tr_child", {"n": b}))
    return [a, b, child]


@mr.on_event("tr-shop", type="paid")
@mr.workflow("tr_on_paid")
def tr_on_paid(ctx: mr.RunContext, event: mr.Event) -> str:
    return event.id
