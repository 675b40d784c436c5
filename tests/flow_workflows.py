"""Workflows used by tests/test_waiting_flow.py: loaded by the worker processes (--source)
and imported by the test module (so its in-process tests find them in the registry).

What they write, so a test can count effects and wait on events instead of sleeping:

* ``fl:effects``  RPUSH ``<run id>:<what>`` once per execution of an effect step;
* ``fl:holding``  RPUSH ``<run id>`` when a body or step reaches a hold point on its first
                  delivery, where it blocks until the test kills its process;
* ``fl:started``  SADD ``<run id>`` when fl_par_fail's second branch starts its first step.

Steps that read the server clock (Redis TIME) return it.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from typing import Any

import msgspec
import redis

import marbles_rq as mr
from marbles_rq.engine.fanout import ChildFailedError

EFFECTS_KEY = "fl:effects"
HOLDING_KEY = "fl:holding"
STARTED_KEY = "fl:started"  # runs of fl_par_fail whose branch b has started its first step
HOLD_S = 60.0  # a hold point blocks this long at most (the test kills it long before)


def _client() -> redis.Redis:
    # MARBLES_TEST_EFFECTS_URL: where the effects go when the store is a cluster (whose URL
    # a plain client cannot open), e.g. tests/test_lanes.py's cluster test.
    return redis.Redis.from_url(os.environ.get("MARBLES_TEST_EFFECTS_URL") or os.environ.get(
        "MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


def server_ms(client: redis.Redis | None = None) -> int:
    secs, micros = (client or _client()).time()
    return int(secs) * 1000 + int(micros) // 1000


def effect(what: str) -> None:
    _client().rpush(EFFECTS_KEY, f"{mr.current().run_id}:{what}")


def hold(first_delivery_only: bool = True) -> None:
    """Announce the hold point and block, on the run's first delivery: the test kills the
    process here. Later deliveries go on."""
    run = mr.current()
    if first_delivery_only and run.attempt != 1:
        return
    _client().rpush(HOLDING_KEY, run.run_id)
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
        time.sleep(0.05)


# -- timers ------------------------------------------------------------------------------

@mr.step
def fl_now(label: str) -> int:
    """The server clock when this step ran; its effect once per execution."""
    effect(label)
    return server_ms()


class TimerInput(msgspec.Struct):
    seconds: float


@mr.workflow
def fl_timer(ctx: mr.RunContext, inp: TimerInput) -> dict[str, int]:
    before = fl_now("before")
    mr.sleep(inp.seconds)
    after = fl_now("after")
    return {"before": before, "after": after}


class UntilInput(msgspec.Struct):
    in_ms: int           # the deadline: this far past the server clock when the run starts
    frac_us: int = 500   # and this many microseconds into its millisecond
    tz_hours: int = 0    # expressed in this zone
    naive: bool = False  # without its zone


@mr.step
def fl_deadline_us(in_ms: int, frac_us: int) -> int:
    return (server_ms() + in_ms) * 1000 + frac_us


@mr.workflow
def fl_until(ctx: mr.RunContext, inp: UntilInput) -> dict[str, int]:
    at_us = fl_deadline_us(inp.in_ms, inp.frac_us)  # recorded: the same on every replay
    zone = dt.timezone(dt.timedelta(hours=inp.tz_hours))
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    when = (epoch + dt.timedelta(microseconds=at_us)).astimezone(zone)
    if inp.naive:
        when = when.replace(tzinfo=None)
    mr.sleep_until(when)
    return {"at_us": at_us, "after": fl_now("after")}


@mr.workflow
def fl_quick(ctx: mr.RunContext) -> str:
    fl_now("quick")
    return "quick"


# -- child runs --------------------------------------------------------------------------

class ChildInput(msgspec.Struct):
    v: int = 1
    hold: bool = False   # block in a step after the effect, on the first delivery
    nap_s: float = 0.0   # mr.sleep after the effect
    fail: bool = False


@mr.step
def fl_child_effect(v: int) -> int:
    effect("child-effect")
    return v * 10


@mr.step
def fl_child_hold() -> None:
    hold()


@mr.workflow
def fl_child(ctx: mr.RunContext, inp: ChildInput) -> dict[str, Any]:
    value = fl_child_effect(inp.v)
    if inp.nap_s:
        mr.sleep(inp.nap_s)
    if inp.hold:
        fl_child_hold()
    if inp.fail:
        raise ValueError(f"child {inp.v} broke")
    return {"child": ctx.run_id, "v": value}


class ParentInput(msgspec.Struct):
    child: ChildInput = msgspec.field(default_factory=ChildInput)
    key: str | None = None
    gate: bool = False   # hold after the child is recorded, before waiting on it
    catch: bool = False


@mr.step
def fl_parent_effect() -> None:
    effect("parent-effect")


@mr.workflow
def fl_parent(ctx: mr.RunContext, inp: ParentInput) -> dict[str, Any]:
    child = mr.start_child("fl_child", inp.child, key=inp.key)
    if inp.gate:
        hold()
    try:
        result = child.result()
    except ChildFailedError as exc:
        if not inp.catch:
            raise
        assert exc.error is not None
        return {"caught": exc.child_id, "status": exc.status, "error": exc.error.message}
    fl_parent_effect()
    return {"child_id": child.id, "result": result}


class GatherInput(msgspec.Struct):
    values: list[int]


@mr.workflow
def fl_gather(ctx: mr.RunContext, inp: GatherInput) -> list[Any]:
    handles = [ctx.start_child("fl_child", ChildInput(v=v), key=f"k{i}")
               for i, v in enumerate(inp.values)]
    return mr.gather(*handles)


# -- parallel ----------------------------------------------------------------------------

@mr.step
def fl_slow(tag: str) -> str:
    effect(f"slow-{tag}")
    hold()  # the first delivery blocks here: the test kills it once fl_fast has finished
    return f"slow-{tag}"


@mr.step
def fl_fast(tag: str) -> str:
    effect(f"fast-{tag}")
    return f"fast-{tag}"


@mr.workflow
def fl_par(ctx: mr.RunContext) -> list[str]:
    return mr.parallel(lambda: fl_slow("a"), lambda: fl_fast("b"))


@mr.step
def fl_boom() -> None:
    effect("boom")
    client = _client()
    run_id = mr.current().run_id
    # Fail only once the sibling's first step is running.
    deadline = time.monotonic() + 30
    while not client.sismember(STARTED_KEY, run_id) and time.monotonic() < deadline:
        time.sleep(0.01)
    raise ValueError("branch a broke")


@mr.step
def fl_b1() -> str:
    from marbles_rq.engine.context import branch_cancel

    effect("b1")
    _client().sadd(STARTED_KEY, mr.current().run_id)
    # Finish only once the engine has told this branch its sibling failed (the engine's
    # own signal; without it this step returns after 30 s and the test sees fl_b2 start).
    cancel = branch_cancel.get()
    assert cancel is not None, "fl_b1 runs in a parallel branch"
    cancel.wait(30)
    # Take a moment more: a run that settled its failure without waiting for this branch
    # would do it now, and this step's commit would be refused (the test looks for it).
    time.sleep(0.2)
    return "b1"


@mr.step
def fl_b2() -> str:
    effect("b2")
    return "b2"


@mr.step
def fl_b3() -> str:
    effect("b3")
    return "b3"


@mr.workflow
def fl_par_fail(ctx: mr.RunContext) -> list[Any]:
    def branch_b() -> list[str]:
        return [fl_b1(), fl_b2(), fl_b3()]

    return mr.parallel(fl_boom, branch_b)


class ParkInput(msgspec.Struct):
    how: str  # sleep | question
    nap_s: float = 0.3


@mr.step
def fl_sibling() -> str:
    effect("sibling")
    return "sibling"


@mr.workflow
def fl_par_park(ctx: mr.RunContext, inp: ParkInput) -> list[Any]:
    def waits() -> str:
        if inp.how == "sleep":
            mr.sleep(inp.nap_s)
            return "slept"
        return mr.ask.question("Go on?", choices=["yes", "no"], key="go")

    return mr.parallel(waits, fl_sibling)


@mr.workflow
def fl_child_then_sleep(ctx: mr.RunContext) -> dict[str, Any]:
    """Waits for a child that has already finished (it woke this run while it executed),
    then sleeps."""
    child = mr.start_child("fl_child", ChildInput(v=2))
    if ctx.attempt == 1:
        # Go on only once the finished child has tried to wake this run (a pool worker runs
        # it beside this one): its wake lands while this run executes.
        client, key = _client(), ctx.runs.keys.run(ctx.run_id)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not client.hget(key, "wake_pending"):
            time.sleep(0.02)
    result = child.result()
    mr.sleep(0.5)
    return {"child": result, "after": fl_now("after")}
