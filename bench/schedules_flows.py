"""The source bench/schedules.py runs: a no-op workflow and SCHEDULES interval schedules of it
(every 1 s for even n, 2 s for odd n), keyed by their input; BENCH_OVERLAP=allow measures
the interval from the previous start instead of waiting for the previous run to finish."""

from __future__ import annotations

import os
from typing import Any

import marbles_rq as mr

COUNT = int(os.environ.get("BENCH_SCHEDULES", "1000"))
OVERLAP = os.environ.get("BENCH_OVERLAP", "skip")


@mr.workflow("bench_sched_noop", retention_s=600)
def bench_sched_noop(ctx: mr.RunContext, inp: Any) -> int:
    return 0


for n in range(COUNT):
    mr.schedule(every="1s" if n % 2 == 0 else "2s", workflow="bench_sched_noop",
                input={"n": n}, overlap=OVERLAP)
