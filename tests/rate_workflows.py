"""Workflows used only by tests/test_rate_limits.py and bench/rate_limit.py (loaded by
workers with --source)."""

from __future__ import annotations

import msgspec

import marbles_rq as mr


class Order(msgspec.Struct):
    customer: str
    n: int = 0


@mr.step
def call_api(n: int) -> int:
    return n


@mr.workflow(rate_limit="20/s")
def paced(ctx: mr.RunContext, n: int = 0) -> int:
    """The workflow's own limit: 20 runs a second start their body."""
    return call_api(n)


@mr.workflow(rate_limit="4/s", rate_key="customer")
def rate_per_customer(ctx: mr.RunContext, order: Order) -> int:
    """4 a second per customer."""
    return call_api(order.n)


@mr.workflow
def inner_limited(ctx: mr.RunContext, n: int = 0) -> int:
    """A limit taken inside the body, before the step it guards."""
    first = call_api(n)
    mr.rate_limit("api", "20/s")
    return call_api(first + 1)


@mr.workflow
async def inner_async(ctx: mr.AsyncRunContext, n: int = 0) -> int:
    await mr.rate_limit("api", "20/s")
    return await ctx.step(call_api, n)


@mr.workflow(rate_limit="100000/s")
def loose(ctx: mr.RunContext, n: int = 0) -> int:
    """A limit that never binds (the benchmark's overhead)."""
    return call_api(n)


@mr.workflow
def unlimited(ctx: mr.RunContext, n: int = 0) -> int:
    return call_api(n)


@mr.workflow(rate_limit="10/s", rate_key="region")
def per_region(ctx: mr.RunContext, inp: dict) -> int:  # type: ignore[type-arg]
    """Any JSON object: the key's field is checked at enqueue by the limit itself."""
    return call_api(0)


@mr.workflow(rate_limit="1/s", rate_key="customer")
def slow_customer(ctx: mr.RunContext, order: Order) -> int:
    """1 a second per customer: runs arrive faster than that, so most are held."""
    return call_api(order.n)
