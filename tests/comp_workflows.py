"""Workflows used only by tests/test_compensation.py (loaded by workers with --source).

Every step and every undo records what it did in Redis, keyed by the run's id:
``comp:done:<run id>`` (a list: each step's name as it finishes) and ``comp:undone:<run id>``
(a list: each undo's name once it finished its work), so "each undo once, in reverse" is
the list itself, whatever was killed in between.

* `comp_order`: five steps; steps 1 to 3 each register an undo (a declared
  `compensate=`, a `ctx.compensate` of a module-level function, and of a step); step 4
  raises. With `block` (a file path), the undo of step 2 says so
  (``comp:blocked:<run id>``) and waits while that file exists: the test kills the worker
  there.
* `comp_broken_undo`: three undos, the middle one always fails.
* `comp_parked_undo`: fails; its one undo fails and waits 5 minutes for its second try.
* `comp_pausing_undo`: pauses its failed steps; of its two undos the last always fails.
* `comp_waiter`: one undo, then waits for signal ``go``.
* `comp_long`: one undo, then a step that runs until the test stops it (or 60 s).
* `comp_bad`: registers what cannot be an undo (by its input).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

import marbles_rq as mr
from marbles_rq.engine.authoring import StepDef

DONE = "comp:done:"
UNDONE = "comp:undone:"
BLOCKED = "comp:blocked:"


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


def _log(prefix: str, what: str) -> None:
    _client().rpush(prefix + mr.current().run_id, what)


@mr.step(name="comp_refund", retries=2, delay_s=0.05)
def comp_refund(order: str, amount: int, result: Any = None) -> None:
    _log(UNDONE, f"refund {order} {amount} {result}")


@mr.step(name="comp_charge", compensate=comp_refund)
def comp_charge(order: str, amount: int) -> str:
    _log(DONE, "charge")
    return f"receipt-{order}"


def comp_release(item: str, block: str = "") -> None:
    """A plain function undo (retried by the default policy)."""
    if block:
        _client().set(BLOCKED + mr.current().run_id, str(os.getpid()))
        deadline = time.monotonic() + 60
        while os.path.exists(block) and time.monotonic() < deadline:
            time.sleep(0.05)
    _log(UNDONE, f"release {item}")


@mr.step(name="comp_reserve")
def comp_reserve(item: str) -> str:
    _log(DONE, f"reserve {item}")
    return item


@mr.step(name="comp_unbook", retries=1, delay_s=0.05)
def comp_unbook(slot: str) -> None:
    _log(UNDONE, f"unbook {slot}")


@mr.step(name="comp_book")
def comp_book(slot: str) -> str:
    _log(DONE, f"book {slot}")
    return slot


@mr.step(name="comp_ship")
def comp_ship(order: str) -> None:
    _log(DONE, "ship (failing)")
    raise RuntimeError(f"no courier for {order}")


@mr.step(name="comp_notify")
def comp_notify(order: str) -> None:
    _log(DONE, "notify")


@mr.workflow()
def comp_order(ctx: mr.RunContext, inp: dict[str, Any]) -> str:
    order = str(inp["order"])
    comp_charge(order, 30)                                   # undo: comp_refund (declared)
    comp_reserve("stock")
    ctx.compensate(comp_release, "stock", inp.get("block", ""))  # undo: a plain function
    comp_book("tuesday")
    mr.compensate(comp_unbook, "tuesday")                    # undo: a step
    comp_ship(order)                                         # step 4 fails
    comp_notify(order)                                       # step 5: never reached
    return "shipped"


@mr.step(name="comp_always_fails", retries=1, delay_s=0.05)
def comp_always_fails(what: str) -> None:
    _log(UNDONE, f"tried {what}")
    raise ValueError(f"cannot undo {what}")


@mr.workflow()
def comp_broken_undo(ctx: mr.RunContext) -> str:
    comp_reserve("a")
    ctx.compensate(comp_release, "a")
    comp_reserve("b")
    ctx.compensate(comp_always_fails, "b")
    comp_reserve("c")
    ctx.compensate(comp_release, "c")
    raise ValueError("the body gives up")


@mr.step(name="comp_undo_later", retry=mr.Retry(initial="5m", max_attempts=2, jitter=False))
def comp_undo_later(what: str) -> None:
    _log(UNDONE, f"tried {what}")
    raise ValueError(f"cannot undo {what} yet")


@mr.workflow()
def comp_parked_undo(ctx: mr.RunContext) -> str:
    comp_reserve("p")
    ctx.compensate(comp_undo_later, "p")
    raise ValueError("the body gives up")


@mr.workflow(on_exhausted="pause")
def comp_pausing_undo(ctx: mr.RunContext) -> str:
    comp_reserve("q")
    ctx.compensate(comp_release, "q")
    comp_reserve("r")
    ctx.compensate(comp_always_fails, "r")
    raise ValueError("the body gives up")


@mr.workflow()
def comp_waiter(ctx: mr.RunContext) -> str:
    comp_reserve("w")
    ctx.compensate(comp_release, "w")
    mr.wait_for_signal("go")
    comp_reserve("after")
    return "done"


@mr.step(name="comp_slow")
def comp_slow(stop_file: str) -> str:
    _log(DONE, "slow started")
    deadline = time.monotonic() + 60
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    _log(DONE, "slow finished")
    return "slow"


@mr.workflow()
def comp_long(ctx: mr.RunContext, stop_file: str) -> str:
    comp_reserve("l")
    ctx.compensate(comp_release, "l")
    comp_slow(stop_file)
    comp_reserve("after")
    return "done"


def _not_at_top_level() -> Any:
    def nested(item: str) -> None: ...
    return nested


@mr.workflow()
def comp_bad(ctx: mr.RunContext, what: str) -> str:
    comp_reserve("x")
    if what == "lambda":
        ctx.compensate(lambda: None)
    elif what == "nested":
        ctx.compensate(_not_at_top_level(), "x")
    elif what == "json":
        ctx.compensate(comp_release, object())
    elif what == "unregistered":
        ctx.compensate(StepDef("comp_nowhere", comp_release), "x")
    return "registered"
