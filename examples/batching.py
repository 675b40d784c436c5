"""Metered usage billed in batches: one run per customer for up to 3 usage events, or 2 s
after the customer's first unbilled event (docs/how-to/event-batching.md)."""

from __future__ import annotations

from typing import Any

import marbles_rq as mr


@mr.step
def invoice_line(customer: str, units: int) -> str:
    return f"{customer}: {units} units"


@mr.on_event("meter", batch=mr.Batch(max_size=3, max_wait="2s", key="customer"))
@mr.workflow
def bill_usage(ctx: mr.RunContext, events: list[mr.Event]) -> dict[str, Any]:
    customer = events[0].payload["customer"]
    units = sum(int(e.payload["units"]) for e in events)
    return {"line": invoice_line(customer, units), "events": [e.id for e in events]}
