"""Benchmark (not a test): the delivery path of marbles-rq next to plain RQ, in one run.

Run from the repo root (so ``tests`` and ``bench`` are importable)::

    .venv/bin/python -m bench.transport [--quick] [--sections throughput,anatomy,enqueue]
                                        [--reps 3] [--pool 2]

It starts its own redis-server from the durable ``ops/redis.conf`` (appendonly yes,
appendfsync always) in a temporary directory; every worker is a child process in its own
session, killed (whole tree) on the way out.

Sections (every marbles figure is measured next to plain RQ in the same run, the two
alternated, and printed as a ratio):

1. throughput  N pre-enqueued no-op RQ jobs, or N one-step / ten-step runs, drained by
               workers in --burst mode; time from the first dequeue until all are done (RQ:
               its finished registry holds N; marbles-rq: N runs settled in the store).
               Same worker count and class on both sides: `rq worker -w Worker` vs
               `marbles-rq worker` (forking), `rq worker -w SimpleWorker` vs
               `marbles-rq worker --pool 1`, and P `rq worker -w SimpleWorker` processes vs
               `marbles-rq worker --pool P`.
2. anatomy     Redis cost per job / run, end to end (enqueue one at a time, then a burst
               worker executes and settles them): INFO deltas of a large batch minus a small
               one (so worker start-up and shutdown cancel out), divided by the difference.
               `commands` counts every command the server ran, those inside Lua scripts
               included (INFO commandstats); `client commands` only those clients sent
               (an EVALSHA is one), split by a MONITOR connection; `round trips` is
               total_reads_processed (one per request or pipeline read); `fsyncs` counts
               redis-server's fdatasync calls (strace; with appendfsync always, one per event
               loop turn that wrote: the write round trips).
3. enqueue     ops.enqueue / ops.enqueue_many next to RQ's Queue.enqueue / enqueue_many
               (a pipeline of 500), from one client, no worker running.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import redis
import rq
from rq import Queue
from rq.serializers import JSONSerializer as RQJSONSerializer

from marbles_rq.engine import ops
from marbles_rq.engine.authoring import load_source
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport import dispatch
from tests.redis_procs import DEFAULT_CONF, RedisServer

from .runs_util import (
    REPO_ROOT,
    VENV_BIN,
    Procs,
    children_cpu_s,
    cpu_model,
    load_line,
    median,
    mem_total,
    proc_cpu_s,
    ratio,
    server_stats,
    table,
)

FLOWS = "bench/runs_flows.py"
NOOP = "bench.runs_noop.noop"
MARBLES_QUEUE = "default"
# Plain RQ's no-op jobs go to the RQ queue marbles-rq's deliveries use (prefix mrq).
QUEUE = dispatch.rq_queue_name("mrq", MARBLES_QUEUE)
Q_KEY = Queue.redis_queue_namespace_prefix + QUEUE
FIN_KEY = Q_KEY.replace(":queue:", ":finished:")
FAIL_KEY = Q_KEY.replace(":queue:", ":failed:")
SECTIONS = ("throughput", "anatomy", "enqueue")


@dataclass(frozen=True)
class Sizes:
    one_n: int
    ten_n: int
    fork_n: int
    ten_fork_n: int
    pool_n: int
    small: int
    large: int
    enqueue_n: int


QUICK = Sizes(one_n=300, ten_n=100, fork_n=120, ten_fork_n=60, pool_n=400, small=10, large=60,
              enqueue_n=1000)
FULL = Sizes(one_n=1000, ten_n=300, fork_n=400, ten_fork_n=200, pool_n=1500, small=20,
             large=200, enqueue_n=3000)


class BenchError(RuntimeError):
    pass


def say(text: str = "") -> None:
    print(text, flush=True)


class Bench:
    def __init__(self, sizes: Sizes, reps: int, pool: int, tmp: Path) -> None:
        self.sizes, self.reps, self.pool = sizes, reps, pool
        self.metrics_port: int | None = None
        self.server = RedisServer.start(dir=tmp / "redis", conf=DEFAULT_CONF)
        self.url = self.server.url
        self.r = redis.Redis.from_url(self.url)
        self.rq = dispatch.rq_connection(self.url)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
        env.update(MARBLES_REDIS_URL=self.url, PYTHONUNBUFFERED="1")
        (tmp / "logs").mkdir()
        self.procs = Procs(tmp / "logs", env)
        self.runs = RunStore(open_store(self.url))
        self.summary: list[str] = []

    def reset(self) -> None:
        """An empty Redis, its AOF compacted so no automatic rewrite lands in a measurement."""
        self.r.flushall()
        if int(self.r.info("persistence").get("aof_current_size", 0)) > 16 << 20:
            self.r.bgrewriteaof()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                info = self.r.info("persistence")
                if not int(info["aof_rewrite_in_progress"]) and not int(
                        info["aof_rewrite_scheduled"]):
                    break
                time.sleep(0.05)
        self.runs = RunStore(open_store(self.url))

    # -- command lines --------------------------------------------------------------------

    def rq_worker(self, cls: str) -> list[str]:
        return [str(VENV_BIN / "rq"), "worker", "--burst", "-q", "-u", self.url,
                "-S", "rq.serializers.JSONSerializer", "-w", cls, "-P", str(REPO_ROOT), QUEUE]

    def marbles_worker(self, pool: int | None) -> list[str]:
        return [str(VENV_BIN / "marbles-rq"), "--redis-url", self.url, "--source", FLOWS,
                "worker", "--burst", "--log-level", "WARNING",
                *(["--pool", str(pool)] if pool else []),
                *(["--metrics-port", str(self.metrics_port)] if self.metrics_port else [])]

    # -- filling queues -------------------------------------------------------------------

    def fill_rq(self, n: int) -> None:
        q = Queue(QUEUE, connection=self.r, serializer=RQJSONSerializer)
        for start in range(0, n, 500):
            datas = [Queue.prepare_data(NOOP, timeout=-1) for _ in range(min(500, n - start))]
            with self.r.pipeline() as pipe:
                q.enqueue_many(datas, pipeline=pipe)
                pipe.execute()

    def fill_marbles(self, workflow: str, n: int) -> list[str]:
        ids: list[str] = []
        for start in range(0, n, 500):
            done = ops.enqueue_many(self.runs, self.rq,
                                    [ops.RunRequest(workflow)] * min(500, n - start))
            if not all(e.created and e.dispatched for e in done):
                raise BenchError("enqueue_many did not create and dispatch every run")
            ids += [e.run_id for e in done]
        return ids

    def settled(self) -> int:
        pipe = self.r.pipeline(transaction=False)
        for bucket in range(self.runs.keys.buckets):
            pipe.zcard(self.runs.keys.run_finished(bucket))
        return sum(pipe.execute())

    def statuses(self, ids: list[str]) -> Counter[str]:
        counts: Counter[str] = Counter()
        for start in range(0, len(ids), 1000):
            pipe = self.r.pipeline(transaction=False)
            for rid in ids[start:start + 1000]:
                pipe.hget(self.runs.keys.run(rid), "status")
            counts.update((s or b"missing").decode() for s in pipe.execute())
        return counts


# ------------------------------------------------------------------------------------------
# 1. throughput


@dataclass
class Drain:
    seconds: float
    worker_cpu_s: float  # the workers and their horses, start to exit
    redis_cpu_s: float  # redis-server, first dequeue to all done


def idle_cpu(b: Bench, argvs: list[list[str]]) -> float:
    """CPU seconds of burst workers that find nothing to do (start-up and shutdown)."""
    b.reset()
    cpu0 = children_cpu_s()
    for child in [b.procs.start("idle", argv) for argv in argvs]:
        try:
            child.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            b.procs.kill(child)
    return children_cpu_s() - cpu0


def drain(b: Bench, label: str, argvs: list[list[str]], n: int,
          done: Callable[[], int]) -> Drain:
    """Start the workers on n queued jobs; seconds from the first dequeue to n done, and
    the CPU it took."""
    cpu0 = children_cpu_s()
    children = [b.procs.start(label, argv) for argv in argvs]
    deadline = time.perf_counter() + 60 + n * 0.2
    while b.r.llen(Q_KEY) >= n:
        if any(c.proc.poll() is not None for c in children) or time.perf_counter() > deadline:
            raise BenchError(f"{label}: no dequeue\n{children[0].tail()}")
        time.sleep(0.002)
    t0, rcpu0 = time.perf_counter(), proc_cpu_s(b.server.pid)
    while done() < n:
        if time.perf_counter() > deadline:
            raise BenchError(f"{label}: {done()}/{n} done in time\n{children[0].tail()}")
        if all(c.proc.poll() is not None for c in children) and done() < n:
            raise BenchError(f"{label}: workers exited with {done()}/{n} done\n"
                             f"{children[0].tail()}")
        time.sleep(0.01)
    t1, rcpu1 = time.perf_counter(), proc_cpu_s(b.server.pid)
    for child in children:
        try:
            child.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            b.procs.kill(child)
    return Drain(t1 - t0, children_cpu_s() - cpu0, rcpu1 - rcpu0)


@dataclass
class Cell:
    """One (workers, job kind) measured over the reps: rate, and CPU per job."""

    n: int
    idle_cpu_s: float
    drains: list[Drain] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        return [self.n / d.seconds for d in self.drains]

    @property
    def rate(self) -> float:
        return median(self.rates)

    def cpu_ms(self) -> float:
        """Median (worker - idle start/stop) + redis CPU ms per job."""
        return median([((d.worker_cpu_s - self.idle_cpu_s) + d.redis_cpu_s) / self.n * 1000
                       for d in self.drains])


def rq_cell(b: Bench, cls: str, procs: int, cell: Cell) -> None:
    b.reset()
    b.fill_rq(cell.n)
    cell.drains.append(drain(b, f"rq-{cls.rsplit('.', 1)[1]}", [b.rq_worker(cls)] * procs,
                             cell.n, lambda: int(b.r.zcard(FIN_KEY))))
    failed = b.r.zcard(FAIL_KEY)
    if failed:
        raise BenchError(f"plain RQ: {failed} jobs failed")


def marbles_cell(b: Bench, pool: int | None, workflow: str, cell: Cell) -> None:
    b.reset()
    ids = b.fill_marbles(workflow, cell.n)
    cell.drains.append(drain(b, f"marbles-{workflow}", [b.marbles_worker(pool)], cell.n,
                             b.settled))
    counts = b.statuses(ids)
    if counts != Counter(succeeded=cell.n):
        raise BenchError(f"marbles-rq {workflow}: {dict(counts)}")


def section_throughput(b: Bench) -> None:
    s, p = b.sizes, b.pool
    say("== 1. Throughput: pre-enqueued, --burst workers; first dequeue -> all done "
        f"(median of {b.reps} reps, RQ and marbles-rq alternated)")
    say(f"   plain RQ job: {NOOP}, JSONSerializer, timeout=-1; marbles-rq: one_step / "
        f"ten_steps of {FLOWS}")
    say("   CPU ms per job = (workers and horses, minus an idle burst's start-up and "
        "shutdown) + redis-server, per job; 'vs RQ by CPU' = RQ's CPU per job / this row's: "
        "what the ratio would be if CPU were the only limit (less sensitive to other load)")
    configs: list[tuple[str, str, int, int | None, int, int]] = [
        ("fork", "rq.worker.Worker", 1, None, s.fork_n, s.ten_fork_n),
        ("simple", "rq.worker.SimpleWorker", 1, 1, s.one_n, s.ten_n),
        (f"pool {p}", "rq.worker.SimpleWorker", p, p, s.pool_n, s.ten_n),
    ]
    rows = []
    for name, cls, procs, pool, n, n10 in configs:
        rq_argvs = [b.rq_worker(cls)] * procs
        m_argvs = [b.marbles_worker(pool)]
        rq_idle, m_idle = idle_cpu(b, rq_argvs), idle_cpu(b, m_argvs)
        base, one, ten = Cell(n, rq_idle), Cell(n, m_idle), Cell(n10, m_idle)
        for rep in range(b.reps):
            order = ["rq", "one", "ten"] if rep % 2 == 0 else ["ten", "one", "rq"]
            for what in order:
                if what == "rq":
                    rq_cell(b, cls, procs, base)
                elif what == "one":
                    marbles_cell(b, pool, "one_step", one)
                else:
                    marbles_cell(b, pool, "ten_steps", ten)
        rq_desc = (f"{procs} x rq {cls.rsplit('.', 1)[1]}" if procs > 1 else
                   f"rq {cls.rsplit('.', 1)[1]}")
        m_desc = "marbles-rq worker" + (f" --pool {pool}" if pool else " (fork)")
        for desc, job, cell in ((rq_desc, "no-op", base), (m_desc, "one_step", one),
                                (m_desc, "ten_steps", ten)):
            rows.append([name, desc, job, cell.n, f"{cell.rate:.1f}",
                         " ".join(f"{x:.0f}" for x in cell.rates),
                         "1.00x" if cell is base else ratio(cell.rate, base.rate),
                         f"{cell.cpu_ms():.2f}",
                         "1.00x" if cell is base else ratio(base.cpu_ms(), cell.cpu_ms())])
        say(f"   {name}: RQ {base.rate:.1f}/s; one_step {one.rate:.1f}/s "
            f"({ratio(one.rate, base.rate)}, by CPU {ratio(base.cpu_ms(), one.cpu_ms())}); "
            f"ten_steps {ten.rate:.1f}/s ({ratio(ten.rate, base.rate)})")
        b.summary.append(
            f"  {name:8}: one-step {ratio(one.rate, base.rate)} of RQ ({one.rate:.1f} vs "
            f"{base.rate:.1f}/s; by CPU {ratio(base.cpu_ms(), one.cpu_ms())}), ten-step "
            f"{ratio(ten.rate, base.rate)} ({ten.rate:.1f}/s; by CPU "
            f"{ratio(base.cpu_ms(), ten.cpu_ms())})")
    say()
    say(table(["config", "workers", "job/run", "N", "per s (median)", "each rep", "vs RQ",
               "CPU ms/job", "vs RQ by CPU"], rows))
    say()


# ------------------------------------------------------------------------------------------
# 2. anatomy


class Monitor:
    """Counts the commands clients send (top level) and those scripts run, by name."""

    _LINE = re.compile(r'^\d+\.\d+ \[\d+ ([^\]]+)\] "([^"]+)"')

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url)
        self.top: Counter[str] = Counter()
        self.lua: Counter[str] = Counter()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _run(self) -> None:
        with self.client.monitor() as m:
            self._ready.set()
            conn = m.connection
            assert conn is not None
            while not self._stop.is_set():
                try:
                    line = conn.read_response()
                except (redis.TimeoutError, redis.ConnectionError):
                    return
                text = line.decode(errors="replace") if isinstance(line, bytes) else str(line)
                found = self._LINE.match(text)
                if not found:
                    continue
                where, cmd = found.groups()
                (self.lua if where == "lua" else self.top)[cmd.lower()] += 1

    def stop(self) -> None:
        self._stop.set()
        # One more command, so the reader wakes and sees the stop.
        with contextlib.suppress(redis.RedisError):
            redis.Redis.from_url(self.url).ping()
        self._thread.join(5)
        with contextlib.suppress(redis.RedisError):
            self.client.close()


class FsyncCounter:
    """fdatasync calls of redis-server while it runs (strace -f -c); None if unavailable."""

    def __init__(self, pid: int, out: Path) -> None:
        self.out = out
        self.proc: subprocess.Popen[bytes] | None = None
        strace = shutil.which("strace")
        if strace is None:
            return
        try:
            self.proc = subprocess.Popen([strace, "-f", "-c", "-e", "trace=fdatasync,fsync",
                                          "-o", str(out), "-p", str(pid)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except OSError:
            self.proc = None
            return
        time.sleep(0.5)  # attach to every thread
        if self.proc.poll() is not None:
            self.proc = None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None
        total = 0
        with contextlib.suppress(OSError):
            for line in self.out.read_text().splitlines():
                # % time, seconds, usecs/call, calls, [errors,] syscall
                parts = line.split()
                if len(parts) >= 5 and parts[-1] in ("fdatasync", "fsync"):
                    total += int(parts[3])
        return total


@dataclass
class Cost:
    commands: float
    client_commands: float
    round_trips: float
    fsyncs: float | None
    top: dict[str, float] = field(default_factory=dict)
    lua: dict[str, float] = field(default_factory=dict)


def measure(b: Bench, tmp: Path, n: int, enqueue: Callable[[], None],
            execute: Callable[[], None]) -> tuple[Any, Counter[str], Counter[str], int | None]:
    """Counters over: n enqueues one at a time, then `execute` (a burst worker)."""
    b.reset()
    enqueue()  # connect and load scripts outside the window
    b.reset()
    fsyncs = FsyncCounter(b.server.pid, tmp / f"strace-{time.monotonic_ns()}.txt")
    monitor = Monitor(b.url)
    s0 = server_stats(b.r)
    for _ in range(n):
        enqueue()
    execute()
    s1 = server_stats(b.r)
    monitor.stop()
    synced = fsyncs.stop()
    return s1.minus(s0), monitor.top, monitor.lua, synced


def section_anatomy(b: Bench, tmp: Path) -> None:
    s = b.sizes
    say("== 2. Redis cost per job / run, end to end: enqueue one at a time (Queue.enqueue / "
        "ops.enqueue), then one --burst worker runs them all")
    say(f"   per job = (counters of {s.large}) - (counters of {s.small}), / {s.large - s.small}; "
        "commands include those inside scripts; client commands = sent by clients (an "
        "EVALSHA is one); round trips = total_reads_processed; fsyncs = redis-server "
        "fdatasync calls (strace)")

    def rq_enqueue() -> None:
        Queue(QUEUE, connection=b.r, serializer=RQJSONSerializer).enqueue(NOOP)

    def marbles_enqueue() -> None:
        ops.enqueue(b.runs, b.rq, ops.RunRequest("one_step"))

    def run_worker(argv: list[str]) -> Callable[[], None]:
        def go() -> None:
            child = b.procs.start("anatomy", argv)
            try:
                child.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                b.procs.kill(child)
                raise BenchError(f"anatomy worker hung\n{child.tail()}") from None
        return go

    cases = [
        ("rq SimpleWorker, no-op job", rq_enqueue, b.rq_worker("rq.worker.SimpleWorker")),
        ("marbles --pool 1, one_step run", marbles_enqueue, b.marbles_worker(1)),
        ("rq Worker (fork), no-op job", rq_enqueue, b.rq_worker("rq.worker.Worker")),
        ("marbles worker (fork), one_step run", marbles_enqueue, b.marbles_worker(None)),
    ]
    rows = []
    mixes = []
    for label, enq, argv in cases:
        got = [measure(b, tmp, n, enq, run_worker(argv)) for n in (s.small, s.large)]
        d = s.large - s.small
        (small, top0, lua0, fs0), (large, top1, lua1, fs1) = got
        runs_ok = ("ok" if "marbles" not in label else
                   "ok" if b.settled() == s.large else f"only {b.settled()} settled")
        top = {k: (v - top0.get(k, 0)) / d for k, v in top1.items()}
        lua = {k: (v - lua0.get(k, 0)) / d for k, v in lua1.items()}
        cost = Cost(commands=(sum(large.calls.values()) - sum(small.calls.values())) / d,
                    client_commands=sum(top.values()),
                    round_trips=(large.reads - small.reads) / d,
                    fsyncs=None if fs0 is None or fs1 is None else (fs1 - fs0) / d,
                    top=top, lua=lua)
        rows.append([label, f"{cost.commands:.1f}", f"{cost.client_commands:.1f}",
                     f"{sum(lua.values()):.1f}", f"{cost.round_trips:.1f}",
                     "n/a" if cost.fsyncs is None else f"{cost.fsyncs:.1f}", runs_ok])
        mixes.append((label, cost))
        b.summary.append(f"  {label}: {cost.commands:.1f} commands ({cost.client_commands:.1f} "
                         f"from clients), {cost.round_trips:.1f} round trips, "
                         f"{'n/a' if cost.fsyncs is None else f'{cost.fsyncs:.1f}'} fsyncs")
    say(table(["per job / run", "commands", "client commands", "in scripts", "round trips",
               "fsyncs", "check"], rows))
    say("  client commands by name (>= 0.05 per job):")
    for label, cost in mixes:
        mix = sorted(cost.top.items(), key=lambda kv: -kv[1])
        say(f"    {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in mix if v >= 0.05))
    say("  commands inside scripts (>= 0.05 per run):")
    for label, cost in mixes:
        if cost.lua:
            mix = sorted(cost.lua.items(), key=lambda kv: -kv[1])
            say(f"    {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in mix if v >= 0.05))
    say()


# ------------------------------------------------------------------------------------------
# 3. enqueue


def section_enqueue(b: Bench) -> None:
    n, reps = b.sizes.enqueue_n, max(3, b.reps)
    say(f"== 3. Enqueue/s from one client, {n} per measurement, no worker, median of {reps} "
        "passes (order rotated each pass)")
    req = ops.RunRequest("one_step")

    def rq_single() -> None:
        q = Queue(QUEUE, connection=b.r, serializer=RQJSONSerializer)
        for _ in range(n):
            q.enqueue(NOOP)

    def rq_many() -> None:
        q = Queue(QUEUE, connection=b.r, serializer=RQJSONSerializer)
        for start in range(0, n, 500):
            datas = [Queue.prepare_data(NOOP) for _ in range(min(500, n - start))]
            with b.r.pipeline() as pipe:
                q.enqueue_many(datas, pipeline=pipe)
                pipe.execute()

    def m_single() -> None:
        for _ in range(n):
            ops.enqueue(b.runs, b.rq, req)

    def m_many() -> None:
        for start in range(0, n, 500):
            ops.enqueue_many(b.runs, b.rq, [req] * min(500, n - start))

    methods: list[tuple[str, Callable[[], None]]] = [
        ("RQ Queue.enqueue", rq_single), ("marbles ops.enqueue", m_single),
        ("RQ Queue.enqueue_many (pipeline of 500)", rq_many),
        ("marbles ops.enqueue_many (chunks of 500)", m_many)]
    rates: dict[str, list[float]] = {name: [] for name, _ in methods}
    cpus: dict[str, list[float]] = {name: [] for name, _ in methods}  # us per enqueue
    for rep in range(reps):
        order = methods[rep % len(methods):] + methods[:rep % len(methods)]
        for name, fn in order:
            b.reset()
            fn_cpu0, rcpu0 = time.process_time(), proc_cpu_s(b.server.pid)
            t0 = time.perf_counter()
            fn()
            rates[name].append(n / (time.perf_counter() - t0))
            cpus[name].append((time.process_time() - fn_cpu0
                               + proc_cpu_s(b.server.pid) - rcpu0) / n * 1e6)
    rows = []
    for i, (name, _) in enumerate(methods):
        base = methods[i - i % 2][0]
        rows.append([name, f"{median(rates[name]):.0f}",
                     " ".join(f"{x:.0f}" for x in rates[name]),
                     "1.00x" if i % 2 == 0 else ratio(median(rates[name]), median(rates[base])),
                     f"{median(cpus[name]):.0f}",
                     "1.00x" if i % 2 == 0 else ratio(median(cpus[base]), median(cpus[name]))])
    say(table(["method", "per s (median)", "each pass", "vs RQ", "CPU us each (client + "
               "redis)", "vs RQ by CPU"], rows))
    single, single_rq = "marbles ops.enqueue", "RQ Queue.enqueue"
    many, many_rq = ("marbles ops.enqueue_many (chunks of 500)",
                     "RQ Queue.enqueue_many (pipeline of 500)")
    b.summary.append(
        f"  enqueue: single {ratio(median(rates[single]), median(rates[single_rq]))} of RQ "
        f"(by CPU {ratio(median(cpus[single_rq]), median(cpus[single]))}), batch "
        f"{ratio(median(rates[many]), median(rates[many_rq]))} of RQ (by CPU "
        f"{ratio(median(cpus[many_rq]), median(cpus[many]))})")
    say()


# ------------------------------------------------------------------------------------------


def git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "marbles_rq", "lua"],
                               cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    return f"commit {head or '?'}" + (" + uncommitted engine changes" if dirty else "")


def header(b: Bench) -> None:
    cfg = {}
    for key in ("appendonly", "appendfsync"):
        value = next(iter(b.r.config_get(key).values()), "?")
        cfg[key] = value.decode() if isinstance(value, bytes) else str(value)
    say("marbles-rq transport benchmark")
    say(f"command: {shlex.join([sys.executable, '-m', 'bench.transport', *sys.argv[1:]])}")
    say(f"machine: {os.cpu_count()} CPUs ({cpu_model()}), {mem_total()} RAM, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}")
    say(f"host load at start: {load_line()}")
    say(f"redis-server {b.r.info('server')['redis_version']}, "
        + ", ".join(f"{k} {v}" for k, v in cfg.items()))
    say(f"rq {rq.__version__}, redis-py {redis.__version__}, msgspec {msgspec.__version__}, "
        f"marbles-rq {importlib.metadata.version('marbles-rq')} at {git_state()}")
    say()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pool", type=int, default=2)
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="Start every marbles-rq worker with this --metrics-port (what "
                             "metrics cost a worker; nothing scrapes it).")
    args = parser.parse_args(argv)
    wanted = [x.strip() for x in args.sections.split(",") if x.strip()]
    if set(wanted) - set(SECTIONS):
        parser.error(f"sections are {','.join(SECTIONS)}")
    os.chdir(REPO_ROOT)
    load_source(FLOWS)

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    tmp = Path(tempfile.mkdtemp(prefix="marbles-bench-transport-"))
    b: Bench | None = None
    code = 0
    started = time.monotonic()
    try:
        b = Bench(QUICK if args.quick else FULL, args.reps, args.pool, tmp)
        b.metrics_port = args.metrics_port
        header(b)
        for name in SECTIONS:
            if name in wanted:
                t0 = time.monotonic()
                if name == "anatomy":
                    section_anatomy(b, tmp)
                else:
                    globals()[f"section_{name}"](b)
                say(f"   ({name}: {time.monotonic() - t0:.0f} s; {load_line()})")
                say()
        say("SUMMARY")
        say("\n".join(b.summary))
    except BenchError as exc:
        say(f"BENCHMARK FAILED: {exc}")
        code = 1
    finally:
        if b is not None:
            strays = b.procs.cleanup()
            b.server.stop()
            say(f"stray processes left: {strays or 'none'}")
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        say(f"total {time.monotonic() - started:.0f} s; host load at end: {load_line()}")
    return code


if __name__ == "__main__":
    sys.exit(main())
