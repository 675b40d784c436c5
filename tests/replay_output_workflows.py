"""Workflows used by tests/test_replay_output.py (loaded by workers with --source, and
imported by the test itself for the runs it executes in-process).

Every body writes output before it waits, fails or is killed, so a replay would write those
lines again unless a write is recorded at its position. `ro_block` RPUSHes
``{pid, delivery}`` to ``ro:blocked`` and then blocks in its first delivery (until the test
kills its process); later deliveries go through.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import redis

import marbles_rq as mr

BLOCKED_KEY = "ro:blocked"
CRASH_ONCE: list[str] = []  # in-process: run ids whose next ro_crash execution "dies"
TRIES: Counter[str] = Counter()  # in-process: tries of ro_flaky per run


class Crash(BaseException):
    """Stands in for the process dying mid-run: nothing is settled (in-process tests)."""


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


@mr.step
def ro_ask_in_step() -> str:
    run = mr.current()
    run.stream.write("in the step, before its question")
    return run.ask.question("second?", key="q1")


@mr.workflow
def ro_asks(ctx: mr.RunContext) -> list[str]:
    """Three questions (one inside a step): answered, the run is woken three times."""
    ctx.stream.write("first line")
    ctx.log.info("a log line before any wait")
    answers = [ctx.ask.question("first?", key="q0")]
    ctx.stream.write("after the first answer")
    answers.append(ro_ask_in_step())
    ctx.stream.write("after the second answer")
    answers.append(ctx.ask.question("third?", key="q2"))
    ctx.stream.write("after the third answer")
    return answers


@mr.step
def ro_block() -> str:
    run = mr.current()
    run.stream.write("inside the step")
    _client().rpush(BLOCKED_KEY, json.dumps({"pid": os.getpid(), "delivery": run.attempt}))
    if run.attempt == 1:
        while True:  # until the test kills this process
            time.sleep(0.05)
    return "done"


@mr.workflow
def ro_kill(ctx: mr.RunContext) -> str:
    ctx.stream.write("before the step")
    got = ro_block()
    ctx.stream.write("after the step")
    return got


@mr.step
def ro_noop() -> str:
    return "ok"


@mr.workflow
def ro_crash(ctx: mr.RunContext) -> str:
    ctx.stream.write("written before the crash")
    if ctx.run_id in CRASH_ONCE:
        CRASH_ONCE.remove(ctx.run_id)
        raise Crash  # after the write, before the next commit
    got = ro_noop()
    ctx.stream.write("written after the step")
    return got


@mr.step(retries=2, delay_s=0.01, jitter=False)
def ro_flaky() -> int:
    run = mr.current()
    TRIES[run.run_id] += 1
    run.stream.write(f"try {TRIES[run.run_id]} begins")
    if TRIES[run.run_id] < 3:
        raise ConnectionError("not yet")
    return TRIES[run.run_id]


@mr.workflow
def ro_retry(ctx: mr.RunContext) -> int:
    return ro_flaky()


@mr.workflow
def ro_parallel(ctx: mr.RunContext) -> list[str]:
    def branch(name: str) -> str:
        mr.current().stream.write(f"branch {name}")
        return name

    got = ctx.parallel(lambda: branch("a"), lambda: branch("b"))
    ctx.sleep(0)  # a wait: the body replays, the branches with it
    return got
