"""Workflows for bench/codec.py: ``ten_payload_steps`` runs ten steps, each returning a
JSON value of about ``size`` bytes built from its input (so every step result, and the
input and result of the run, pass through the payload codec)."""

from __future__ import annotations

from typing import Any

import marbles_rq as mr


@mr.step
def payload_step(i: int, size: int) -> dict[str, Any]:
    rows = max(1, size // 64)
    return {"step": i, "rows": [{"id": n, "name": f"customer {n:06d}", "note": "paid in full"}
                                for n in range(rows)]}


@mr.workflow(max_deliveries=1000)
def ten_payload_steps(ctx: mr.RunContext, inp: dict[str, Any]) -> int:
    total = 0
    for i in range(10):
        total += len(payload_step(i, int(inp["size"]))["rows"])
    return total
