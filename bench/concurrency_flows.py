"""Workflows of bench/concurrency.py, loaded by the workers with ``--source
bench/concurrency_flows.py`` (and by the driver, so ``ops.enqueue_many`` knows them). All on
queue ``bench``.

* ``one_step``        a sync body, one trivial sync step;
* ``one_step_async``  an async body awaiting one trivial async step;
* ``io_flow``         an async body with three async steps, each a GET of the bench's local
  HTTP server (it answers after 50 ms) through one ``httpx.AsyncClient`` per event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

import marbles_rq as mr


@mr.step
def tick(i: int) -> int:
    return i


@mr.workflow(queue="bench", max_deliveries=1000)
def one_step(ctx: mr.RunContext) -> int:
    return tick(0)


@mr.step
async def atick(i: int) -> int:
    return i


@mr.workflow(queue="bench", max_deliveries=1000)
async def one_step_async(ctx: mr.RunContext) -> int:
    return await atick(0)


_clients: dict[asyncio.AbstractEventLoop, Any] = {}


def _client() -> Any:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        import httpx

        # Room for every run the executor holds at once, each on a kept-alive connection.
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        client = _clients[loop] = httpx.AsyncClient(timeout=30, limits=limits)
    return client


@mr.step
async def fetch(url: str) -> int:
    resp = await _client().get(url)
    resp.raise_for_status()
    return len(resp.content)


class IoInput(msgspec.Struct):
    url: str


@mr.workflow(queue="bench", max_deliveries=1000)
async def io_flow(ctx: mr.RunContext, inp: IoInput) -> int:
    total = 0
    for _ in range(3):
        total += await fetch(inp.url)
    return total
