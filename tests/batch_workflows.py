"""Workflows triggered by batches of events, used by tests/test_event_batches.py (loaded by
workers and controllers with --source).

* `b_orders`: source ``bshop``, batches of at most 100 events, sealed 3 s after the first.
* `b_keyed`: source ``bkey``, batches of 3 per value of the payload's ``customer`` field,
  sealed 10 s after the first (a test's few sends land well within it).
* `b_regions`: source ``bregion``, one batch per upper-cased ``region`` (a key function),
  sealed 10 s after the first.
* `b_timed`: source ``btime``, at most 1,000 events, sealed 1 s after the first.
* `b_full`: source ``bfull``, batches of 100 sealed an hour after the first (by size, then).
* `b_slow`: source ``bslow``, batches of 3 sealed an hour after the first.

Each run's one step RPUSHes ``{run, ids}`` to ``b:marker`` (the provider ids of its events,
in the order of its input).
"""

from __future__ import annotations

import json
import os

import redis

import marbles_rq as mr

MARKER_KEY = "b:marker"


def _client() -> redis.Redis:
    # On a cluster deployment the markers go to a plain Redis of the test's.
    return redis.Redis.from_url(os.environ.get("MARBLES_TEST_EFFECTS_URL")
                                or os.environ.get("MARBLES_REDIS_URL",
                                                  "redis://127.0.0.1:6379/0"))


@mr.step
def b_mark(ids: list[str]) -> int:
    _client().rpush(MARKER_KEY, json.dumps({"run": mr.current().run_id, "ids": ids}))
    return len(ids)


def _mark(events: list[mr.Event]) -> int:
    return int(b_mark([e.id for e in events]))


@mr.on_event("bshop", batch=mr.Batch(max_size=100, max_wait="3s"))
@mr.workflow
def b_orders(ctx: mr.RunContext, events: list[mr.Event]) -> int:
    return _mark(events)


@mr.on_event("bkey", batch=mr.Batch(max_size=3, max_wait="10s", key="customer"))
@mr.workflow
def b_keyed(ctx: mr.RunContext, events: list[mr.Event]) -> int:
    return _mark(events)


def region_of(event: mr.Event) -> str:
    return str(event.payload["region"]).upper()


@mr.on_event("bregion", batch=mr.Batch(max_size=50, max_wait="10s", key=region_of))
@mr.workflow
def b_regions(ctx: mr.RunContext, events: list[mr.Event]) -> int:
    return _mark(events)


@mr.on_event("btime", batch=mr.Batch(max_size=1000, max_wait="1s"))
@mr.workflow
def b_timed(ctx: mr.RunContext, events: list[mr.Event]) -> int:
    return _mark(events)


@mr.on_event("bfull", batch=mr.Batch(max_size=100, max_wait="1h"))
@mr.workflow
def b_full(ctx: mr.RunContext, events: list[mr.Event]) -> int:
    return _mark(events)


@mr.on_event("bslow", batch=mr.Batch(max_size=3, max_wait="1h"))
@mr.workflow
def b_slow(ctx: mr.RunContext, events: list[mr.Event]) -> int:
    return _mark(events)
