"""The decorator form: two interval schedules of a workflow declared here."""

from __future__ import annotations

import os

import redis

import marbles_rq as mr


@mr.schedule(every="1s", key="tick", input={"which": "tick"})
@mr.schedule(every="1s", key="tock", input={"which": "tock"})
@mr.workflow("sx_tick")
def sx_tick(ctx: mr.RunContext, inp: dict[str, str]) -> str:
    redis.Redis.from_url(os.environ["MARBLES_REDIS_URL"]).rpush("sx:fired", ctx.run_id)
    return inp["which"]
