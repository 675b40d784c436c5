"""Workflows used only by tests/test_lanes.py (loaded by workers with --source).

`ln_steps` runs `steps` steps; each sleeps `sleep_s`, claims its effect in the store (its
idempotency key) and writes ``{"key", "attempt", "won"}`` to the run's output, so a test
reads from the store alone (no side channel that needs a standalone Redis) which delivery
won each effect: exactly one per step, whatever was killed or failed over meanwhile."""

from __future__ import annotations

import os
import time

import msgspec

import marbles_rq as mr


class StepsInput(msgspec.Struct):
    steps: int = 1
    sleep_s: float = 0.0


@mr.step
def ln_step(index: int, sleep_s: float) -> int:
    run = mr.current()
    run.stream.write({"sleeping": index, "attempt": run.attempt, "pid": os.getpid()})
    time.sleep(sleep_s)
    won = run.claim_effect(run.idempotency_key)
    run.stream.write({"key": run.idempotency_key, "attempt": run.attempt, "won": won})
    return index


@mr.workflow(max_deliveries=20)
def ln_steps(ctx: mr.RunContext, inp: StepsInput) -> int:
    return sum(ln_step(i, inp.sleep_s) for i in range(inp.steps))
