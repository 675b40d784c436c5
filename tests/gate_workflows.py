"""Workflows used only by tests/test_enqueue_gates.py (loaded by workers with --source).

Each body records what it ran with in plain Redis lists of the test's server
(MARBLES_REDIS_URL): ``gates:ran`` gets ``{run, workflow, input}`` per execution.
"""

from __future__ import annotations

import json
import os
import time

import msgspec
import redis

import marbles_rq as mr

RAN = "gates:ran"


class Order(msgspec.Struct):
    customer: str
    n: int = 0
    items: list[int] = msgspec.field(default_factory=list)


def _redis() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


def _ran(name: str, inp: Order) -> None:
    _redis().rpush(RAN, json.dumps({"run": mr.current().run_id, "workflow": name,
                                    "input": msgspec.to_builtins(inp)}))


def merge_items(previous: Order, new: Order) -> Order:
    return Order(previous.customer, new.n, previous.items + new.items)


@mr.workflow(debounce="2s", debounce_key="customer")
def gate_last(ctx: mr.RunContext, inp: Order) -> int:
    _ran("gate_last", inp)
    return inp.n


@mr.workflow(debounce="2s", debounce_key="customer", debounce_reduce=merge_items)
def gate_reduce(ctx: mr.RunContext, inp: Order) -> int:
    _ran("gate_reduce", inp)
    return len(inp.items)


@mr.workflow(debounce="1s", debounce_max="2s")
def gate_max(ctx: mr.RunContext, inp: Order) -> int:
    _ran("gate_max", inp)
    return inp.n


@mr.workflow(throttle="10/min", throttle_key="customer")
def gate_throttle(ctx: mr.RunContext, inp: Order) -> int:
    return inp.n


@mr.step
def tick(i: int) -> int:
    time.sleep(0.05)
    return i


def _hold(inp: Order) -> None:
    # Unfinished until the test pushes to gates:release:<customer> (or 120 s pass).
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if _redis().lindex(f"gates:release:{inp.customer}", 0) is not None:
            return
        tick(0)


@mr.workflow(singleton="skip", singleton_key="customer")
def gate_skip(ctx: mr.RunContext, inp: Order) -> int:
    _ran("gate_skip", inp)
    _hold(inp)
    return inp.n


@mr.workflow(singleton="cancel_running", singleton_key=lambda inp: inp.customer)
def gate_cancel(ctx: mr.RunContext, inp: Order) -> int:
    _ran("gate_cancel", inp)
    _hold(inp)
    return inp.n


@mr.workflow(throttle="100/min", throttle_key="customer")
def gate_untyped(ctx: mr.RunContext, inp: dict) -> None:  # type: ignore[type-arg]
    return None


@mr.workflow(debounce="1h", debounce_key="customer")
def gate_long(ctx: mr.RunContext, inp: Order) -> int:
    return inp.n
