"""A durable mutex (docs/how-to/locks.md): invoice numbers taken from a shared counter by a
read-modify-write that is safe only one at a time, so each run takes the series' lock
around it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import msgspec

import marbles_rq as mr

COUNTERS = Path(tempfile.gettempdir()) / "marbles-invoice-counters.json"


class Invoice(msgspec.Struct):
    series: str
    customer: str


@mr.step
def take_number(series: str) -> int:
    """Read the series' last number and write the next: two runs doing this at once would
    both take the same number."""
    counters = json.loads(COUNTERS.read_text()) if COUNTERS.exists() else {}
    counters[series] = counters.get(series, 0) + 1
    COUNTERS.write_text(json.dumps(counters))
    return int(counters[series])


@mr.workflow
def issue_invoice(ctx: mr.RunContext, invoice: Invoice) -> str:
    with mr.lock(f"invoices:{invoice.series}", lease_s=30):
        number = take_number(invoice.series)
    return f"{invoice.series}-{number:05d} for {invoice.customer}"


@mr.workflow
async def issue_invoice_async(ctx: mr.AsyncRunContext, invoice: Invoice) -> str:
    async with mr.lock(f"invoices:{invoice.series}", lease_s=30):
        number = await take_number(invoice.series)
    return f"{invoice.series}-{number:05d} for {invoice.customer}"
