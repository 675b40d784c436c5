"""An async workflow: its steps are coroutines, gathered; a sync step mixed in; a durable
sleep between them (`marbles-rq --source examples/async_pages.py worker --concurrency 16`)."""

from __future__ import annotations

import asyncio

import marbles_rq as mr


@mr.step
async def measure(text: str) -> int:
    await asyncio.sleep(0.05)  # stands for an HTTP call, an LLM call, a webhook
    return len(text)


@mr.step
def total(sizes: list[int]) -> int:  # a sync step: an async body runs it in a thread
    return sum(sizes)


@mr.workflow
async def measure_all(ctx: mr.AsyncRunContext, texts: list[str]) -> dict[str, object]:
    sizes = await asyncio.gather(*(measure(t) for t in texts))  # recorded in call order
    await ctx.sleep(1)  # parks the run: no worker, no thread held while it waits
    return {"sizes": list(sizes), "total": await total(list(sizes))}
