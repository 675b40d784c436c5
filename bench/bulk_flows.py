"""The workflow bench/bulk.py enqueues: one small struct input, never executed there."""

from __future__ import annotations

import msgspec

import marbles_rq as mr


class Item(msgspec.Struct):
    n: int
    note: str = ""


@mr.workflow
def bulk_item(ctx: mr.RunContext, item: Item) -> int:
    return item.n
