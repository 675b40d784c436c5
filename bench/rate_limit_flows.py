"""Workflows for bench/rate_limit.py (loaded by its workers with --source, and by the
driver): one trivial step each, without a rate limit, with one that never binds, and one of
20/s for the accuracy section."""

from __future__ import annotations

import marbles_rq as mr


@mr.step
def tick(i: int) -> int:
    return i


@mr.workflow(max_deliveries=1000)
def rl_plain(ctx: mr.RunContext) -> int:
    return tick(0)


@mr.workflow(max_deliveries=1000, rate_limit="1000000/s")
def rl_loose(ctx: mr.RunContext) -> int:
    return tick(0)


@mr.workflow(max_deliveries=1000)
def rl_inner_loose(ctx: mr.RunContext) -> int:
    mr.rate_limit("bench-api", "1000000/s")
    return tick(0)


@mr.workflow(max_deliveries=1000, rate_limit="20/s")
def rl_paced(ctx: mr.RunContext) -> int:
    return tick(0)
