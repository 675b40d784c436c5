"""Benchmark (not a test): runs per second of one worker process, marbles-rq's concurrent
executor next to Dramatiq, Huey and RQ, all in one run.

Run from the repo root (so ``tests`` and ``bench`` are importable)::

    .venv/bin/python -m bench.concurrency [--runs 3000] [--rounds 3] [--only KEYS]
    .venv/bin/python -m bench.concurrency --io [--io-seconds 8] [--rounds 3] [--only KEYS]

It starts its own redis-server from the durable ``ops/redis.conf`` (appendonly yes,
appendfsync always) in a temporary directory, shared by every side; the peers (Dramatiq,
Huey) run from their own venv, bench/.peers, made with pip on first use. Every worker is a
child process in its own session, killed (whole tree) once its cell is measured.

A cell: empty Redis, N jobs or runs pre-enqueued, start the worker, time from its first
dequeue (the queue's list shorter than N) until all N are done (marbles-rq: settled in the
store; RQ: in its finished registry; Dramatiq: its messages hash empty, i.e. all acked;
Huey: N results stored), then check none failed. CPU per job = the worker's process tree
(/proc, user + system, over the same window) plus redis-server's, per job. A round measures
every side once; the order rotates from round to round; figures are the medians of the
rounds.

Default (one-step): a no-op job or a one-step run. `--io`: each job or run makes three
sequential GETs of a local HTTP server the bench starts (bench/http_sleeper.py, answers
after 50 ms): marbles-rq's ``io_flow`` (async steps, httpx.AsyncClient) on ``--concurrency
64`` and 8, Dramatiq's threads and RQ with sync httpx; N per side = its ideal rate
(concurrency / 0.15 s) times ``--io-seconds``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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

from . import peer_venv, pyspy
from .runs_util import (
    REPO_ROOT,
    VENV_BIN,
    Procs,
    cpu_model,
    load_line,
    median,
    mem_total,
    proc_cpu_s,
    ratio,
    table,
)
from .transport import git_state

FLOWS = "bench/concurrency_flows.py"
QUEUE = "bench"  # the marbles-rq queue of FLOWS, Dramatiq's queue, Huey's name
M_LIST = Queue.redis_queue_namespace_prefix + dispatch.rq_queue_name("mrq", QUEUE)
RQ_QUEUE = "bench-rq"
RQ_LIST = Queue.redis_queue_namespace_prefix + RQ_QUEUE
RQ_FINISHED, RQ_FAILED = f"rq:finished:{RQ_QUEUE}", f"rq:failed:{RQ_QUEUE}"
D_LIST, D_MSGS, D_DEAD = f"dramatiq:{QUEUE}", f"dramatiq:{QUEUE}.msgs", f"dramatiq:{QUEUE}.XQ"
H_LIST, H_RESULTS = f"huey.redis.{QUEUE}", f"huey.results.{QUEUE}"
STEP_DELAY_S = 0.05  # the HTTP server's answer time; an io run makes three calls


class BenchError(RuntimeError):
    pass


def say(text: str = "") -> None:
    print(text, flush=True)


def tree(pid: int) -> list[int]:
    """The process and its live descendants, from /proc/PID/task/TID/children."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            with contextlib.suppress(OSError, ValueError), \
                    open(f"/proc/{p}/task/{tid}/children") as fh:
                todo += [int(c) for c in fh.read().split()]
    return found


def tree_cpu(pids: list[int]) -> dict[int, float]:
    out = {}
    for p in pids:
        cpu = proc_cpu_s(p)
        if cpu == cpu:  # not nan: alive
            out[p] = cpu
    return out


# ------------------------------------------------------------------------------------------
# sides


@dataclass
class Sample:
    seconds: float
    worker_cpu_s: float
    redis_cpu_s: float


@dataclass
class Side:
    key: str
    label: str
    kind: str  # marbles | rq | dramatiq | huey
    argv: list[str]
    processes: int
    job: str  # marbles: workflow; rq: function path; peers: noop | io
    n: int
    needs: str = ""  # what it needs that may be missing: "concurrency", "dramatiq", "huey"
    samples: list[Sample] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        return [self.n / s.seconds for s in self.samples]

    @property
    def rate(self) -> float:
        return median(self.rates)

    def cpu_ms(self, which: str = "total") -> float:
        def per(s: Sample) -> float:
            cpu = {"worker": s.worker_cpu_s, "redis": s.redis_cpu_s,
                   "total": s.worker_cpu_s + s.redis_cpu_s}[which]
            return cpu / self.n * 1000
        return median([per(s) for s in self.samples])


class Bench:
    def __init__(self, tmp: Path, io_url: str) -> None:
        self.server = RedisServer.start(dir=tmp / "redis", conf=DEFAULT_CONF)
        self.url = self.server.url
        self.io_url = io_url
        self.r = redis.Redis.from_url(self.url)
        self.rq = dispatch.rq_connection(self.url)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
        # The workers import `bench`; a PYTHONPATH given to the bench (another checkout's
        # marbles_rq) comes first, for them as for the bench.
        path = [p for p in (os.environ.get("PYTHONPATH"), str(REPO_ROOT)) if p]
        env.update(MARBLES_REDIS_URL=self.url, BENCH_REDIS_URL=self.url,
                   PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1")
        (tmp / "logs").mkdir()
        self.procs = Procs(tmp / "logs", env)
        self.runs = RunStore(open_store(self.url))
        self.ids: list[str] = []

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
        self.ids = []

    # -- command lines --------------------------------------------------------------------

    def marbles_argv(self, pool: int | None = None, concurrency: int | None = None) -> list[str]:
        return [str(VENV_BIN / "marbles-rq"), "--redis-url", self.url, "--source", FLOWS,
                "worker", "--queues", QUEUE, "--log-level", "warning",
                *(["--pool", str(pool)] if pool else []),
                *(["--concurrency", str(concurrency)] if concurrency else [])]

    def rq_argv(self) -> list[str]:
        return [str(VENV_BIN / "rq"), "worker", "-q", "-u", self.url, "-S",
                "rq.serializers.JSONSerializer", "-w", "rq.worker.SimpleWorker", "-P",
                str(REPO_ROOT), RQ_QUEUE]

    @staticmethod
    def dramatiq_argv(processes: int, threads: int) -> list[str]:
        return [str(peer_venv.PEERS_BIN / "dramatiq"), "-p", str(processes), "-t",
                str(threads), "-Q", QUEUE, "--path", str(REPO_ROOT), "--",
                "bench.peer_tasks"]

    @staticmethod
    def huey_argv(kind: str, workers: int) -> list[str]:
        return [str(peer_venv.PEERS_BIN / "huey_consumer"), "-q", "-k", kind, "-w",
                str(workers), "bench.peer_tasks.huey"]

    # -- one side's queue -----------------------------------------------------------------

    def fill(self, side: Side) -> None:
        n = side.n
        if side.kind == "marbles":
            data = msgspec.json.encode({"url": self.io_url}) if side.job == "io_flow" else b"null"
            for start in range(0, n, 500):
                done = ops.enqueue_many(self.runs, self.rq, [
                    ops.RunRequest(side.job, input=data)] * min(500, n - start))
                if not all(e.created and e.dispatched for e in done):
                    raise BenchError("enqueue_many did not create and dispatch every run")
                self.ids += [e.run_id for e in done]
        elif side.kind == "rq":
            q = Queue(RQ_QUEUE, connection=self.r, serializer=RQJSONSerializer)
            args = (self.io_url,) if side.job.endswith("io_three") else ()
            for start in range(0, n, 500):
                datas = [Queue.prepare_data(side.job, args=args, timeout=-1)
                         for _ in range(min(500, n - start))]
                with self.r.pipeline() as pipe:
                    q.enqueue_many(datas, pipeline=pipe)
                    pipe.execute()
        else:
            proc = subprocess.run([str(peer_venv.PEERS_PY), "-m", "bench.peer_fill",
                                   side.kind, side.job, str(n), self.io_url],
                                  cwd=REPO_ROOT, env=self.procs.env, capture_output=True,
                                  text=True, timeout=600)
            if proc.returncode:
                raise BenchError(f"{side.label}: filling failed\n{proc.stderr[-2000:]}")
        if self.queued(side) != n:
            raise BenchError(f"{side.label}: {self.queued(side)} queued, not {n}")

    def queued(self, side: Side) -> int:
        key = {"marbles": M_LIST, "rq": RQ_LIST, "dramatiq": D_LIST, "huey": H_LIST}[side.kind]
        return int(self.r.llen(key))

    def done_counter(self, side: Side) -> Callable[[], int]:
        """How many of the side's N are done; for marbles-rq, the finished listings of the
        buckets of runs not yet counted (a full poll is 1,024 ZCARDs)."""
        if side.kind == "rq":
            return lambda: int(self.r.zcard(RQ_FINISHED))
        if side.kind == "dramatiq":
            return lambda: side.n - int(self.r.hlen(D_MSGS))
        if side.kind == "huey":
            return lambda: int(self.r.hlen(H_RESULTS))
        keys = self.runs.keys
        expected = Counter(keys.bucket_of(rid) for rid in self.ids)
        settled = {bucket: 0 for bucket in expected}
        pending = set(expected)

        def count() -> int:
            order = sorted(pending)
            pipe = self.r.pipeline(transaction=False)
            for bucket in order:
                pipe.zcard(keys.run_finished(bucket))
            for bucket, got in zip(order, pipe.execute(), strict=True):
                settled[bucket] = int(got)
                if got >= expected[bucket]:
                    pending.discard(bucket)
            return sum(settled.values())
        return count

    def check(self, side: Side) -> None:
        if side.kind == "marbles":
            counts: Counter[str] = Counter()
            for start in range(0, len(self.ids), 1000):
                pipe = self.r.pipeline(transaction=False)
                for rid in self.ids[start:start + 1000]:
                    pipe.hget(self.runs.keys.run(rid), "status")
                counts.update((s or b"missing").decode() for s in pipe.execute())
            if counts != Counter(succeeded=side.n):
                raise BenchError(f"{side.label}: runs {dict(counts)}")
        elif side.kind == "rq" and self.r.zcard(RQ_FAILED):
            raise BenchError(f"{side.label}: {self.r.zcard(RQ_FAILED)} jobs failed")
        elif side.kind == "dramatiq" and self.r.zcard(D_DEAD):
            raise BenchError(f"{side.label}: {self.r.zcard(D_DEAD)} messages dead-lettered")

    # -- a cell ---------------------------------------------------------------------------

    def measure(self, side: Side, profile: Path | None = None) -> Sample:
        """One cell; with `profile`, py-spy records the worker's tree over the window into
        that file (the cell then costs py-spy's sampling too: not one to count)."""
        self.reset()
        self.fill(side)
        done = self.done_counter(side)
        child = self.procs.start(side.key, side.argv)

        def alive_or_fail(what: str, deadline: float) -> None:
            if child.proc.poll() is not None:
                raise BenchError(f"{side.label}: the worker exited {what}\n{child.tail()}")
            if time.perf_counter() > deadline:
                raise BenchError(f"{side.label}: timed out {what}\n{child.tail()}")

        try:
            deadline = time.perf_counter() + 60
            while self.queued(side) >= side.n:
                alive_or_fail("before its first dequeue", deadline)
                time.sleep(0.002)
            t0 = time.perf_counter()
            cpu0, rcpu0 = tree_cpu(tree(child.pid)), proc_cpu_s(self.server.pid)
            recorder = pyspy.Recorder(child.pid, profile) if profile else None
            deadline = t0 + 60 + side.n * 0.1
            # The cheap poll while the queue drains; the finished counts only for the tail.
            while self.queued(side) > 0:
                alive_or_fail(f"with {self.queued(side)} still queued", deadline)
                time.sleep(0.005)
            while (got := done()) < side.n:
                alive_or_fail(f"with {got}/{side.n} done", deadline)
                time.sleep(0.005)
            t1 = time.perf_counter()
            cpu1, rcpu1 = tree_cpu(tree(child.pid)), proc_cpu_s(self.server.pid)
            if recorder is not None:
                err = recorder.stop()
                if err:
                    say(f"  py-spy: {err}")
        finally:
            self.procs.kill(child)
        self.check(side)
        lost = set(cpu0) - set(cpu1)
        if lost:
            raise BenchError(f"{side.label}: processes {sorted(lost)} exited in the window")
        worker = sum(cpu1[p] - cpu0.get(p, 0.0) for p in cpu1)
        return Sample(t1 - t0, worker, rcpu1 - rcpu0)


# ------------------------------------------------------------------------------------------
# what is measured


def one_step_sides(b: Bench, n: int) -> list[Side]:
    m, d, h = "marbles", "dramatiq", "huey"
    return [
        Side("c8", "marbles-rq worker --concurrency 8 (sync body)", m,
             b.marbles_argv(concurrency=8), 1, "one_step", n, "concurrency"),
        Side("c8-async", "marbles-rq worker --concurrency 8 (async body)", m,
             b.marbles_argv(concurrency=8), 1, "one_step_async", n, "concurrency"),
        Side("pool1", "marbles-rq worker --pool 1 (sync body)", m, b.marbles_argv(pool=1), 1,
             "one_step", n),
        Side("dramatiq", "dramatiq -p1 -t8", d, b.dramatiq_argv(1, 8), 1, "noop", n, d),
        Side("huey-t8", "huey_consumer -k thread -w 8", h, b.huey_argv("thread", 8), 1,
             "noop", n, h),
        Side("huey-p1", "huey_consumer -k process -w 1", h, b.huey_argv("process", 1), 1,
             "noop", n, h),
        Side("rq", "rq worker -w SimpleWorker", "rq", b.rq_argv(), 1, "bench.peer_jobs.noop",
             n),
        Side("p2c8", "marbles-rq worker --pool 2 --concurrency 8 (sync body)", m,
             b.marbles_argv(pool=2, concurrency=8), 2, "one_step", n, "concurrency"),
        Side("p2c8-async", "marbles-rq worker --pool 2 --concurrency 8 (async body)", m,
             b.marbles_argv(pool=2, concurrency=8), 2, "one_step_async", n, "concurrency"),
        Side("dramatiq-p2", "dramatiq -p2 -t8", d, b.dramatiq_argv(2, 8), 2, "noop", n, d),
    ]


def io_sides(b: Bench, seconds: float) -> list[Side]:
    def n(concurrency: int) -> int:
        return max(30, round(concurrency / (3 * STEP_DELAY_S) * seconds))

    m, d = "marbles", "dramatiq"
    return [
        Side("c64", "marbles-rq worker --concurrency 64 (io_flow, async)", m,
             b.marbles_argv(concurrency=64), 1, "io_flow", n(64), "concurrency"),
        Side("c8", "marbles-rq worker --concurrency 8 (io_flow, async)", m,
             b.marbles_argv(concurrency=8), 1, "io_flow", n(8), "concurrency"),
        Side("dramatiq-t64", "dramatiq -p1 -t64 (sync httpx)", d, b.dramatiq_argv(1, 64), 1,
             "io", n(64), d),
        Side("dramatiq", "dramatiq -p1 -t8 (sync httpx)", d, b.dramatiq_argv(1, 8), 1, "io",
             n(8), d),
        Side("rq", "rq worker -w SimpleWorker (sync httpx)", "rq", b.rq_argv(), 1,
             "bench.peer_jobs.io_three", n(1)),
    ]


def aim_line(what: str, value: float, base: float, aim: float) -> str:
    if not base or value != value or base != base:
        return f"  {what}: n/a (not measured)"
    got = value / base
    return f"  {what}: {got:.2f}x (aim >= {aim:g}x): {'met' if got >= aim else 'NOT met'}"


def report(sides: list[Side], io: bool) -> None:
    by = {s.key: s for s in sides}
    rq_side = by.get("rq")
    rows = []
    for s in sides:
        base = by.get("dramatiq-p2" if s.processes == 2 and not io else "dramatiq")
        rows.append([
            s.label, s.processes, s.n, f"{s.rate:.1f}", " ".join(f"{x:.0f}" for x in s.rates),
            ratio(s.rate, base.rate) if base else "n/a",
            ratio(s.rate / s.processes, rq_side.rate) if rq_side else "n/a",
            f"{s.cpu_ms():.3f}", f"{s.cpu_ms('worker'):.3f}", f"{s.cpu_ms('redis'):.3f}",
            ratio(base.cpu_ms(), s.cpu_ms()) if base else "n/a"])
    base_name = "dramatiq -p1 -t8 (-p2 -t8 for 2 processes)" if not io else "dramatiq -p1 -t8"
    say(f"  vs Dramatiq: against {base_name}; vs RQ: per process, against one SimpleWorker; "
        "by CPU: Dramatiq's CPU ms per job / this row's")
    say(table(["side", "procs", "N", "per s (median)", "each round", "vs Dramatiq",
               "vs RQ", "CPU ms/job", "worker", "redis", "vs Dramatiq by CPU"], rows))
    say()
    nan = float("nan")

    def rate(key: str) -> float:
        return by[key].rate if key in by else nan

    say("AIMS")
    if io:
        best_d = max((rate(k) for k in ("dramatiq", "dramatiq-t64") if k in by), default=nan)
        say(aim_line("--concurrency 64 vs RQ SimpleWorker", rate("c64"), rate("rq"), 5))
        say(aim_line("--concurrency 64 vs Dramatiq's best (-t8 or -t64)", rate("c64"), best_d,
                     1))
        say(aim_line("--concurrency 64 vs dramatiq -p1 -t64", rate("c64"),
                     rate("dramatiq-t64"), 1))
        say(aim_line("--concurrency 8 vs dramatiq -p1 -t8", rate("c8"), rate("dramatiq"), 1))
        say(aim_line("--concurrency 8 vs RQ SimpleWorker", rate("c8"), rate("rq"), 5))
    else:
        say(aim_line("--concurrency 8, sync body vs dramatiq -p1 -t8", rate("c8"),
                     rate("dramatiq"), 1))
        say(aim_line("--concurrency 8, async body vs dramatiq -p1 -t8", rate("c8-async"),
                     rate("dramatiq"), 1))
        say(aim_line("--pool 2 --concurrency 8, sync body vs dramatiq -p2 -t8", rate("p2c8"),
                     rate("dramatiq-p2"), 1))
        say(aim_line("--pool 2 --concurrency 8, async body vs dramatiq -p2 -t8",
                     rate("p2c8-async"), rate("dramatiq-p2"), 1))
        say(f"  (reference: --pool 1 is {ratio(rate('pool1'), rate('dramatiq'))} of Dramatiq, "
            f"{ratio(rate('pool1'), rate('rq'))} of RQ)")


# ------------------------------------------------------------------------------------------


def profile(b: Bench, sides: list[Side], keys: str, tmp: Path) -> None:
    if not peer_venv.PY_SPY.exists():
        say("\nPROFILE skipped: no py-spy in bench/.peers")
        return
    wanted = {k.strip() for k in keys.split(",") if k.strip()}
    chosen = [s for s in sides if s.key in wanted or ("marbles" in wanted and s.kind == "marbles")]
    for side in chosen:
        out = tmp / f"pyspy-{side.key}.txt"
        sample = b.measure(side, profile=out)
        say(f"\nPROFILE {side.label}: one more cell under py-spy --gil (400 Hz, not counted), "
            f"{side.n / sample.seconds:.1f}/s, worker CPU "
            f"{sample.worker_cpu_s / side.n * 1000:.3f} ms/job")
        say("\n".join(pyspy.summarize(out)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def has_concurrency(env: dict[str, str]) -> bool:
    out = subprocess.run([str(VENV_BIN / "marbles-rq"), "worker", "--help"], env=env,
                         capture_output=True, text=True, timeout=120).stdout
    return "--concurrency" in out


def start_http(b: Bench, port: int) -> Any:
    child = b.procs.start("http", [sys.executable, "-m", "bench.http_sleeper", "--port",
                                   str(port), "--delay-ms", str(STEP_DELAY_S * 1000)])
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return child
        if child.proc.poll() is not None or time.monotonic() > deadline:
            raise BenchError(f"the HTTP server did not start\n{child.tail()}")
        time.sleep(0.05)


def header(b: Bench, args: argparse.Namespace, peers: dict[str, str]) -> None:
    cfg = {}
    for key in ("appendonly", "appendfsync"):
        value = next(iter(b.r.config_get(key).values()), "?")
        cfg[key] = value.decode() if isinstance(value, bytes) else str(value)
    say("marbles-rq concurrency benchmark" + (" (--io)" if args.io else ""))
    say(f"command: {shlex.join([sys.executable, '-m', 'bench.concurrency', *sys.argv[1:]])}")
    say(f"machine: {os.cpu_count()} CPUs ({cpu_model()}), {mem_total()} RAM, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}")
    say(f"host load at start: {load_line()}")
    say(f"redis-server {b.r.info('server')['redis_version']}, "
        + ", ".join(f"{k} {v}" for k, v in cfg.items()) + " (one server, every side)")
    say(f"marbles-rq {importlib.metadata.version('marbles-rq')} at {git_state()}; rq "
        f"{rq.__version__}, redis-py {redis.__version__}")
    say("peers (bench/.peers): " + (", ".join(f"{k} {v}" for k, v in peers.items()) or "none"))
    say()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.concurrency",
        description="Runs/s of one worker process: marbles-rq --concurrency next to Dramatiq, "
                    "Huey and RQ (see bench/README.md).")
    parser.add_argument("--io", action="store_true",
                        help="the I/O-bound workflow (three 50 ms HTTP calls per run) instead "
                             "of one-step runs")
    parser.add_argument("--runs", type=int, default=3000,
                        help="one-step runs (jobs) per cell [3000]")
    parser.add_argument("--io-seconds", type=float, default=8.0,
                        help="--io: N per side = its ideal rate times this [8]")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds [3]")
    parser.add_argument("--profile", nargs="?", const="marbles", default="",
                        help="after the rounds, one more cell of each marbles-rq side (or of "
                             "the comma-separated keys given) under py-spy, not counted: "
                             "where the worker's CPU goes")
    parser.add_argument("--only", default="",
                        help="comma-separated side keys (c8, c8-async, pool1, dramatiq, "
                             "huey-t8, huey-p1, rq, p2c8, p2c8-async, dramatiq-p2; --io: c64, "
                             "c8, dramatiq-t64, dramatiq, rq)")
    args = parser.parse_args(argv)
    os.chdir(REPO_ROOT)
    load_source(FLOWS)

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    tmp = Path(tempfile.mkdtemp(prefix="marbles-bench-concurrency-"))
    b: Bench | None = None
    code = 0
    started = time.monotonic()
    try:
        peers = peer_venv.ensure(say)
        port = free_port()
        b = Bench(tmp, f"http://127.0.0.1:{port}/")
        header(b, args, peers)
        sides = io_sides(b, args.io_seconds) if args.io else one_step_sides(b, args.runs)
        if args.only:
            wanted = {k.strip() for k in args.only.split(",") if k.strip()}
            unknown = wanted - {s.key for s in sides}
            if unknown:
                parser.error(f"unknown side keys: {', '.join(sorted(unknown))}")
            sides = [s for s in sides if s.key in wanted]
        have = {"concurrency": has_concurrency(b.procs.env),
                "dramatiq": {"dramatiq", "redis"} <= peers.keys(),
                "huey": {"huey", "redis"} <= peers.keys()}
        if args.io:
            have["dramatiq"] = have["dramatiq"] and "httpx" in peers
        for need, ok in have.items():
            if not ok and any(s.needs == need for s in sides):
                why = {"concurrency": "this marbles-rq's worker has no --concurrency"}.get(
                    need, f"{need} is not installed in bench/.peers")
                say(f"skipped: {', '.join(s.label for s in sides if s.needs == need)} ({why})")
        sides = [s for s in sides if not s.needs or have[s.needs]]
        if args.io:
            http = start_http(b, port)
            say(f"HTTP server: {b.io_url} (bench/http_sleeper.py), each GET answered after "
                f"{STEP_DELAY_S * 1000:.0f} ms; three sequential GETs per job or run")
        say(f"{len(sides)} sides x {args.rounds} rounds; N per cell: "
            + ", ".join(f"{s.key} {s.n}" for s in sides))
        say()
        for rnd in range(args.rounds):
            # Every side starts a round at a different place, spread over the rounds.
            shift = rnd * len(sides) // args.rounds
            order = sides[shift:] + sides[:shift]
            say(f"round {rnd + 1}: " + ", ".join(s.key for s in order))
            for side in order:
                sample = b.measure(side)
                side.samples.append(sample)
                say(f"  {side.key:12} {side.n / sample.seconds:8.1f}/s  "
                    f"CPU {(sample.worker_cpu_s + sample.redis_cpu_s) / side.n * 1000:.3f} "
                    f"ms/job  ({load_line()})")
        say()
        if args.io:
            cpu = proc_cpu_s(http.pid)
            say(f"HTTP server CPU over the whole bench: {cpu:.1f} s")
        report(sides, args.io)
        if args.profile:
            profile(b, sides, args.profile, tmp)
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
