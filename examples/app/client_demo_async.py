"""The asyncio client (`mr.connect_async`), as an async web handler uses it: many orders
placed at once on one event loop, each awaiting its result without holding a thread, and an
approval answered while the run waits.

    marbles-rq --source examples/app/shop.py dev          # in another terminal
    export MARBLES_REDIS_URL=redis://127.0.0.1:6399/0
    .venv/bin/python examples/app/client_demo_async.py
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Any

import marbles_rq as mr


async def place(client: mr.AsyncClient, order_id: str, sku: str, qty: int) -> dict[str, Any]:
    """What a POST /orders handler does: start the run (idempotent on the order id) and
    await its result."""
    run = await client.start("place_order", {"sku": sku, "qty": qty}, id=order_id)
    result: dict[str, Any] = await run.result(timeout=60)
    return result


async def approve_when_asked(client: mr.AsyncClient, order_id: str) -> str:
    run = client.handle(order_id)
    async for entry in run.watch():
        if entry.type == "parked":
            break
    return (await run.approve("big-order", note="checked")).message


async def main() -> int:
    tag = uuid.uuid4().hex[:8]
    async with mr.connect_async() as client:
        orders = [(f"a-{tag}-{i}", "book" if i % 2 else "lamp", i) for i in range(1, 11)]
        results = await asyncio.gather(*[place(client, *order) for order in orders])
        print("totals:", [r["total"] for r in results])

        big_id = f"a-{tag}-big"
        big, note = await asyncio.gather(place(client, big_id, "sofa", 1),
                                         approve_when_asked(client, big_id))
        print("approve:", note)
        print("big order:", big["status"], big["total"])

        try:
            await (await client.start("place_order", {"sku": "unicorn"})).result(timeout=60)
        except mr.RunFailedError as exc:
            print("failed:", exc.error["message"])
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
