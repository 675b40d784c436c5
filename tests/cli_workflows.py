"""Workflows for the CLI tests (bulk enqueue, rerun, dry run, strict input); loaded with
--source tests/cli_workflows.py.

`counted` is three steps, each counting its executions in Redis (INCR on
`counted:<step>` at MARBLES_REDIS_URL), so a test sees which steps ran again after a rerun.
"""

from __future__ import annotations

import os

import msgspec
import redis

import marbles_rq as mr


class Item(msgspec.Struct):
    n: int
    note: str = ""


class Options(msgspec.Struct):
    greeting: str = "hello"
    times: int = 1


class Order(msgspec.Struct):
    sku: str
    qty: int = 1


class Basket(msgspec.Struct):
    lines: list[Order]
    owner: Options | None = None


@mr.workflow
def basket(ctx: mr.RunContext, b: Basket) -> int:
    return sum(line.qty for line in b.lines)


@mr.workflow
def bulk_item(ctx: mr.RunContext, item: Item) -> int:
    return item.n


@mr.workflow
def greet(ctx: mr.RunContext, opts: Options) -> str:
    text = " ".join([opts.greeting] * opts.times)
    ctx.stream.write(text)
    return text


@mr.workflow
def order(ctx: mr.RunContext, o: Order) -> dict[str, object]:
    return {"sku": o.sku, "qty": o.qty}


def _counter() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


@mr.step
def first(n: int) -> int:
    _counter().incr("counted:first")
    return n + 1


@mr.step
def second(n: int) -> int:
    _counter().incr("counted:second")
    return n * 10


@mr.step
def third(n: int) -> int:
    _counter().incr("counted:third")
    return n + 3


@mr.workflow
def counted(ctx: mr.RunContext, item: Item) -> int:
    a = first(item.n)
    b = second(a)
    ctx.stream.write(f"before third: {b}")
    return third(b)


@mr.step
def plain(n: int) -> int:
    return n * 2


@mr.workflow
def asker(ctx: mr.RunContext, item: Item) -> dict[str, object]:
    doubled = plain(item.n)
    ctx.stream.write(f"doubled: {doubled}")
    decision = ctx.ask.approval(f"Ship {doubled}?", key="ship")
    colour = ctx.ask.question("Colour?", choices=["red", "blue"], key="colour")
    mr.sleep(3600)
    return {"doubled": doubled, "approved": decision["approved"], "colour": colour}


@mr.workflow
def parent(ctx: mr.RunContext, item: Item) -> list[int]:
    kids = [mr.start_child("bulk_item", {"n": item.n + i}, key=f"k{i}") for i in range(2)]
    return [int(r) for r in mr.gather(*kids)]


@mr.workflow
def crash(ctx: mr.RunContext, item: Item) -> int:
    """Fails at once (for `info`'s failed-in-the-last-hour count)."""
    raise ValueError(f"crash {item.n}")
