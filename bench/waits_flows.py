"""Workflows for bench/waits.py, loaded by its workers and controller with ``--source`` (and
by the driver, so ``ops.prepare`` knows them).

* ``bench_wait_ask``    one step, then a question (two choices); returns the answer;
* ``bench_wait_sleep``  ``mr.sleep_until`` the input's ``due_ms`` (server clock), then done;
* ``bench_wait_noop``   nothing: the probe that shows the workers are free;
* ``bench_wait_child``  one step: a child of the fan-out;
* ``bench_wait_fanout`` starts N children (``mr.start_child``) and ``mr.gather``s them;
* ``bench_wait_parallel`` ``mr.parallel`` over N one-step branches;
* ``bench_wait_seq``    the same N steps one after another, for comparison.
"""

from __future__ import annotations

import datetime as dt

import msgspec

import marbles_rq as mr


@mr.step
def tick(i: int) -> int:
    return i


@mr.workflow("bench_wait_ask")
def bench_wait_ask(ctx: mr.RunContext) -> str:
    tick(0)
    return ctx.ask.question("Go on?", choices=["yes", "no"])


class SleepInput(msgspec.Struct):
    due_ms: int


@mr.workflow("bench_wait_sleep")
def bench_wait_sleep(ctx: mr.RunContext, inp: SleepInput) -> int:
    mr.sleep_until(dt.datetime.fromtimestamp(inp.due_ms / 1000, tz=dt.UTC))
    return 0


@mr.workflow("bench_wait_noop")
def bench_wait_noop(ctx: mr.RunContext) -> int:
    return 0


@mr.workflow("bench_wait_child")
def bench_wait_child(ctx: mr.RunContext, inp: int) -> int:
    return tick(inp)


class FanInput(msgspec.Struct):
    n: int = 100


@mr.workflow("bench_wait_fanout")
def bench_wait_fanout(ctx: mr.RunContext, inp: FanInput) -> int:
    children = [mr.start_child("bench_wait_child", i, key=f"k{i}") for i in range(inp.n)]
    return sum(mr.gather(*children))


@mr.workflow("bench_wait_parallel")
def bench_wait_parallel(ctx: mr.RunContext, inp: FanInput) -> int:
    return sum(mr.parallel(*[lambda i=i: tick(i) for i in range(inp.n)]))


@mr.workflow("bench_wait_seq")
def bench_wait_seq(ctx: mr.RunContext, inp: FanInput) -> int:
    return sum(tick(i) for i in range(inp.n))
