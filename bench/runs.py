"""Benchmark (not a test): marbles-rq runs next to plain RQ jobs, measured in one run.

Run from the repo root (so ``tests`` and ``bench`` are importable)::

    .venv/bin/python -m bench.runs [--quick] [--sections throughput,latency,...]

It starts its own redis-server from the durable ``ops/redis.conf`` (appendonly yes,
appendfsync always) in a temporary directory, and every worker and controller as a child
process in its own session; all of them are killed (whole process trees) on the way out.

Sections:

1. throughput  Pre-enqueue N no-op RQ jobs or N one-step runs, start ONE worker in --burst
               mode, time from its first dequeue (queue length drops below N) until RQ's
               finished registry holds N jobs, or N runs are settled in the store (a
               marbles-rq delivery leaves nothing in RQ's registries once it completed);
               then check every job finished / every run succeeded.
               Same worker class on both sides: rq SimpleWorker vs `marbles-rq worker
               --pool 1`, rq Worker (fork) vs `marbles-rq worker`. Also ten-step runs.
2. latency     One run of N trivial steps on a `--pool 1` worker; the body times every step
               call and every start_step / commit_step script call (perf_counter).
3. enqueue     ops.enqueue / ops.enqueue_many next to RQ Queue.enqueue / enqueue_many
               (pipeline), and the two halves of ops.enqueue on their own.
4. redelivery  A controller (--interval 0.5, the default) and two forking workers; kill -9
               the worker running a long run and time (server ms, from output-stream ids)
               until the run's next attempt_started; also kill -9 of the horse only.
5. anatomy     Where the time goes: Redis round trips and commands per job/run (INFO stats
               and commandstats deltas between a small and a large burst, so worker start-up
               cancels out), and the engine's own cost per run executed in-process (no RQ).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
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
from marbles_rq.engine.authoring import REGISTRY, load_source
from marbles_rq.engine.execute import execute
from marbles_rq.engine.runs import OutputEvent, RunStore
from marbles_rq.store import open_store
from marbles_rq.transport import dispatch
from tests.redis_procs import DEFAULT_CONF, RedisServer

from .runs_util import (
    REPO_ROOT,
    VENV_BIN,
    Child,
    Procs,
    ServerStats,
    alive,
    children_cpu_s,
    cpu_model,
    descendants,
    load_line,
    median,
    mem_total,
    pct,
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
Q_KEY, FIN_KEY, FAIL_KEY = f"rq:queue:{QUEUE}", f"rq:finished:{QUEUE}", f"rq:failed:{QUEUE}"
CONTROLLER_INTERVAL_S = 0.5  # the CLI default


@dataclass(frozen=True)
class Sizes:
    simple_n: int
    fork_n: int
    ten_simple_n: int
    ten_fork_n: int
    reps_one: int
    reps_ten: int
    latency_steps: int
    enqueue_n: int
    enqueue_reps: int
    rt_small: int
    rt_large: int
    inproc_one: int
    inproc_ten: int
    kills_short: int
    horse_kills: int
    kills_default: int


QUICK = Sizes(simple_n=150, fork_n=80, ten_simple_n=60, ten_fork_n=40, reps_one=2, reps_ten=1,
              latency_steps=1000, enqueue_n=500, enqueue_reps=2, rt_small=10, rt_large=40,
              inproc_one=100, inproc_ten=30, kills_short=8, horse_kills=10, kills_default=0)
FULL = Sizes(simple_n=1000, fork_n=500, ten_simple_n=300, ten_fork_n=200, reps_one=2, reps_ten=1,
             latency_steps=2000, enqueue_n=2000, enqueue_reps=3, rt_small=20, rt_large=120,
             inproc_one=500, inproc_ten=100, kills_short=20, horse_kills=12, kills_default=3)
SECTIONS = ("throughput", "latency", "enqueue", "redelivery", "anatomy")


class BenchError(RuntimeError):
    pass


def say(text: str = "") -> None:
    print(text, flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


# ------------------------------------------------------------------------------------------
# the environment


class Bench:
    def __init__(self, sizes: Sizes, tmp: Path) -> None:
        self.sizes = sizes
        self.tmp = tmp
        self.server = RedisServer.start(dir=tmp / "redis", conf=DEFAULT_CONF)
        self.url = self.server.url
        self.r = redis.Redis.from_url(self.url)
        self.rq = dispatch.rq_connection(self.url)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
        env.update(MARBLES_REDIS_URL=self.url, PYTHONUNBUFFERED="1")
        (tmp / "logs").mkdir()
        self.procs = Procs(tmp / "logs", env)
        self.host = socket.gethostname()
        self.runs = RunStore(open_store(self.url))
        self.manual_rewrites = 0
        self.summary: list[str] = []

    def reset(self) -> None:
        """An empty Redis (and a fresh store handle); the AOF is compacted if it grew large,
        so no automatic rewrite lands inside a measurement."""
        self.r.flushall()
        info = self.r.info("persistence")
        if int(info.get("aof_current_size", 0)) > 32 << 20:
            self.r.bgrewriteaof()
            self.manual_rewrites += 1
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                info = self.r.info("persistence")
                if not int(info["aof_rewrite_in_progress"]) and not int(
                        info["aof_rewrite_scheduled"]):
                    break
                time.sleep(0.05)
        self.runs = RunStore(open_store(self.url))

    def server_ms(self) -> int:
        secs, micros = self.r.time()
        return int(secs) * 1000 + int(micros) // 1000

    # -- worker command lines ------------------------------------------------------------

    def rq_worker(self, cls: str, burst: bool = True) -> list[str]:
        return [str(VENV_BIN / "rq"), "worker", *(["--burst"] if burst else []), "-q",
                "-u", self.url, "-S", "rq.serializers.JSONSerializer", "-w", cls,
                "-P", str(REPO_ROOT), QUEUE]

    def marbles(self, *args: str) -> list[str]:
        return [str(VENV_BIN / "marbles-rq"), "--redis-url", self.url, "--source", FLOWS, *args]

    def marbles_worker(self, *, pool: bool, burst: bool = True,
                       lease_ms: int | None = None) -> list[str]:
        args = ["worker", *(["--burst"] if burst else []), "--log-level", "WARNING"]
        if pool:
            args += ["--pool", "1"]
        if lease_ms is not None:
            args += ["--lease-ms", str(lease_ms)]
        return self.marbles(*args)

    # -- filling queues --------------------------------------------------------------------

    def fill_rq(self, n: int) -> None:
        """n no-op jobs, JSON serializer, the job options marbles-rq's deliveries use."""
        q = Queue(QUEUE, connection=self.r, serializer=RQJSONSerializer)
        for start in range(0, n, 1000):
            datas = [Queue.prepare_data(NOOP, timeout=-1, result_ttl=dispatch.RESULT_TTL_S,
                                        failure_ttl=dispatch.FAILURE_TTL_S)
                     for _ in range(min(1000, n - start))]
            with self.r.pipeline() as pipe:
                q.enqueue_many(datas, pipeline=pipe)
                pipe.execute()
        if self.r.llen(Q_KEY) != n:
            raise BenchError(f"expected {n} queued RQ jobs, found {self.r.llen(Q_KEY)}")

    def fill_marbles(self, name: str, n: int, input: bytes = b"null") -> list[str]:
        ids: list[str] = []
        request = ops.RunRequest(name, input)
        for start in range(0, n, 500):
            done = ops.enqueue_many(self.runs, self.rq, [request] * min(500, n - start))
            if not all(e.created and e.dispatched for e in done):
                raise BenchError("enqueue_many did not create and dispatch every run")
            ids += [e.run_id for e in done]
        return ids

    def statuses(self, ids: list[str]) -> Counter[str]:
        counts: Counter[str] = Counter()
        for start in range(0, len(ids), 1000):
            pipe = self.r.pipeline(transaction=False)
            for rid in ids[start:start + 1000]:
                pipe.hget(self.runs.keys.run(rid), "status")
            counts.update((s or b"missing").decode() for s in pipe.execute())
        return counts

    def run_count(self) -> int:
        pipe = self.r.pipeline(transaction=False)
        for bucket in range(self.runs.keys.buckets):
            pipe.zcard(self.runs.keys.listing("run", bucket))
        return sum(pipe.execute())


# ------------------------------------------------------------------------------------------
# 1. throughput


@dataclass
class Drain:
    n: int
    seconds: float
    worker_cpu_s: float
    redis_cpu_s: float
    finished: int
    failed: int
    exit_code: int | None
    check: str = ""

    @property
    def rate(self) -> float:
        return self.n / self.seconds


def done_counts(b: Bench) -> tuple[int, int]:
    """(finished, failed): RQ's finished registry plus the runs settled in the store (a
    marbles-rq delivery leaves no trace in RQ's registries once it completed), and RQ's
    failed registry."""
    pipe = b.r.pipeline(transaction=False)
    pipe.zcard(FIN_KEY)
    pipe.zcard(FAIL_KEY)
    for bucket in range(b.runs.keys.buckets):
        pipe.zcard(b.runs.keys.run_finished(bucket))
    finished, failed, *settled = pipe.execute()
    return finished + sum(settled), failed


def drain(b: Bench, name: str, argv: list[str], n: int) -> Drain:
    """Start one burst worker on n queued jobs; first dequeue -> n finished."""
    cpu0 = children_cpu_s()
    launched = time.perf_counter()
    child = b.procs.start(name, argv)
    deadline = launched + 60 + n * 0.5
    while b.r.llen(Q_KEY) >= n:
        if child.proc.poll() is not None or time.perf_counter() > deadline:
            raise BenchError(f"{name}: no dequeue (exit {child.proc.poll()})\n{child.tail()}")
        time.sleep(0.002)
    t0, rcpu0 = time.perf_counter(), proc_cpu_s(b.server.pid)
    finished = failed = 0
    while time.perf_counter() < deadline:
        finished, failed = done_counts(b)
        if finished + failed >= n or child.proc.poll() is not None:
            break
        time.sleep(0.005)
    t1, rcpu1 = time.perf_counter(), proc_cpu_s(b.server.pid)
    try:
        code: int | None = child.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        b.procs.kill(child)
        code = None
    finished, failed = done_counts(b)
    if code != 0:
        say(f"    ! {name} exited with {code}:\n{child.tail()}")
    return Drain(n, t1 - t0, children_cpu_s() - cpu0, rcpu1 - rcpu0, finished, failed, code)


def idle_cpu(b: Bench, name: str, argv: list[str]) -> float:
    """CPU seconds of a burst worker that finds nothing to do (start-up + shutdown)."""
    b.reset()
    cpu0 = children_cpu_s()
    child = b.procs.start(name + "-idle", argv)
    try:
        child.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        b.procs.kill(child)
    return children_cpu_s() - cpu0


@dataclass
class Cell:
    config: str
    system: str
    job: str
    n: int
    drains: list[Drain] = field(default_factory=list)
    idle_cpu_s: float = 0.0

    @property
    def rate(self) -> float:
        return median([d.rate for d in self.drains])

    def worker_cpu_ms(self) -> float:
        return median([(d.worker_cpu_s - self.idle_cpu_s) / d.n * 1000 for d in self.drains])

    def redis_cpu_ms(self) -> float:
        return median([d.redis_cpu_s / d.n * 1000 for d in self.drains])


def set_p50(b: Bench, n: int = 200) -> float:
    """The median time of one fsync'd write right now: how slow this host's disk is."""
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        b.r.set("bench:probe", "v")
        samples.append(time.perf_counter() - t0)
    b.r.delete("bench:probe")
    return pct(samples, 50)


def run_cell(b: Bench, cell: Cell, argv: list[str], workflow: str | None) -> None:
    b.reset()
    if workflow is None:
        b.fill_rq(cell.n)
    else:
        ids = b.fill_marbles(workflow, cell.n)
    probe = set_p50(b)
    d = drain(b, f"{cell.system}-{cell.job}".replace(" ", "_"), argv, cell.n)
    if workflow is None:
        d.check = ("ok" if d.finished == cell.n and d.failed == 0 else
                   f"FINISHED {d.finished} FAILED {d.failed}")
    else:
        counts = b.statuses(ids)
        d.check = "ok" if counts == Counter(succeeded=cell.n) else f"RUNS {dict(counts)}"
        if d.finished != cell.n or d.failed:
            d.check += f"; rq finished {d.finished} failed {d.failed}"
    cell.drains.append(d)
    say(f"    {cell.config:12} {cell.system:28} {cell.job:9} N={cell.n:<5} "
        f"{d.seconds:6.2f} s  {d.rate:7.1f}/s  check: {d.check}  (SET p50 just before: "
        f"{probe * 1000:.2f} ms)")


def section_throughput(b: Bench) -> dict[str, float]:
    s = b.sizes
    say("== 1. Throughput: one worker process, --burst, pre-enqueued; first dequeue -> all done")
    say(f"   plain RQ job: {NOOP} (no-op), rq.serializers.JSONSerializer, timeout=-1, "
        f"result_ttl={dispatch.RESULT_TTL_S} (the options of a marbles-rq delivery)")
    say(f"   marbles-rq: `one_step` (1 trivial step) and `ten_steps` from {FLOWS}; "
        f"lease 10000 ms (default); marbles-rq's msgspec JSON serializer")
    say(f"   rq worker command:      {shlex.join(b.rq_worker('rq.worker.SimpleWorker'))}")
    say(f"   marbles worker command: {shlex.join(b.marbles_worker(pool=True))}")
    say("   worker CPU = user+sys of the worker and its horses minus an idle burst "
        "(start-up/shutdown); redis CPU = redis-server user+sys during the window")
    configs = [
        ("non-forking", "rq.worker.SimpleWorker", "rq SimpleWorker",
         b.marbles_worker(pool=True), "marbles-rq worker --pool 1", s.simple_n,
         s.ten_simple_n),
        ("forking", "rq.worker.Worker", "rq Worker (fork)", b.marbles_worker(pool=False),
         "marbles-rq worker (fork)", s.fork_n, s.ten_fork_n),
    ]
    cells: dict[tuple[str, str], Cell] = {}
    idle: dict[str, float] = {}
    for config, rq_cls, rq_name, m_argv, m_name, n, _ in configs:
        idle[rq_name] = idle_cpu(b, "rq", b.rq_worker(rq_cls))
        idle[m_name] = idle_cpu(b, "marbles", m_argv)
        cells[(config, "rq")] = Cell(config, rq_name, "no-op", n, idle_cpu_s=idle[rq_name])
        cells[(config, "one")] = Cell(config, m_name, "one_step", n, idle_cpu_s=idle[m_name])
    for config, _, _, _, m_name, _, n10 in configs:
        cells[(config, "ten")] = Cell(config, m_name, "ten_steps", n10, idle_cpu_s=idle[m_name])
    say("   idle burst CPU (subtracted): " + ", ".join(f"{k} {v:.2f} s" for k, v in idle.items()))
    for rep in range(max(s.reps_one, s.reps_ten)):
        say(f"  rep {rep + 1}")
        for config, rq_cls, _, m_argv, _, _, _ in configs:
            if rep < s.reps_one:
                order = [("rq", None), ("one", "one_step")]
                for key, wf in (order if rep % 2 == 0 else order[::-1]):
                    argv = b.rq_worker(rq_cls) if wf is None else m_argv
                    run_cell(b, cells[(config, key)], argv, wf)
            if rep < s.reps_ten:
                run_cell(b, cells[(config, "ten")], m_argv, "ten_steps")
    rows = []
    out: dict[str, float] = {}
    for config, *_ in configs:
        base = cells[(config, "rq")]
        for key in ("rq", "one", "ten"):
            c = cells[(config, key)]
            per_ms = 1000 / c.rate
            cpu, base_cpu = (c.worker_cpu_ms() + c.redis_cpu_ms(),
                             base.worker_cpu_ms() + base.redis_cpu_ms())
            rows.append([f"{config}: {c.system}", c.job, c.n, f"{c.rate:.1f}",
                         " ".join(f"{d.rate:.0f}" for d in c.drains), f"{per_ms:.2f}",
                         f"{c.worker_cpu_ms():.2f}", f"{c.redis_cpu_ms():.2f}",
                         "1.00x" if key == "rq" else ratio(c.rate, base.rate),
                         "1.00x" if key == "rq" else ratio(base_cpu, cpu),
                         "ok" if all(d.check == "ok" for d in c.drains) else "FAILED"])
            out[f"{config}:{key}"] = c.rate
    say()
    say(table(["worker", "job/run", "N", "per s (median)", "each rep", "ms each",
               "worker CPU ms", "redis CPU ms", "vs RQ", "vs RQ by CPU", "all done"], rows))
    say("  (vs RQ = rate ratio; vs RQ by CPU = RQ's (worker+redis) CPU per job / this row's: "
        "what the ratio would be if CPU were the only limit, less sensitive to other load)")
    for config, *_ in configs:
        one, ten, base = (cells[(config, k)] for k in ("one", "ten", "rq"))
        extra_ms = 1000 / one.rate - 1000 / base.rate
        step_ms = (1000 / ten.rate - 1000 / one.rate) / 9
        b.summary.append(
            f"  throughput {config}: RQ {base.rate:.1f} jobs/s, marbles one-step "
            f"{one.rate:.1f} runs/s ({ratio(one.rate, base.rate)}), ten-step {ten.rate:.1f} "
            f"runs/s ({ratio(ten.rate, base.rate)})")
        say(f"  {config}: a one-step run costs {extra_ms:+.2f} ms over a no-op RQ job; "
            f"each further step adds {step_ms:.2f} ms ({1000 / step_ms:.0f} steps/s); "
            f"ten-step runs = {10 * ten.rate:.0f} steps/s")
    say()
    return out


# ------------------------------------------------------------------------------------------
# 2. step-commit latency


def rtt_baseline(b: Bench, n: int) -> list[list[Any]]:
    c = b.runs.client  # built like every marbles-rq client (marbles_rq.store.connection.connect)
    sha = c.script_load("return redis.call('HSET', KEYS[1], 'f', ARGV[1])")
    probes: list[tuple[str, Callable[[], Any]]] = [
        ("PING", lambda: c.ping()),
        ("GET (read, no fsync)", lambda: c.get("bench:k")),
        ("SET (write: fsync before reply)", lambda: c.set("bench:k", "v")),
        ("EVALSHA of a 1-HSET script", lambda: c.evalsha(sha, 1, "bench:h", "v")),
    ]
    rows = []
    for label, fn in probes:
        for _ in range(50):
            fn()
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        rows.append([label, n, ms(pct(samples, 50)), ms(pct(samples, 99)), ms(max(samples))])
    return rows


def section_latency(b: Bench) -> dict[str, float]:
    steps = b.sizes.latency_steps
    say(f"== 2. Step latency: one run of {steps} trivial steps on `marbles-rq worker --pool 1`, "
        "timed inside the body (perf_counter)")
    b.reset()
    say("  round-trip baseline from this client (2000 each):")
    say(table(["call", "n", "p50 ms", "p99 ms", "max ms"], rtt_baseline(b, 2000)))
    b.reset()
    result = ops.enqueue(b.runs, b.rq, ops.RunRequest(
        "latency", msgspec.json.encode({"steps": steps})))
    s0 = server_stats(b.r)
    child = b.procs.start("latency-worker", b.marbles_worker(pool=True))
    try:
        child.proc.wait(timeout=120 + steps * 0.05)
    except subprocess.TimeoutExpired:
        b.procs.kill(child)
    s1 = server_stats(b.r).minus(s0)
    view = b.runs.get(result.run_id)
    if view is None or view.status != "succeeded" or view.result is None:
        raise BenchError(f"latency run: {view and view.status}\n{child.tail()}")
    data = msgspec.json.decode(bytes(view.result))
    rows = []
    out = {}
    for key, label in (("step_us", "step call (body + commit_step; start_step if any)"),
                       ("start_us", "start_step script call (steps with retries only)"),
                       ("commit_us", "commit_step script call")):
        v = [x / 1e6 for x in data[key]]
        if not v:
            rows.append([label, 0, "-", "-", "-", "-", "-"])
            continue
        rows.append([label, len(v), ms(pct(v, 50)), ms(pct(v, 90)), ms(pct(v, 99)),
                     ms(max(v)), ms(sum(v) / len(v))])
        out[key] = pct(v, 50)
        out[key + "99"] = pct(v, 99)
    say(f"  run {result.run_id}: {view.status}, {len(view.steps)} steps in the ledger")
    say(table(["what", "n", "p50 ms", "p90 ms", "p99 ms", "max ms", "mean ms"], rows))
    evals = s1.calls.get("evalsha", 0)
    if evals:
        say(f"  inside Redis: {evals} EVALSHA, mean {s1.usec['evalsha'] / evals:.1f} us of "
            "command time each (excludes the AOF write+fsync, done before the reply)")
    p50, p99 = out["commit_us"], out["commit_us99"]
    aims = (f"aim commit p50 <= 1 ms: {ms(p50)} ms -> {'met' if p50 <= 0.001 else 'MISSED'}; "
            f"aim p99 <= 5 ms: {ms(p99)} ms -> {'met' if p99 <= 0.005 else 'MISSED'}")
    say("  " + aims)
    b.summary.append(f"  step latency: step call p50 {ms(out['step_us'])} ms / p99 "
                     f"{ms(out['step_us99'])} ms; {aims}")
    say()
    return out


# ------------------------------------------------------------------------------------------
# 3. enqueue


def section_enqueue(b: Bench) -> None:
    n, reps = b.sizes.enqueue_n, b.sizes.enqueue_reps
    say(f"== 3. Enqueue/s from one client, {n} per measurement, no worker running, "
        f"median of {reps} passes (method order rotated each pass)")
    noop = ops.RunRequest("one_step")

    def rq_single() -> None:
        q = Queue(QUEUE, connection=b.r, serializer=RQJSONSerializer)
        for _ in range(n):
            q.enqueue(NOOP)

    def rq_many() -> None:
        q = Queue(QUEUE, connection=b.r, serializer=RQJSONSerializer)
        for start in range(0, n, 1000):
            datas = [Queue.prepare_data(NOOP) for _ in range(min(1000, n - start))]
            with b.r.pipeline() as pipe:
                q.enqueue_many(datas, pipeline=pipe)
                pipe.execute()

    def record_only() -> None:
        for _ in range(n):
            b.runs.record(ops.prepare(noop))

    def dispatch_single() -> None:
        for _ in range(n):
            dispatch.enqueue_delivery(b.rq, "mrq", MARBLES_QUEUE, uuid.uuid4().hex, 1)

    def dispatch_many() -> None:
        for start in range(0, n, 1000):
            dispatch.enqueue_deliveries(b.rq, "mrq", MARBLES_QUEUE, [(uuid.uuid4().hex, 1)
                                                      for _ in range(min(1000, n - start))])

    def m_single() -> None:
        for _ in range(n):
            if not ops.enqueue(b.runs, b.rq, noop).dispatched:
                raise BenchError("ops.enqueue did not dispatch")

    def m_many() -> None:
        for start in range(0, n, 1000):
            ops.enqueue_many(b.runs, b.rq, [noop] * min(1000, n - start))

    methods: list[tuple[str, str, Callable[[], None], bool, bool]] = [
        # label, kind, fn, expects RQ jobs, expects run records
        ("RQ Queue.enqueue (no-op, JSON)", "single", rq_single, True, False),
        ("marbles ops.enqueue (one_step)", "single", m_single, True, True),
        ("  its half 1: RunStore.record (claim_run)", "single", record_only, False, True),
        ("  its half 2: dispatch.enqueue_delivery", "single", dispatch_single, True, False),
        ("RQ Queue.enqueue_many (pipeline/1000)", "batch", rq_many, True, False),
        ("marbles ops.enqueue_many (1000/call)", "batch", m_many, True, True),
        ("  its half 2: dispatch.enqueue_deliveries", "batch", dispatch_many, True, False),
    ]
    rates: dict[str, list[float]] = defaultdict(list)
    checks: dict[str, str] = {}
    for rep in range(reps):
        b.reset()
        shift = rep % len(methods)  # rotate the order, so no method always goes first
        for label, _kind, fn, jobs, records in methods[shift:] + methods[:shift]:
            jobs0, runs0 = b.r.llen(Q_KEY), b.run_count()
            t0 = time.perf_counter()
            fn()
            rates[label].append(n / (time.perf_counter() - t0))
            got_jobs, got_runs = b.r.llen(Q_KEY) - jobs0, b.run_count() - runs0
            ok = (got_jobs == (n if jobs else 0)) and (got_runs == (n if records else 0))
            if not ok or label not in checks:
                checks[label] = "ok" if ok else f"JOBS {got_jobs} RUNS {got_runs}"
    rq_rate = {"single": median(rates[methods[0][0]]), "batch": median(rates[methods[4][0]])}
    rows = [[label, kind, f"{median(rates[label]):.0f}",
             " ".join(f"{r:.0f}" for r in rates[label]), f"{1000 / median(rates[label]):.3f}",
             ratio(median(rates[label]), rq_rate[kind]), checks[label]]
            for label, kind, *_ in methods]
    say(table(["method", "kind", "per s", "each rep", "ms each", "vs RQ same kind", "count"],
              rows))
    for row in (rows[0], rows[1], rows[4], rows[5]):
        b.summary.append(f"  enqueue {row[0].strip()}: {row[2]}/s ({row[5]} of RQ)")
    say()


# ------------------------------------------------------------------------------------------
# 4. redelivery after kill -9


@dataclass
class KillSample:
    total_ms: int
    lease_left_ms: int | None
    reaped_ms: int | None  # kill -> the controller's "redelivered" event
    horse_gone: bool


class Follower:
    """Reads one run's output stream in order, blocking."""

    def __init__(self, runs: RunStore, run_id: str) -> None:
        self.runs, self.run_id = runs, run_id
        self.after = "0-0"
        self.events: list[OutputEvent] = []
        self.pos = 0

    def wait(self, pred: Callable[[OutputEvent], bool], timeout: float) -> OutputEvent:
        deadline = time.monotonic() + timeout
        while True:
            while self.pos < len(self.events):
                ev = self.events[self.pos]
                self.pos += 1
                if pred(ev):
                    return ev
            if time.monotonic() > deadline:
                seen = ", ".join(f"{e.type}/a{e.attempt}" for e in self.events[-8:])
                raise BenchError(f"run {self.run_id}: no matching event within {timeout:.0f} s "
                                 f"(last events: {seen})")
            new = self.runs.output(self.run_id, after=self.after, block_ms=200)
            if new:
                self.after = new[-1].id
                self.events += new

    def since(self, start: int, type: str, attempt: int) -> OutputEvent | None:
        for ev in self.events[start:self.pos]:
            if ev.type == type and ev.attempt == attempt:
                return ev
        return None


def started(attempt: int) -> Callable[[OutputEvent], bool]:
    return lambda ev: ev.type == "attempt_started" and ev.attempt == attempt


def wait_registered(b: Bench, child: Child, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    # Worker names are <host>.<random>.<pid>, unique per start.
    while not any(m.endswith(f".{child.pid}".encode()) for m in b.r.smembers("rq:workers")):
        if child.proc.poll() is not None or time.monotonic() > deadline:
            raise BenchError(f"worker {child.pid} did not register\n{child.tail()}")
        time.sleep(0.02)


def kill_series(b: Bench, workers: list[Child], lease_ms: int, kills: int, mode: str,
                run_id: str, follow: Follower, attempt: int,
                log: list[str]) -> tuple[list[KillSample], int]:
    samples = []
    keys = b.runs.keys.run_keys(run_id)
    timeout = 3 * lease_ms / 1000 + 30
    if not any(started(attempt)(ev) for ev in follow.events[:follow.pos]):
        follow.wait(started(attempt), timeout)
    for i in range(kills):
        time.sleep(random.uniform(0.3, 1.0))  # land the kill at a random point of a step
        name = b.r.hget(keys.run, "worker")
        pid = int(name.decode().rsplit(".", 1)[1]) if name else -1
        victim = next((w for w in workers if w.pid == pid), None)
        if victim is None:
            raise BenchError(f"run {run_id} runs on {name!r}, not on one of our workers")
        horses: list[int] = []
        for _ in range(100):
            horses = descendants(pid)
            if horses:
                break
            time.sleep(0.01)
        b.procs.seen.update(horses)
        pipe = b.r.pipeline(transaction=False)
        pipe.time()
        pipe.zscore(keys.leases, run_id)
        (secs, micros), score = pipe.execute()
        kill_ms = int(secs) * 1000 + int(micros) // 1000
        if mode == "worker":
            os.kill(pid, signal.SIGKILL)  # the worker process only, as `kill -9 <pid>`
        else:
            if len(horses) != 1:
                raise BenchError(f"worker {pid} has {len(horses)} children, expected one horse")
            os.kill(horses[0], signal.SIGKILL)
        mark = follow.pos
        replacement = None
        if mode == "worker":
            b.procs.kill(victim)  # reap it; its group and anything left below it
            workers.remove(victim)
            replacement = b.procs.start(f"worker-lease{lease_ms}",
                                        b.marbles_worker(pool=False, burst=False,
                                                         lease_ms=lease_ms))
            workers.append(replacement)
        nxt = follow.wait(started(attempt + 1), timeout)
        reaped = follow.since(mark, "redelivered", attempt + 1)
        sample = KillSample(
            total_ms=nxt.at_ms - kill_ms,
            lease_left_ms=None if score is None else int(score) - kill_ms,
            reaped_ms=None if reaped is None else reaped.at_ms - kill_ms,
            horse_gone=bool(horses) and not any(alive(h) for h in horses))
        samples.append(sample)
        log.append(f"    {mode} kill {i + 1:2}: next attempt_started after "
                   f"{sample.total_ms / 1000:.3f} s (lease left at kill "
                   f"{'-' if sample.lease_left_ms is None else sample.lease_left_ms} ms; "
                   f"redelivered +{sample.reaped_ms} ms); horse gone: "
                   f"{'yes' if sample.horse_gone else 'NO'}; attempt {attempt} -> {attempt + 1}")
        attempt += 1
        if replacement is not None:
            wait_registered(b, replacement)
    return samples, attempt


def kill_row(label: str, lease_ms: int, samples: list[KillSample], *,
             lease_path: bool) -> list[Any]:
    totals = [s.total_ms / 1000 for s in samples]
    ttl = lease_ms / 1000
    # a horse-only kill does not wait for the lease: the worker expires it (abandon_attempt)
    left = [s.lease_left_ms for s in samples if s.lease_left_ms is not None and lease_path]
    reaped = [s.reaped_ms for s in samples if s.reaped_ms is not None]
    lag = [s.reaped_ms - s.lease_left_ms for s in samples
           if s.reaped_ms is not None and s.lease_left_ms is not None and lease_path]
    after = [s.total_ms - s.reaped_ms for s in samples if s.reaped_ms is not None]
    return [label, len(samples), f"{pct(totals, 50):.3f}", f"{pct(totals, 90):.3f}",
            f"{max(totals):.3f}", f"{pct(totals, 50) / ttl:.2f}", f"{max(totals) / ttl:.2f}",
            "met" if max(totals) <= 2 * ttl else "MISSED",
            f"{median(left):.0f}" if left else "-",
            f"{median(lag):.0f}" if lag else "-", f"{median(reaped):.0f}" if reaped else "-",
            f"{median(after):.0f}" if after else "-",
            f"{sum(s.horse_gone for s in samples)}/{len(samples)}"]


def section_redelivery(b: Bench) -> None:
    s = b.sizes
    say(f"== 4. Redelivery after kill -9: controller --interval {CONTROLLER_INTERVAL_S} "
        "(the default), two forking `marbles-rq worker`s")
    say("   a `sleeper` run (steps of 0.25 s sleep; every commit extends the lease); kill "
        "0.3-1.0 s after its attempt_started; time = server ms of the next attempt_started "
        "(stream id) - server TIME read just before the kill")
    rows: list[list[Any]] = []
    log: list[str] = []
    plan = [(2000, s.kills_short, s.horse_kills), (10_000, s.kills_default, 0)]
    for lease_ms, kills, horse_kills in plan:
        if not kills and not horse_kills:
            continue
        b.reset()
        controller = b.procs.start("controller", b.marbles(
            "controller", "--interval", str(CONTROLLER_INTERVAL_S), "--log-level", "WARNING"))
        workers = [b.procs.start(f"worker-lease{lease_ms}", b.marbles_worker(
            pool=False, burst=False, lease_ms=lease_ms)) for _ in range(2)]
        for w in workers:
            wait_registered(b, w)
        say(f"   lease {lease_ms} ms: {shlex.join(workers[0].argv)}")
        run = ops.enqueue(b.runs, b.rq, ops.RunRequest(
            "sleeper", msgspec.json.encode({"steps": 100_000, "nap_s": 0.25})))
        follow = Follower(b.runs, run.run_id)
        attempt = 1
        try:
            for mode, count in (("worker", kills), ("horse", horse_kills)):
                if not count:
                    continue
                samples, attempt = kill_series(b, workers, lease_ms, count, mode, run.run_id,
                                               follow, attempt, log)
                label = "worker kill -9" if mode == "worker" else "horse-only kill -9"
                rows.append(kill_row(f"{label}, lease {lease_ms} ms", lease_ms, samples,
                                     lease_path=mode == "worker"))
            outcome = b.runs.cancel(run.run_id)
            final = follow.wait(lambda ev: ev.type == "final", 30)
        except BenchError as exc:
            view = b.runs.get(run.run_id)
            logs = "\n".join(f"--- {c.name} {c.pid} ---\n{c.tail()}"
                             for c in [*workers, controller])
            say("\n".join(log))
            state = view and {k: v for k, v in view.to_json().items() if k != "steps"}
            raise BenchError(f"{exc}\nrun: {state}\n{logs}") from None
        log.append(f"    run {run.run_id}: {attempt} deliveries; cancel -> {outcome}, final "
                   f"{final.data.get('status')}")
        say("\n".join(log))
        log.clear()
        for child in [*workers, controller]:
            b.procs.stop(child)
    for row in rows:
        b.summary.append(f"  redelivery {row[0]}: n={row[1]} p50 {row[2]} s, max {row[4]} s "
                         f"= {row[6]}x TTL (aim <= 2x: {row[7]})")
    say(table(["case", "kills", "p50 s", "p90 s", "max s", "p50/TTL", "max/TTL",
               "max<=2xTTL", "lease left ms", "expiry->reap ms", "kill->reap ms",
               "reap->start ms", "horse gone"], rows))
    say("   (medians: lease left at kill; expiry->reap = the controller noticing the expired "
        "lease; reap->start = enqueue + dequeue + fork + start_attempt. A horse-only kill "
        "does not wait for the lease: the surviving worker expires it at once "
        "(abandon_attempt), so kill->reap is the controller's pass interval)")
    say()


# ------------------------------------------------------------------------------------------
# 5. anatomy: round trips and the engine's own cost


def per_job(big: ServerStats, small: ServerStats, n: int) -> dict[str, Any]:
    calls = {k: (v - small.calls.get(k, 0)) / n for k, v in big.calls.items()}
    return {"reads": (big.reads - small.reads) / n,
            "commands": (big.commands - small.commands) / n,
            "net_in": (big.net_in - small.net_in) / n, "net_out": (big.net_out - small.net_out) / n,
            "calls": {k: v for k, v in calls.items() if abs(v) >= 0.05}}


def section_anatomy(b: Bench) -> None:
    s = b.sizes
    say("== 5. Where the time goes")
    say(f"  a) Redis traffic per job/run: INFO deltas of a burst of {s.rt_large} minus a burst "
        f"of {s.rt_small}, divided by {s.rt_large - s.rt_small} (worker start-up cancels out). "
        "'reads' = total_reads_processed, one per request or pipeline the server reads, i.e. "
        "~ round trips; commands include those run inside Lua scripts")
    cases: list[tuple[str, list[str], str | None]] = [
        ("rq SimpleWorker, no-op", b.rq_worker("rq.worker.SimpleWorker"), None),
        ("marbles --pool 1, one_step", b.marbles_worker(pool=True), "one_step"),
        ("marbles --pool 1, ten_steps", b.marbles_worker(pool=True), "ten_steps"),
        ("rq Worker (fork), no-op", b.rq_worker("rq.worker.Worker"), None),
        ("marbles worker (fork), one_step", b.marbles_worker(pool=False), "one_step"),
    ]
    results: list[tuple[str, dict[str, Any]]] = []
    for label, argv, wf in cases:
        deltas = []
        for n in (s.rt_small, s.rt_large):
            b.reset()
            ids = b.fill_marbles(wf, n) if wf else []
            if not wf:
                b.fill_rq(n)
            s0 = server_stats(b.r)
            child = b.procs.start("anatomy", argv)
            try:
                child.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                b.procs.kill(child)
            deltas.append(server_stats(b.r).minus(s0))
            done = done_counts(b)[0]
            if done != n or (wf and b.statuses(ids) != Counter(succeeded=n)):
                raise BenchError(f"{label}: {done}/{n} finished\n{child.tail()}")
        results.append((label, per_job(deltas[1], deltas[0], s.rt_large - s.rt_small)))
    # the enqueue side, one at a time
    for label, fn in (("RQ Queue.enqueue", lambda: Queue(
            QUEUE, connection=b.r, serializer=RQJSONSerializer).enqueue(NOOP)),
                      ("marbles ops.enqueue", lambda: ops.enqueue(
                          b.runs, b.rq, ops.RunRequest("one_step")))):
        b.reset()
        fn()  # connect, load scripts
        e0 = server_stats(b.r)
        empty = server_stats(b.r).minus(e0)  # what the two INFO calls add by themselves
        s0 = server_stats(b.r)
        for _ in range(100):
            fn()
        big = server_stats(b.r).minus(s0)
        results.append((label + " (client side)", per_job(big, empty, 100)))
    rows = []
    for label, d in results:
        calls = d["calls"]
        rows.append([label, f"{d['reads']:.1f}", f"{d['commands']:.1f}",
                     f"{calls.get('evalsha', 0) + calls.get('eval', 0):.1f}",
                     f"{calls.get('exec', 0):.1f}", f"{d['net_in']:.0f}", f"{d['net_out']:.0f}"])
    say(table(["per job / run", "reads (~round trips)", "commands", "EVALSHA", "MULTI/EXEC",
               "bytes in", "bytes out"], rows))
    b.summary.append("  Redis reads (~round trips) per job/run: " + "; ".join(
        f"{label} {d['reads']:.0f}" for label, d in results))
    say("  command mix per job/run (>= 0.5 per job):")
    for label, d in results:
        mix = sorted(d["calls"].items(), key=lambda kv: -kv[1])
        say(f"    {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in mix if v >= 0.5))
    say()
    say("  b) the engine's own cost: execute() called in this process (no RQ, no fork) on "
        "pre-recorded runs; every script call timed")
    for wf, n in (("one_step", s.inproc_one), ("ten_steps", s.inproc_ten)):
        b.reset()
        ids = [b.runs.record(ops.prepare(ops.RunRequest(wf))).record.id for _ in range(n)]
        samples: dict[str, list[float]] = defaultdict(list)
        scripts = b.runs.scripts
        orig = scripts.call

        def timed(name: str, keys: list[str], args: list[Any], _orig: Any = orig,
                  _samples: dict[str, list[float]] = samples) -> list[Any]:
            t0 = time.perf_counter()
            reply = _orig(name, keys, args)
            _samples[name].append(time.perf_counter() - t0)
            return reply

        scripts.call = timed  # type: ignore[method-assign]
        per_run: list[float] = []
        outcomes: Counter[str] = Counter()
        try:
            for rid in ids:
                t0 = time.perf_counter()
                outcomes[execute(b.runs, REGISTRY, rid, 1, worker="bench-inproc",
                                 lease_ms=10_000, hard_exit=False)] += 1
                per_run.append(time.perf_counter() - t0)
        finally:
            del scripts.call
        mean_run = sum(per_run) / n
        in_scripts = sum(sum(v) for v in samples.values()) / n
        say(f"    {wf}: {n} runs, {dict(outcomes)}; {n / sum(per_run):.0f} runs/s; per run "
            f"mean {ms(mean_run)} ms, p50 {ms(pct(per_run, 50))} ms = script calls "
            f"{ms(in_scripts)} ms + other Python {ms(mean_run - in_scripts)} ms")
        rows = [[name, f"{len(v) / n:.0f}", ms(pct(v, 50)), ms(pct(v, 99)),
                 ms(sum(v) / len(v))] for name, v in samples.items()]
        say(table(["script", "calls/run", "p50 ms", "p99 ms", "mean ms"], rows, indent="      "))
    say()


# ------------------------------------------------------------------------------------------


def git_state() -> str:
    """The commit measured, and whether the engine (marbles_rq/, lua/) differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "marbles_rq", "lua"],
                               cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    return f"commit {head or '?'}" + (" + uncommitted engine changes" if dirty else "")


def header(b: Bench, quick: bool) -> None:
    cfg = {}
    for key in ("appendonly", "appendfsync", "no-appendfsync-on-rewrite", "maxmemory-policy",
                "save"):
        value = b.r.config_get(key)
        value = next(iter(value.values()), "?") if value else "?"
        cfg[key] = value.decode() if isinstance(value, bytes) else str(value)
    info = b.r.info("server")
    fs = subprocess.run(["df", "-T", str(b.server.dir)], capture_output=True, text=True)
    fs_type = fs.stdout.splitlines()[-1].split()[1] if fs.returncode == 0 else "?"

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "?"

    say("marbles-rq runs benchmark" + (" (--quick)" if quick else ""))
    command = [os.path.relpath(sys.executable, REPO_ROOT), "-m", "bench.runs", *sys.argv[1:]]
    say(f"command: {shlex.join(command)}  (cwd {REPO_ROOT})")
    say(f"machine: {os.cpu_count()} CPUs ({cpu_model()}), {mem_total()} RAM, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}; "
        "Redis, the workers, the controller and this client all share these CPUs")
    say(f"host load at start: {load_line()}")
    say(f"redis-server {info['redis_version']} (pid {b.server.pid}), dir {b.server.dir} "
        f"({fs_type}); config {DEFAULT_CONF.relative_to(REPO_ROOT)}; read back with CONFIG GET: "
        + ", ".join(f"{k} {v!r}" if v == "" else f"{k} {v}" for k, v in cfg.items()))
    say(f"rq {rq.__version__}, redis-py {redis.__version__}, hiredis {version('hiredis')}, "
        f"msgspec {msgspec.__version__}, marbles-rq {version('marbles-rq')} at {git_state()}")
    say()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller N, fewer kills (~2 min)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    wanted = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    random.seed(args.seed)
    os.chdir(REPO_ROOT)
    load_source(FLOWS)  # the driver needs the workflows for ops.prepare and execute()

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    tmp = Path(tempfile.mkdtemp(prefix="marbles-bench-runs-"))
    b: Bench | None = None
    started_at = time.monotonic()
    code = 0
    try:
        b = Bench(QUICK if args.quick else FULL, tmp)
        header(b, args.quick)
        for name in SECTIONS:
            if name in wanted:
                t0 = time.monotonic()
                globals()[f"section_{name}"](b)
                say(f"   ({name}: {time.monotonic() - t0:.0f} s; {load_line()})")
                say()
        rewrites = int(b.r.info("persistence").get("aof_rewrites", 0))
        say(f"AOF rewrites: {rewrites}, of which {b.manual_rewrites} started by reset() between "
            f"measurements and {rewrites - b.manual_rewrites} automatic (inside a measurement)")
        if b.summary:
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
            below = len(b.procs.seen) - len(b.procs.children)
            say(f"processes started: {len(b.procs.children)} (+{below} seen below them); "
                f"stray processes left: {strays or 'none'}; "
                f"redis-server stopped: {not b.server.is_running()}")
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        say(f"total {time.monotonic() - started_at:.0f} s; host load at end: {load_line()}")
    return code


if __name__ == "__main__":
    sys.exit(main())
