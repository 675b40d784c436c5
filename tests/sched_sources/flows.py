"""Workflows the schedule tests fire (tests/test_schedules.py): each run RPUSHes its run id
to ``sx:fired`` when its body runs, so a test counts executions per occurrence."""

from __future__ import annotations

import os
from typing import Any

import redis

import marbles_rq as mr

FIRED = "sx:fired"
_client: list[redis.Redis] = []


def _redis() -> redis.Redis:
    if not _client:
        _client.append(redis.Redis.from_url(os.environ["MARBLES_REDIS_URL"]))
    return _client[0]


@mr.workflow("sx_note")
def sx_note(ctx: mr.RunContext, inp: Any) -> str:
    _redis().rpush(FIRED, ctx.run_id)
    return "noted"
