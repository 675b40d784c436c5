"""Workflows of bench/retry_park.py: one step that fails its first try, retried after
`wait_ms` (fixed, no jitter), on two queues so that one worker serves each way of waiting."""

from __future__ import annotations

import os

import redis

import marbles_rq as mr

_R: redis.Redis | None = None


def _client() -> redis.Redis:
    global _R
    if _R is None:
        _R = redis.Redis.from_url(os.environ["MARBLES_REDIS_URL"])
    return _R


def _flaky() -> int:
    n = int(_client().hincrby("rp:tries", mr.current().run_id, 1))
    if n == 1:
        raise ConnectionError("first try fails")
    return n


@mr.step(retry=mr.Retry(initial="100ms", backoff=1.0, max_interval="100ms", max_attempts=3,
                        jitter=False))
def rp_step_100() -> int:
    return _flaky()


@mr.workflow(queue="rp_inline")
def rp_inline(ctx: mr.RunContext) -> int:
    return rp_step_100()


@mr.workflow(queue="rp_parked")
def rp_parked(ctx: mr.RunContext) -> int:
    return rp_step_100()


@mr.step
def rp_plain_step() -> int:
    return 1


@mr.workflow(queue="rp_inline")
def rp_plain(ctx: mr.RunContext) -> int:
    return rp_plain_step()
