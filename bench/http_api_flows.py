"""The workflow of bench/http_api.py: one step."""

from __future__ import annotations

from typing import Any

import marbles_rq as mr


@mr.step
def bench_http_add(n: int) -> int:
    return n + 1


@mr.workflow
def bench_http_one(ctx: mr.RunContext, inp: dict[str, Any]) -> int:
    return bench_http_add(inp["n"])
