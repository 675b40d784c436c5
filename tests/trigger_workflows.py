"""Workflows, triggers and monitors used only by tests/test_events.py and
tests/test_monitors.py (loaded by workers and controllers with --source).

* `t_on_push`: triggered by source ``gh`` type ``push``; its one step RPUSHes
  ``{run, key, id, payload}`` to ``t:marker`` (a test counts how often each event's effect ran).
* `t_on_any`: triggered by every other ``gh`` event.
* `t_launched`: the target of the monitors; one step RPUSHes ``{run, input}`` to ``t:launched``.
* Monitors are declared only when their environment is set: ``T_MON_ROOT`` (a file glob
  ``*.txt`` whose handler raises while ``<root>/FAIL`` exists and launches `t_launched`, or
  ``T_MON_TARGET`` when set), ``T_MON_URL`` (an HTTP monitor of that URL, allowed hosts
  ``T_MON_ALLOW``). Every handler call RPUSHes what it saw to ``t:handler``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

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


@mr.step
def t_launch_mark(inp: object) -> str:
    run = mr.current()
    _client().rpush(LAUNCHED_KEY, json.dumps({"run": run.run_id, "input": inp}))
    return run.run_id


@mr.workflow
def t_launched(ctx: mr.RunContext, inp: dict[str, object]) -> str:
    return str(t_launch_mark(inp))


if os.environ.get("T_MON_ROOT"):
    _root = Path(os.environ["T_MON_ROOT"])

    @mr.monitor("*.txt", root=_root, interval_s=float(os.environ.get("T_MON_INTERVAL", "0.3")),
                key="t-files")
    def t_files(change: mr.FileChange) -> mr.Launch | None:
        _client().rpush(HANDLER_KEY, json.dumps({"added": sorted(change.added),
                                                 "modified": sorted(change.modified),
                                                 "removed": sorted(change.removed)}))
        if (_root / "FAIL").exists():
            raise RuntimeError("the handler fails while FAIL exists")
        return mr.Launch(os.environ.get("T_MON_TARGET", "t_launched"),
                         {"added": sorted(change.added), "modified": sorted(change.modified)})

if os.environ.get("T_MON_URL"):
    @mr.monitor(os.environ["T_MON_URL"], allow_hosts=os.environ["T_MON_ALLOW"].split(","),
                interval_s=float(os.environ.get("T_MON_INTERVAL", "0.3")), timeout_s=2,
                key="t-http")
    def t_http(change: mr.HttpChange) -> mr.Launch | None:
        _client().rpush(HANDLER_KEY, json.dumps({"status": change.status,
                                                 "previous": change.previous,
                                                 "current": change.current}))
        return None
