"""Workflows for the bulk-operation and tag tests (--source tests/bulk_workflows.py).

`tagged` carries a declared tag and tags itself from its input; `approval` parks on an
approval keyed "ship" and returns the decision; `quick` just returns.
"""

from __future__ import annotations

import msgspec

import marbles_rq as mr


class Order(msgspec.Struct):
    customer: str
    n: int = 0


@mr.workflow(tags={"team": "billing"})
def tagged(ctx: mr.RunContext, order: Order) -> int:
    ctx.tag(customer=order.customer)
    return order.n


@mr.workflow
def approval(ctx: mr.RunContext, order: Order) -> dict[str, object]:
    ctx.tag(customer=order.customer)
    decision = ctx.ask.approval(f"Ship order {order.n} for {order.customer}?", key="ship")
    return {"approved": decision["approved"], "note": decision["note"]}


@mr.workflow
def quick(ctx: mr.RunContext, order: Order) -> int:
    return order.n


@mr.workflow(tags={"team": "ops"}, retention_s=0)
def brief(ctx: mr.RunContext, order: Order) -> int:
    """Kept no time after it finishes: the controller prunes it, tag index entries too."""
    ctx.tag(customer=order.customer)
    return order.n
