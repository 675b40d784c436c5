"""Workflows used only by tests/test_artifacts.py (loaded by workers with --source).

Steps count their executions (HINCRBY field <name> of ``aw:exec:<run id>``). A gated step
waits until the test pushes a token to ``aw:gate:<run id>``.

* `aw_cas`: one step that reads the shared artifact's latest version, waits until every
  writer of the round has read it too (``aw:barrier``: all of them then race with the same
  expected version), and puts its own content with expect_version=latest, retrying on
  ArtifactConflict; returns the version it wrote.
* `aw_kill`: a step puts an artifact, says so (``aw:put:<run id>``), waits at its gate (the
  test kills the worker there), returns the version; then the body itself puts a second
  artifact and returns both versions.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

import marbles_rq as mr

EXEC_PREFIX = "aw:exec:"
GATE_PREFIX = "aw:gate:"
PUT_PREFIX = "aw:put:"
BARRIER = "aw:barrier"
GATE_TIMEOUT_S = 60

SHARED = mr.artifact("aw-shared", media_type="text/plain")
DECLARED_ONLY = mr.artifact("aw-declared", media_type="application/json")


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


def _count(name: str) -> None:
    _client().hincrby(EXEC_PREFIX + mr.current().run_id, name, 1)


@mr.step
def aw_cas_put(writer: str, writers: int) -> dict[str, Any]:
    _count("cas")
    client = _client()
    conflicts = 0
    first = True
    while True:
        latest = SHARED.latest()
        if first:  # every writer has read the same latest before any of them puts
            first = False
            client.incr(BARRIER)
            deadline = time.monotonic() + GATE_TIMEOUT_S
            while int(client.get(BARRIER) or 0) < writers:
                if time.monotonic() > deadline:
                    raise TimeoutError("the other writers never came")
                time.sleep(0.01)
        try:
            version = SHARED.put(f"written by {writer}\n", expect_version=latest,
                                 meta={"writer": writer})
            return {"version": version, "conflicts": conflicts}
        except mr.ArtifactConflict:
            conflicts += 1


@mr.workflow
def aw_cas(ctx: mr.RunContext, input: dict[str, Any]) -> dict[str, Any]:
    return aw_cas_put(input["writer"], input["writers"])


@mr.step
def aw_kill_put() -> int:
    _count("put")
    run_id = mr.current().run_id
    version = mr.artifact(f"aw-kill-{run_id}").put(b"\x00\x01 step content " + run_id.encode(),
                                                 media_type="application/octet-stream")
    client = _client()
    client.rpush(PUT_PREFIX + run_id, str(version))
    for _ in range(GATE_TIMEOUT_S):
        if client.blpop([GATE_PREFIX + run_id], timeout=1) is not None:
            return int(version)
    raise TimeoutError("the test never opened the gate")


@mr.workflow
def aw_kill(ctx: mr.RunContext) -> dict[str, int]:
    first = aw_kill_put()
    body = mr.artifact(f"aw-body-{ctx.run_id}").put("body content",
                                                             meta={"from": "body"})
    return {"step": first, "body": body}
