"""Workflows used only by tests/test_web*.py (loaded by the worker, controller and web).

* `web_ticker`: one step writes ``tick <n>`` to the run's output every 0.2 s until the test
  pushes to ``web:gate:<run id>`` (so a test sees the output grow live, then lets it end).
* `web_ask`: asks a question (title and body from the input: a test puts markup in them)
  and writes the same text to its output; returns the answer.
* `web_approve`: asks for an approval ``ship``; returns it.
* `web_noop`: returns its input; `web_hourly` fires every hour (a schedule to pause).
* `web_on_push`: triggered by events of source ``github`` (the webhook tests).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import redis

import marbles_rq as mr

GATE_PREFIX = "web:gate:"
GATE_TIMEOUT_S = 120


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


@mr.step
def web_tick_until_gate() -> int:
    run = mr.current()
    client = _client()
    n = 0
    while n < GATE_TIMEOUT_S * 5:
        run.stream.write(f"tick {n}")
        n += 1
        if client.blpop([GATE_PREFIX + run.run_id], timeout=0.2) is not None:
            return n
    raise TimeoutError("nobody opened the gate")


@mr.workflow
def web_ticker(ctx: mr.RunContext) -> dict[str, int]:
    return {"ticks": web_tick_until_gate()}


class AskInput(msgspec.Struct):
    title: str = "Which colour?"
    body: str | None = None
    choices: list[str] | None = None


@mr.workflow
def web_ask(ctx: mr.RunContext, inp: AskInput) -> dict[str, Any]:
    ctx.stream.write(f"asking: {inp.title}")
    answer = ctx.ask.question(inp.title, body=inp.body, choices=inp.choices, key="q")
    ctx.stream.write(f"got: {answer}")
    return {"answer": answer}


@mr.workflow
def web_approve(ctx: mr.RunContext) -> dict[str, Any]:
    return {"decision": ctx.ask.approval("Ship 1.4?", body="all checks green", key="ship")}


@mr.schedule(every="1h", key="web-hourly")
@mr.workflow
def web_hourly(ctx: mr.RunContext) -> str:
    return "tick"


@mr.workflow
def web_noop(ctx: mr.RunContext, inp: Any) -> Any:
    return inp


@mr.on_event("github")
@mr.workflow
def web_on_push(ctx: mr.RunContext, event: mr.Event) -> str:
    return f"{event.type} {event.id}"
