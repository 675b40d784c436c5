"""Schedule lateness and controller pass time with many interval schedules.

    .venv/bin/python bench/schedules.py [--schedules 1000] [--seconds 30] [--interval 0.05]
                                        [--pool 6] [--passes-seconds 10]

Starts its own redis-server from ops/redis.conf (appendfsync always) in a temporary
directory, then:

1. controller only: a real `marbles-rq controller --interval S` on bench/schedules_flows.py
   (`--schedules` interval schedules of a no-op workflow, every 1 s or 2 s) with
   overlap=allow, so each interval counts from the previous start and the controller fires
   at the full rate whatever the workers do; no worker, runs stay queued;
2. end to end: the same schedules measured from the previous run's completion (the default,
   overlap=skip), with a real `marbles-rq worker --pool N` executing them; the rate is then
   what the workers finish;
3. stops that controller and runs an in-process one (same duties, same interval) for
   `--passes-seconds` with the worker still executing: the wall time of each firing pass and
   how many occurrences it handled.

Lateness of an occurrence = when its run was recorded (queued) minus its nominal time (the
previous run's start or finish + the interval), both in the server's clock, read from the
occurrence and run hashes after each phase.

Nothing asserts; it prints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from marbles_rq.controller import Controller
from marbles_rq.controller.duties import default_duties
from marbles_rq.engine.authoring import load_source
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.triggers.schedules import ScheduleDuty
from tests.procs import Procs
from tests.redis_procs import RedisServer

FLOWS = Path(__file__).resolve().parent / "schedules_flows.py"


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--pool", type=int, default=6)
    parser.add_argument("--passes-seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    os.environ["BENCH_SCHEDULES"] = str(args.schedules)
    with tempfile.TemporaryDirectory(prefix="marbles-bench-sched-") as tmp:
        server = RedisServer.start(dir=Path(tmp) / "redis")
        try:
            run(server.url, Path(tmp), args)
        finally:
            server.stop()


def run(url: str, tmp: Path, args: Any) -> None:
    runs = RunStore(open_store(url))
    client = runs.client
    info = client.info("server")
    print("marbles-rq schedules benchmark")
    print(f"command  : python bench/schedules.py --schedules {args.schedules} --seconds "
          f"{args.seconds:g} --interval {args.interval:g} --pool {args.pool} --passes-seconds "
          f"{args.passes_seconds:g}")
    print(f"redis    : {info['redis_version']}, appendfsync "
          f"{client.config_get('appendfsync')['appendfsync']}, buckets {runs.keys.buckets}; "
          f"{os.cpu_count()} CPUs")
    print("aim      : 1,000 schedules fire with lateness p99 <= 100 ms")
    phase(runs, url, tmp / "a", args, overlap="allow", pool=0, title=(
        "1. controller only: interval from the previous nominal time (overlap=allow), "
        "no worker; runs stay queued"))
    client.flushall()
    procs = phase(runs, url, tmp / "b", args, overlap="skip", pool=args.pool, title=(
        f"2. end to end: interval measured from the previous completion (the default), "
        f"worker --pool {args.pool}"), keep=True)
    try:
        passes(runs, url, args)
    finally:
        procs.stop_all()


def phase(runs: RunStore, url: str, dir: Path, args: Any, *, overlap: str, pool: int,
          title: str, keep: bool = False) -> Procs:
    procs = Procs(url, dir, sources=(FLOWS,))
    procs.env.update(BENCH_SCHEDULES=str(args.schedules), BENCH_OVERLAP=overlap)
    # The processes run this checkout's marbles_rq, whatever the venv has installed.
    procs.env["PYTHONPATH"] = os.pathsep.join(
        [str(FLOWS.parent.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    try:
        if pool:
            procs.worker(pool=pool)
        ctl = procs.controller(interval=args.interval)
        time.sleep(args.seconds)  # the measuring window
        ctl.stop()
        lateness, claim_lag = occurrence_lateness(runs)
        print(f"\n{title}; real controller --interval {args.interval:g}, {args.seconds:g} s")
        print(f"   occurrences fired: {len(lateness):,} ({len(lateness) / args.seconds:,.0f}/s)")
        print(f"   lateness (run recorded - nominal):  p50 {pct(lateness, 50):.0f} ms  "
              f"p99 {pct(lateness, 99):.0f} ms  max {max(lateness):.0f} ms")
        print(f"   claim lag (claimed - nominal):      p50 {pct(claim_lag, 50):.0f} ms  "
              f"p99 {pct(claim_lag, 99):.0f} ms")
    finally:
        if not keep:
            procs.stop_all()
    return procs


def occurrence_lateness(runs: RunStore) -> tuple[list[float], list[float]]:
    """(run recorded - nominal, occurrence claimed - nominal) of every started occurrence."""
    keys: list[str] = []
    for bucket in range(runs.keys.buckets):
        keys += [k.decode() for k in runs.client.scan_iter(
            match=f"{runs.keys.tag(bucket)}:occ:*", count=1000)]
    pipe = runs.client.pipeline(transaction=False)
    for key in keys:
        pipe.hmget(key, "nominal_ms", "claimed_ms", "run_id")
    occurrences = [o for o in pipe.execute() if o[2] is not None]
    pipe = runs.client.pipeline(transaction=False)
    for _, _, run_id in occurrences:
        pipe.hget(runs.keys.run(run_id.decode()), "created_ms")
    late, lag = [], []
    for (nominal, claimed, _), created in zip(occurrences, pipe.execute(), strict=True):
        if created is not None:
            late.append(int(created) - int(nominal))
            lag.append(int(claimed) - int(nominal))
    return late, lag


def passes(runs: RunStore, url: str, args: Any) -> None:
    load_source(str(FLOWS))
    duties = default_duties()
    sched = next(d for d in duties if isinstance(d, ScheduleDuty))
    sched.measure = True
    ctl = Controller(runs, rq_connection(url), interval_s=args.interval, duties=duties)
    thread = threading.Thread(target=ctl.run, daemon=True)
    thread.start()
    time.sleep(args.passes_seconds)  # the measuring window
    ctl.stop_event.set()
    thread.join(timeout=10)
    walls, handled = sched.stats.pass_ms, sched.stats.pass_handled
    late = sched.stats.lateness_ms
    print(f"\n3. in-process controller, {args.schedules} schedules registered, "
          f"{args.passes_seconds:g} s (interval {args.interval:g} for its other work)")
    print(f"   firing passes: {len(walls)}  wall p50 {statistics.median(walls):.1f} ms  "
          f"p99 {pct(walls, 99):.1f} ms  max {max(walls):.1f} ms")
    print(f"   occurrences fired or skipped per firing pass: mean "
          f"{statistics.mean(handled):.1f}  max {max(handled)}")
    idle = [w for w, n in zip(walls, handled, strict=True) if n == 0]
    if idle:
        print(f"   passes that handled no occurrence: {len(idle)}, wall p50 "
              f"{statistics.median(idle):.1f} ms")
    if late:
        print(f"   lateness (fired - nominal; includes the backlog from the takeover): p50 "
              f"{pct(late, 50):.0f} ms  p99 {pct(late, 99):.0f} ms  ({len(late)} fired)")


if __name__ == "__main__":
    main()
