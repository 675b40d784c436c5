"""Workflows for bench/locks.py (loaded by its workers with --source, and by the driver):
one trivial step without a lock and inside one, and a critical section that stamps its
entry and exit (server clock) on a Redis list, for the hand-over time."""

from __future__ import annotations

import os
import time

import redis

import marbles_rq as mr

STAMPS = "bench:lock:stamps"


@mr.step
def tick(i: int) -> int:
    return i


@mr.step
def stamped(i: int) -> int:
    client = redis.Redis.from_url(os.environ["MARBLES_REDIS_URL"])
    client.rpush(STAMPS, f"enter {mr.current().run_id} {time.time():.6f}")
    client.rpush(STAMPS, f"exit {mr.current().run_id} {time.time():.6f}")
    return i


@mr.workflow(max_deliveries=1000)
def lb_plain(ctx: mr.RunContext) -> int:
    return tick(0)


@mr.workflow(max_deliveries=1000)
def lb_locked(ctx: mr.RunContext) -> int:
    with mr.lock("bench", lease_s=30):
        return tick(0)


@mr.workflow(max_deliveries=1000)
def lb_contend(ctx: mr.RunContext) -> int:
    with mr.lock("bench-contend", lease_s=30):
        return stamped(0)
