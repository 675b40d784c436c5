"""Workflows of bench/batching.py (recorded, never executed: the bench measures sending)."""

from __future__ import annotations

import marbles_rq as mr


@mr.on_event("bb-batched", batch=mr.Batch(max_size=100, max_wait="1h"))
@mr.workflow
def bb_batched(ctx: mr.RunContext, events: list[mr.Event]) -> int:
    return len(events)


@mr.on_event("bb-single")
@mr.workflow
def bb_single(ctx: mr.RunContext, event: mr.Event) -> str:
    return event.id


@mr.workflow
def bb_plain(ctx: mr.RunContext, order: dict[str, int]) -> int:
    return len(order)
