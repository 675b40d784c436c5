"""The workflows of the example shop: what its workers run. The application that starts them
(examples/app/client_demo.py, client_demo_async.py) does not import this module: it knows
the workflows by name from what the workers declared.

    marbles-rq --source examples/app/shop.py dev          # Redis, a controller, 2 workers

* ``place_order``: prices an order, reserves stock and charges it; an order above
  APPROVAL_OVER waits (parked, no worker held) for a person to approve it, key
  ``big-order``. An unknown sku fails the run with a ValueError.
* ``restock``: ``steps`` slow steps (``sleep_s`` each), to pause, resume or cancel.
* ``track_delivery``: waits for carrier scans sent as signals ("scan") and publishes the
  latest as "stage".
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

import marbles_rq as mr

PRICES = {"book": 12, "lamp": 45, "sofa": 1200}
APPROVAL_OVER = 1000


class Order(msgspec.Struct):
    sku: str
    qty: int = 1


class Restock(msgspec.Struct):
    sku: str
    steps: int = 3
    sleep_s: float = 0.2


@mr.step
def price(sku: str, qty: int) -> int:
    if sku not in PRICES:
        raise ValueError(f"unknown sku {sku!r}")
    return PRICES[sku] * qty


@mr.step
def reserve(sku: str, qty: int) -> str:
    return f"res-{sku}-{qty}"


@mr.step
def charge(total: int) -> str:
    # A real charge passes this key to the payment API, which applies it once, so a step
    # run again after a kill charges nothing twice.
    return f"ch-{mr.current().idempotency_key}"


@mr.workflow
def place_order(ctx: mr.RunContext, order: Order) -> dict[str, Any]:
    total = price(order.sku, order.qty)
    reservation = reserve(order.sku, order.qty)
    if total > APPROVAL_OVER:
        decision = ctx.ask.approval(f"Approve an order of {total}?", key="big-order")
        if not decision["approved"]:
            return {"status": "rejected", "total": total, "note": decision["note"]}
    return {"status": "placed", "total": total, "reservation": reservation,
            "receipt": charge(total)}


@mr.step
def restock_one(sku: str, i: int, sleep_s: float) -> int:
    time.sleep(sleep_s)
    return i


@mr.workflow
def restock(ctx: mr.RunContext, inp: Restock) -> dict[str, Any]:
    done = [restock_one(inp.sku, i, inp.sleep_s) for i in range(inp.steps)]
    return {"sku": inp.sku, "batches": len(done)}


@mr.workflow
def track_delivery(ctx: mr.RunContext, order_id: str) -> dict[str, Any]:
    """Follows a parcel: each carrier scan arrives as a signal "scan" (the run waits for it
    holding no worker), and the last one is published as "stage" for the shop's pages."""
    ctx.publish("stage", "packed")
    scans = []
    while not scans or scans[-1] != "delivered":
        scan = ctx.wait_for_signal("scan", timeout_s=7 * 86400)
        scans.append(scan["at"])
        ctx.publish("stage", scan["at"])
    return {"order": order_id, "scans": scans}
