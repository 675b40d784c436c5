"""`chain`: N steps in order. Each sleeps, then does its effect -- appending its idempotency
key to a receipts list in Redis -- idempotently on that key, so a test (or you) can check
that every step's effect happened exactly once, whatever was killed along the way.

    marbles-rq --source examples/chain.py enqueue chain --input '{"steps": 5, "sleep_s": 0.5}'

The pattern: a step runs at least once (a kill after its effect and before its commit runs
it again, with the same `idempotency_key`), and the target applies a key at most once, so
the effect happens exactly once. Here the target is Redis and a tiny script makes "apply
once per key" atomic; with an HTTP API it is the API's idempotency-key header. (Reserving
with `claim_effect` and then acting is at most once: a kill between the two skips it.)
"""

from __future__ import annotations

import os

import msgspec
import redis

import marbles_rq as mr

RECEIPTS_KEY = "chain:receipts"
APPLIED_KEY = "chain:applied"

# The target's own idempotency: remember the key and do the effect in one atomic step.
_APPLY_ONCE = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""


class ChainInput(msgspec.Struct):
    steps: int
    sleep_s: float = 0.0


def _target() -> redis.Redis:
    # The effect's target system; here, a list in the same Redis.
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


# The target can be briefly unreachable (here it is the same Redis, restarted in the kill
# tests): retry the step, the same key each time, rather than fail the run.
@mr.step(retries=4, delay_s=0.5)
def link(index: int, sleep_s: float) -> str:
    import time

    time.sleep(sleep_s)
    key = mr.current().idempotency_key
    applied = _target().eval(_APPLY_ONCE, 2, APPLIED_KEY, RECEIPTS_KEY, key)
    mr.current().stream.write(f"link {index} done" + ("" if applied else " (already applied)"))
    return key


@mr.workflow
def chain(ctx: mr.RunContext, inp: ChainInput) -> dict[str, object]:
    keys = [link(i, inp.sleep_s) for i in range(inp.steps)]
    ctx.log.info("all %d links done", len(keys))
    return {"steps": inp.steps, "keys": keys}
