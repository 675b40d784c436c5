"""Workflows used only by tests/test_sessions.py (loaded by workers with --source).

A gated step waits until the test pushes a token to ``sw:gate:<run id>``, so the test decides
when it ends (and can kill -9 the worker while it waits). Every step counts its executions
in ``sw:exec:<run id>`` (a replayed step returns its recorded result without running).

* `sw_chat`: opens its own session, appends {"from": "body"} in the body, then a step
  appends {"from": "step"} and waits at the gate, then opens the session named in its input
  (a child of its own) and appends {"from": "child"}; returns the positions.
* `sw_chat_async`: the same in an async body (appends awaited), without the gate.
* `sw_join` / `sw_join_long`: open the session named in the input and append
  {"run": <run id>}; their runs are kept 0 s / an hour after they finish.
"""

from __future__ import annotations

import os
from typing import Any

import redis

import marbles_rq as mr

EXEC_PREFIX = "sw:exec:"
GATE_PREFIX = "sw:gate:"
GATE_TIMEOUT_S = 60


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


def _count(name: str) -> None:
    _client().hincrby(EXEC_PREFIX + mr.current().run_id, name, 1)


@mr.step
def sw_append_and_gate() -> int:
    _count("gate")
    position: int = mr.session().append({"from": "step"})
    run_id = mr.current().run_id
    client = _client()
    for _ in range(GATE_TIMEOUT_S):  # short blocking reads: sockets time out after seconds
        if client.blpop([GATE_PREFIX + run_id], timeout=1) is not None:
            return position
    raise TimeoutError("the test never opened the gate")


@mr.workflow
def sw_chat(ctx: mr.RunContext, child: str) -> dict[str, Any]:
    own = mr.session()
    first = own.append({"from": "body"})
    second = sw_append_and_gate()
    other = mr.session(child)
    third = other.append({"from": "child"})
    return {"own": own.id, "child": other.id, "parent": other.parent,
            "positions": [first, second, third]}


@mr.workflow
async def sw_chat_async(ctx: mr.AsyncRunContext, child: str) -> dict[str, Any]:
    own = mr.session()
    first = await own.append({"from": "async body"})
    other = mr.session(child)
    second = await other.append({"from": "async child"})
    messages = await own.read()
    return {"own": own.id, "positions": [first, second],
            "read": [m.data for m in messages]}


@mr.workflow(retention_s=0)
def sw_join(ctx: mr.RunContext, session: str) -> int:
    position: int = mr.session(session).append({"run": ctx.run_id})
    return position


@mr.workflow(retention_s=3600)
def sw_join_long(ctx: mr.RunContext, session: str) -> int:
    position: int = mr.session(session).append({"run": ctx.run_id})
    return position
