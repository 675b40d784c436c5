"""Workflows and triggers used only by tests/test_events.py (loaded by workers and
controllers with --source).

* `t_on_push`: triggered by source ``gh`` type ``push``; its one step RPUSHes
  ``{run, key, id, payload}`` to ``t:marker`` (a test counts how often each event's effect ran).
* `t_on_any`: triggered by every other ``gh`` event.
"""

from __future__ import annotations

import json
import os
import time

import redis

import marbles_rq as mr

MARKER_KEY = "t:marker"
LAUNCHED_KEY = "t:launched"
HANDLER_KEY = "t:handler"


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


@mr.step
def t_mark(event: dict[str, object]) -> str:
    run = mr.current()
    _client().rpush(MARKER_KEY, json.dumps({"run": run.run_id, **event}))
    return run.run_id


@mr.on_event("gh", type="push")
@mr.workflow
def t_on_push(ctx: mr.RunContext, event: mr.Event) -> str:
    time.sleep(float(os.environ.get("T_RUN_SLEEP", "0")))
    return str(t_mark({"key": event.key, "id": event.id, "type": event.type,
                       "payload": event.payload}))


@mr.on_event("gh")
@mr.workflow
def t_on_any(ctx: mr.RunContext, event: mr.Event) -> str:
    return str(t_mark({"key": event.key, "id": event.id, "type": event.type,
                       "payload": event.payload}))
