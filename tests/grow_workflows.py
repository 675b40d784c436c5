"""Workflows used only by tests/test_buckets.py (loaded by workers and controllers with
--source): runs in every state, a schedule, an event trigger and a file monitor, so that a
bucket growth has every key family to move. ``G_DIR`` is the test's directory.

* `g_ok`: a step that claims an effect; `g_fail`: a step, then raises.
* `g_ask`: a step, then the question ``go``; returns the answer.
* `g_sleep`: a step, a durable timer of ``seconds``, a step.
* `g_parent`: two `g_ask` children (keys ``c0``, ``c1``); returns their answers.
* `g_hold`: a step that claims the effect ``hold``, then waits until ``<G_DIR>/release``
  exists; returns whether its claim was the first (False after a redelivery: the receipt
  was kept).
* `g_tick`: scheduled every hour; `g_on_event`: started by every event of source ``gh``.
* Monitor ``g-files``: ``*.txt`` under ``<G_DIR>/mon``; each change launches `g_ok`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import marbles_rq as mr

DIR = Path(os.environ.get("G_DIR", "/nonexistent"))


@mr.step
def g_step(value: Any) -> Any:
    return value


@mr.step
def g_effect(key: str) -> bool:
    return mr.current().claim_effect(key)


@mr.workflow(version="1")  # test_buckets enqueues it from a stub of that version
def g_ok(ctx: mr.RunContext, inp: Any = None) -> dict[str, Any]:
    return {"echo": g_step(inp), "first": g_effect("ok")}


@mr.workflow
def g_fail(ctx: mr.RunContext) -> None:
    g_step("before")
    raise RuntimeError("g_fail fails on purpose")


@mr.workflow
def g_ask(ctx: mr.RunContext) -> Any:
    g_step("asking")
    return ctx.ask.question("Go?", key="go")


@mr.workflow
def g_sleep(ctx: mr.RunContext, seconds: float) -> str:
    g_step("before")
    mr.sleep(seconds)
    return str(g_step("after"))


@mr.workflow
def g_parent(ctx: mr.RunContext) -> list[Any]:
    children = [mr.start_child("g_ask", None, key=f"c{i}") for i in range(2)]
    return mr.gather(*children)


@mr.step
def g_block() -> bool:
    first = mr.current().claim_effect("hold")
    while not (DIR / "release").exists():
        time.sleep(0.05)
    return first


@mr.workflow
def g_hold(ctx: mr.RunContext) -> bool:
    return bool(g_block())


@mr.schedule(every="1h")
@mr.workflow
def g_tick(ctx: mr.RunContext) -> str:
    return str(g_step("tick"))


@mr.on_event("gh")
@mr.workflow
def g_on_event(ctx: mr.RunContext, event: mr.Event) -> str:
    return str(g_step(event.id))


if os.environ.get("G_DIR"):
    @mr.monitor("*.txt", root=DIR / "mon", interval_s=0.3, key="g-files")
    def g_files(change: mr.FileChange) -> mr.Launch | None:
        return mr.Launch("g_ok", {"added": sorted(change.added)})
