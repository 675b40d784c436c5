"""Workflows for bench/runs.py, loaded by the workers with ``--source bench/runs_flows.py``
(and by the driver, so ``ops.prepare`` knows them).

* ``one_step``   one trivial step;
* ``ten_steps``  ten trivial steps, same shape;
* ``latency``    N trivial steps, timing each step call and each start_step / commit_step
  script call inside the body (perf_counter); returns the samples as its result;
* ``sleeper``    a long run for the kill -9 measurements: steps that each sleep a little,
  until cancelled (many deliveries allowed).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

import marbles_rq as mr


@mr.step
def tick(i: int) -> int:
    return i


@mr.workflow(max_deliveries=1000)
def one_step(ctx: mr.RunContext) -> int:
    return tick(0)


@mr.workflow(max_deliveries=1000)
def ten_steps(ctx: mr.RunContext) -> int:
    total = 0
    for i in range(10):
        total += tick(i)
    return total


class LatencyInput(msgspec.Struct):
    steps: int = 1000


class _TimedRuns:
    """Wraps the body's RunStore: times start_step and commit_step (the script calls)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.start_us: list[int] = []
        self.commit_us: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def start_step(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self._inner.start_step(*args, **kwargs)
        self.start_us.append(round((time.perf_counter() - t0) * 1e6))
        return out

    def commit_step(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self._inner.commit_step(*args, **kwargs)
        self.commit_us.append(round((time.perf_counter() - t0) * 1e6))
        return out


@mr.workflow(max_deliveries=1000)
def latency(ctx: mr.RunContext, inp: LatencyInput) -> dict[str, list[int]]:
    timed = _TimedRuns(ctx.runs)
    ctx.runs = timed  # type: ignore[assignment]
    step_us: list[int] = []
    for i in range(inp.steps):
        t0 = time.perf_counter()
        tick(i)
        step_us.append(round((time.perf_counter() - t0) * 1e6))
    ctx.runs = timed._inner
    return {"step_us": step_us, "start_us": timed.start_us, "commit_us": timed.commit_us}


@mr.step
def nap(i: int, seconds: float) -> int:
    time.sleep(seconds)
    return i


class SleeperInput(msgspec.Struct):
    steps: int = 100_000
    nap_s: float = 0.25


@mr.workflow(max_deliveries=1000)
def sleeper(ctx: mr.RunContext, inp: SleeperInput) -> int:
    for i in range(inp.steps):
        nap(i, inp.nap_s)
    return inp.steps
