"""Workflows of the client tests (tests/test_client.py)."""

from __future__ import annotations

import time
from typing import Any

import msgspec

import marbles_rq as mr


class Order(msgspec.Struct):
    sku: str
    qty: int = 1


@mr.step
def cl_price(sku: str, qty: int) -> int:
    return len(sku) * 100 * qty


@mr.workflow
def cl_order(ctx: mr.RunContext, order: Order) -> dict[str, Any]:
    return {"sku": order.sku, "total": cl_price(order.sku, order.qty)}


@mr.step
def cl_boom(message: str) -> None:
    raise ValueError(message)


@mr.workflow
def cl_fail(ctx: mr.RunContext, inp: dict[str, Any]) -> None:
    cl_boom(inp.get("message", "boom"))


@mr.step
def cl_nap(i: int, seconds: float) -> int:
    time.sleep(seconds)
    return i


@mr.workflow
def cl_slow(ctx: mr.RunContext, inp: dict[str, Any]) -> int:
    return sum(cl_nap(i, inp.get("sleep_s", 0.5)) for i in range(inp.get("steps", 3)))


@mr.workflow
def cl_approval(ctx: mr.RunContext) -> dict[str, Any]:
    return dict(ctx.ask.approval("Ship it?", key="ship"))


@mr.on_event("cl-shop", type="paid")
@mr.workflow
def cl_on_paid(ctx: mr.RunContext, event: mr.Event) -> dict[str, Any]:
    return {"paid": event.payload}


@mr.workflow
def cl_publish(ctx: mr.RunContext, inp: dict[str, Any]) -> str:
    ctx.publish("stage", "started")
    cl_nap(0, inp.get("sleep_s", 0.5))
    ctx.publish("stage", "done")
    return "ok"


@mr.workflow
def cl_signal(ctx: mr.RunContext) -> list[Any]:
    return [ctx.wait_for_signal("go", timeout_s=60) for _ in range(2)]


@mr.workflow
def cl_slashed(ctx: mr.RunContext) -> Any:
    """Names and keys holding '/', as applications namespace them."""
    got = ctx.wait_for_signal("orders/paid", timeout_s=60)
    ctx.publish("orders/last", got)
    return dict(ctx.ask.approval("Ship it?", key="ship/eu")) | {"paid": got}


@mr.workflow
def cl_greet(ctx: mr.RunContext, name: str = "world") -> str:
    return f"hello {name}"


@mr.workflow
def cl_settings(ctx: mr.RunContext, opts: dict[str, Any] = {"n": 2}) -> dict[str, Any]:  # noqa: B006
    return opts
