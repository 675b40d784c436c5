"""Controller pass cost with many queued runs, and memory per run before and after retention.

    .venv/bin/python bench/controller.py [--queued 100000] [--runs 500] [--passes 20]

Starts its own redis-server from ops/redis.conf (appendfsync always) in a temporary directory,
then:

1. records and enqueues `--queued` runs (ops.enqueue_many, as `marbles-rq enqueue --batch`
   would), makes every dispatch check due, and times the passes that check them (each pass
   checks at most the dispatch budget);
2. times `--passes` more passes with all of them still queued and nothing due: the steady
   state of a deployment with a long queue. "Redis time" is the server's own time for the
   pass's commands (INFO commandstats usec), the figure the aim is stated in (< 50 ms);
3. executes `--runs` one-step runs in this process (record, start, step, output, effect,
   settle), reports Redis memory per settled run, then lets the controller prune them
   (retention 0) and reports what is left per run.

Nothing asserts; it prints.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

import marbles_rq as mr
from marbles_rq.controller import Controller
from marbles_rq.engine import ops
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.execute import execute
from marbles_rq.engine.ops import RunRequest
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from tests.redis_procs import RedisServer


@mr.workflow("bench_noop")
def bench_noop(ctx: mr.RunContext) -> int:
    return 0


@mr.workflow("bench_one_step", retention_s=0)
def bench_one_step(ctx: mr.RunContext) -> int:
    ctx.stream.write("working")
    ctx.claim_effect()
    return int(ctx.step(lambda: 1))


def server_usec(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("commandstats")
    return (sum(int(v["usec"]) for k, v in stats.items() if k.startswith("cmdstat_")),
            sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_")))


def timed_pass(ctl: Controller, client: redis.Redis) -> tuple[float, float, int]:
    """(wall ms, Redis ms, commands) of one controller pass."""
    client.config_resetstat()
    start = time.perf_counter()
    ctl.pass_once()
    wall = (time.perf_counter() - start) * 1000
    usec, calls = server_usec(client)
    # INFO itself is counted once; negligible.
    return wall, usec / 1000, calls


def summary(rows: list[tuple[float, float, int]]) -> str:
    wall = [r[0] for r in rows]
    server = [r[1] for r in rows]
    calls = [r[2] for r in rows]
    return (f"wall p50 {statistics.median(wall):7.1f} ms  max {max(wall):7.1f} ms | "
            f"Redis p50 {statistics.median(server):6.2f} ms  max {max(server):6.2f} ms | "
            f"commands p50 {int(statistics.median(calls)):>6}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--schedules", type=int, default=1_000)
    parser.add_argument("--recover", type=lambda v: [int(x) for x in v.split(",")],
                        default=[10_000, 100_000], help="pending entries to recover")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="marbles-bench-ctl-") as tmp:
        server = RedisServer.start(dir=Path(tmp) / "redis")
        try:
            run(server.url, args)
        finally:
            server.stop()


def run(url: str, args: Any) -> None:
    runs = RunStore(open_store(url))
    rq = rq_connection(url)
    client = runs.client
    info = client.info("server")
    print("marbles-rq controller benchmark")
    print(f"command  : python bench/controller.py --queued {args.queued} --runs {args.runs} "
          f"--passes {args.passes} --schedules {args.schedules} "
          f"--recover {','.join(map(str, args.recover))}")
    print(f"redis    : {info['redis_version']}, {url}; appendfsync "
          f"{client.config_get('appendfsync')['appendfsync']}, buckets {runs.keys.buckets}")

    # 1. many queued runs, all checks due
    start = time.perf_counter()
    batch = 5_000
    for i in range(0, args.queued, batch):
        ops.enqueue_many(runs, rq, [RunRequest("bench_noop", b"null", f"q{j}")
                                    for j in range(i, min(args.queued, i + batch))])
    took = time.perf_counter() - start
    queue_key = f"rq:queue:{runs.keys.prefix}.default"
    print(f"\nrecorded and enqueued {args.queued:,} runs in {took:.1f} s "
          f"({args.queued / took:,.0f}/s); RQ queue length {rq.llen(queue_key):,}")
    pipe = client.pipeline(transaction=False)
    for j in range(args.queued):
        pipe.zadd(runs.keys.run_dispatch(runs.keys.bucket_of(f"q{j}")), {f"q{j}": 0})
        if len(pipe) >= 5_000:
            pipe.execute()
    pipe.execute()
    ctl = Controller(runs, rq)
    assert ctl.lead()
    checking: list[tuple[float, float, int]] = []
    while sum(client.zcard(runs.keys.run_dispatch(b)) for b in range(runs.keys.buckets)):
        checking.append(timed_pass(ctl, client))
    print(f"\nfirst checks (each queued run's dispatch check comes due once, after the "
          f"enqueuer's grace; budget {ctl.dispatching.budget} per pass)")
    print(f"  {len(checking)} passes  {summary(checking)}")

    # 2. steady state: everything queued, nothing due
    steady = [timed_pass(ctl, client) for _ in range(args.passes)]
    print(f"\nsteady state: {args.queued:,} runs queued, nothing due, {args.passes} passes")
    print(f"  {summary(steady)}")
    print(f"  aim: a pass costs Redis < 50 ms with 100,000 queued runs: "
          f"{'met' if max(r[1] for r in steady) < 50 else 'NOT MET'}")

    # 2b. the same, with 1,000 schedules registered (hourly: none due in the window)
    from marbles_rq.triggers.schedules import OccurrenceDuty, ScheduleDuty, ScheduleRegistry

    registry = ScheduleRegistry()
    for i in range(args.schedules):
        mr.schedule(every="1h", workflow="bench_noop", key=f"hourly-{i}", registry=registry)
    sched = ScheduleDuty(registry, threaded=False)
    assert ctl.lease is not None
    ctl.store.release_lease(ctl.lease)
    ctl = Controller(runs, rq, duties=[OccurrenceDuty(sched), sched])
    assert ctl.lead()
    ctl.recover()  # registers the schedules
    with_schedules = [timed_pass(ctl, client) for _ in range(args.passes)]
    print(f"\nsteady state with {args.schedules:,} schedules registered (none due) and "
          f"{args.queued:,} runs queued, {args.passes} passes")
    print(f"  {summary(with_schedules)}")

    # 2c. every duty a `marbles-rq controller` keeps, unthreaded (the waiting runs' and the
    # schedules' threads make the same reads each time they look): the idle pass of a lane
    from marbles_rq.controller.rollups import RollupsDuty
    from marbles_rq.controller.waiting import WaitingDuty
    from marbles_rq.triggers.events import EventsDuty
    from marbles_rq.triggers.monitors import MonitorsDuty

    assert ctl.lease is not None
    ctl.store.release_lease(ctl.lease)
    sched = ScheduleDuty(registry, threaded=False)
    ctl = Controller(runs, rq, duties=[OccurrenceDuty(sched), sched, EventsDuty(),
                                       WaitingDuty(threaded=False), MonitorsDuty(),
                                       RollupsDuty()])
    assert ctl.lead()
    ctl.recover()
    ctl.pass_once()  # the first look reads every bucket once (and the first rollup)
    every_duty = []
    for _ in range(args.passes):
        time.sleep(1.0)  # the events duty looks every second, pruning every 5 s
        every_duty.append(timed_pass(ctl, client))
    watch = getattr(ctl, "watch", None)  # (absent from a controller before the watch)
    how = "through keyspace notifications" if watch and watch.watching else "every pass"
    print(f"\nidle pass of a lane with every duty (events, waits, schedules, monitors, "
          f"rollups; {runs.keys.buckets} buckets), {args.passes} passes 1 s apart; due "
          f"indexes read {how}")
    print(f"  {summary(every_duty)}  (commands max {max(r[2] for r in every_duty)})")

    # 3. startup recovery: recorded runs whose delivery never reached RQ
    for count in args.recover:
        client.flushall()
        runs = RunStore(open_store(url))
        records = [ops.prepare(RunRequest("bench_noop", b"null", f"r{j}"))
                   for j in range(count)]
        for i in range(0, count, 5_000):
            runs.record_many(records[i:i + 5_000])
        pipe = client.pipeline(transaction=False)
        for j in range(count):
            pipe.zadd(runs.keys.run_dispatch(runs.keys.bucket_of(f"r{j}")), {f"r{j}": 0})
            if len(pipe) >= 5_000:
                pipe.execute()
        pipe.execute()
        ctl = Controller(runs, rq_connection(url))  # the data was flushed: a fresh lease
        assert ctl.lead()
        start = time.perf_counter()
        ctl.recover()
        took = time.perf_counter() - start
        print(f"\nrecovery: {count:,} recorded runs never enqueued -> dispatched "
              f"{ctl.stats.dispatched:,} in {took:.2f} s ({count / took:,.0f}/s; aim for "
              f"100,000: <= 10 s)")

    # 4. memory per settled run, then after retention
    client.flushall()
    runs = RunStore(open_store(url))
    ctl = Controller(runs, rq_connection(url))
    assert ctl.lead()
    # One run first, pruned: loads the scripts and sizes the indexes, so the baseline holds
    # what every deployment has and the figures below are what runs add.
    runs.record(ops.prepare(RunRequest("bench_one_step", b"null", "warm-up")))
    execute(runs, REGISTRY, "warm-up", 1, worker="bench", lease_ms=60_000, hard_exit=False)
    ctl.prune(budget=10)
    time.sleep(0.5)
    base = client.info("memory")
    base_keys = client.dbsize()
    base_bytes = keys_bytes(client)
    for i in range(args.runs):
        run_id = f"m{i}"
        runs.record(ops.prepare(RunRequest("bench_one_step", b"null", run_id)))
        execute(runs, REGISTRY, run_id, 1, worker="bench", lease_ms=60_000, hard_exit=False)
    used = client.info("memory")
    used_bytes = keys_bytes(client)
    mine = re.compile(rb"[:]m\d+(:|$)")
    sample = [k for k in client.scan_iter(count=1000) if re.search(rb"[:]m1(:|$)", k)]
    print(f"\nmemory: {args.runs} settled one-step runs (output, ledger, effect receipt)")
    print(f"  per run before retention: used_memory {delta(used, base, 'used_memory', args):,.0f}"
          f" bytes, of it dataset {delta(used, base, 'used_memory_dataset', args):,.0f} bytes; "
          f"{(client.dbsize() - base_keys) / args.runs:.1f} keys holding "
          f"{(used_bytes - base_bytes) / args.runs:,.0f} bytes (MEMORY USAGE)")
    for key in sorted(sample):
        print(f"    {key.decode():40} MEMORY USAGE {client.memory_usage(key)} bytes")
    pruned = 0
    while True:
        n = ctl.prune(budget=1_000)
        if not n:
            break
        pruned += n
    time.sleep(1.0)  # let serverCron shrink the emptied hash tables
    after = client.info("memory")
    after_bytes = keys_bytes(client)
    left = [k for k in client.scan_iter(count=1000) if mine.search(k)]
    print(f"  pruned {pruned} runs; keys of a run left: {len(left)}; keys in the database: "
          f"{client.dbsize()} (before the runs: {base_keys}); their MEMORY USAGE per run "
          f"{(after_bytes - base_bytes) / args.runs:,.0f} bytes")
    print(f"  per run after retention: used_memory {delta(after, base, 'used_memory', args):,.0f}"
          f" bytes, dataset {delta(after, base, 'used_memory_dataset', args):,.0f} bytes "
          f"(used_memory includes allocator and buffer noise; the dataset is the keys)")


def keys_bytes(client: redis.Redis) -> int:
    return sum(int(client.memory_usage(k) or 0) for k in client.scan_iter(count=1000))


def delta(now: dict[str, Any], base: dict[str, Any], field: str, args: Any) -> float:
    return (int(now[field]) - int(base[field])) / args.runs


if __name__ == "__main__":
    main()
