"""`chain`: N steps in order. Each sleeps, claims an effect under its idempotency key, and
appends that key to a receipts list in Redis -- so a test (or you) can check that every
step's effect happened exactly once, whatever was killed along the way.

    marbles-rq --source examples/chain.py enqueue chain --input '{"steps": 5, "sleep_s": 0.5}'
"""

from __future__ import annotations

import os

import msgspec
import redis

import marbles_rq as mr

RECEIPTS_KEY = "chain:receipts"


class ChainInput(msgspec.Struct):
    steps: int
    sleep_s: float = 0.0


def _receipts() -> redis.Redis:
    # The effect's target system; here, a list in the same Redis.
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


@mr.step
def link(index: int, sleep_s: float) -> str:
    import time

    time.sleep(sleep_s)
    run = mr.current()
    key = run.idempotency_key
    if run.claim_effect(key):  # first time ever for this key: do the effect
        _receipts().rpush(RECEIPTS_KEY, key)
    run.stream.write(f"link {index} done")
    return key


@mr.workflow
def chain(ctx: mr.RunContext, inp: ChainInput) -> dict[str, object]:
    keys = [link(i, inp.sleep_s) for i in range(inp.steps)]
    ctx.log.info("all %d links done", len(keys))
    return {"steps": inp.steps, "keys": keys}
