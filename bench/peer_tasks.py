"""Dramatiq actors and Huey tasks of bench/concurrency.py, run from bench/.peers (the peers'
own venv: ``dramatiq[redis] huey redis hiredis httpx``; the project's venv has neither
library). Both connect to ``BENCH_REDIS_URL``.

Consumers, from the repo root::

    bench/.peers/bin/dramatiq -p 1 -t 8 bench.peer_tasks
    bench/.peers/bin/huey_consumer -q -k thread -w 8 bench.peer_tasks.huey

The bench fills their queues through bench/peer_fill.py.
"""

from __future__ import annotations

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from huey import RedisHuey

from bench import peer_jobs

URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUE = "bench"

broker = RedisBroker(url=URL)
dramatiq.set_broker(broker)


# No retries: a failure goes to the dead-letter set at once, where the bench looks for it.
@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def d_noop() -> None:
    peer_jobs.noop()


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def d_io(url: str) -> None:
    peer_jobs.io_three(url)


huey = RedisHuey(QUEUE, url=URL)


@huey.task()
def h_noop() -> int:
    return peer_jobs.noop()


@huey.task()
def h_io(url: str) -> int:
    return peer_jobs.io_three(url)
