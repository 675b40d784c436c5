"""Runs that wait: parked runs, answer latency, timer lateness and fan-out (issue 8, item 10).

    .venv/bin/python bench/waits.py [--full] [--runs 2000] [--answers 200] [--timers 2000]
                                    [--timer-window 12] [--timer-lead S] [--fanout 100]
                                    [--fanout-reps 3] [--pool 2] [--rq-jobs 1000]
                                    [--rq-latency 200] [--probes 20] [--idle-seconds 5]
                                    [--sections rq,park,answer,timers,fanout]

--full is the issue's sizes: --runs 10000 --timers 10000 --timer-window 60 --rq-jobs 2000
(about 20 minutes on a shared 2-CPU machine, where a worker parks some 30 runs a second).

Starts its own redis-server from ops/redis.conf (appendonly yes, appendfsync always) in a
temporary directory, a real `marbles-rq controller` (its WaitingDuty serves timers from a
thread of its own) and one `marbles-rq worker --pool N` (N non-forking executors; 2 by
default), all on bench/waits_flows.py, then:

0. rq       plain RQ in the same run, for reference: two `rq worker -w SimpleWorker`
            processes; enqueue -> started / ended of one no-op job at a time, the time to
            execute `--rq-jobs` no-op jobs, and the memory of a queued no-op job;
1. park     `--runs` runs that do one step and then ask a question: the time until all of
            them wait (enqueue_many -> last "asked" time in the feed, server clock), memory
            per waiting run (INFO memory deltas; MEMORY USAGE by kind of key, and of one
            run's keys), and that the workers are idle meanwhile (RQ queue and started
            registry, the executors' state and CPU, and fresh runs enqueued while they all
            wait finishing promptly);
2. answer   `--answers` of them answered one at a time through the Python API
            (WaitStore.answer, then the delivery enqueued, exactly what `marbles-rq answer`
            does minus process start-up): call -> the run's next attempt_started and its
            final event (output-stream ids, server ms; the driver's clock is the same host's);
3. timers   `--timers` runs that `mr.sleep_until` due times spread evenly over
            `--timer-window` seconds, starting `--timer-lead` seconds out (by default long
            enough for the workers to park them all first, from the rate measured in 1);
            lateness = the "woken" event's stream id (server ms) - the due time (the parked
            event's until_ms), and the same for the next attempt_started and final events;
4. fanout   a parent that starts `--fanout` children and gathers them, next to the same
            children enqueued directly; a run with mr.parallel over `--fanout` one-step
            branches, next to the same steps in sequence.

Nothing asserts; it prints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec
import redis
import rq
from rq import Queue
from rq.serializers import JSONSerializer as RQJSONSerializer
from rq.utils import utcparse

from bench.runs_util import (
    Child,
    Procs,
    cpu_model,
    descendants,
    load_line,
    mem_total,
    pct,
    proc_cpu_s,
    ratio,
    server_stats,
    table,
)
from marbles_rq.engine import ops
from marbles_rq.engine.authoring import load_source
from marbles_rq.engine.runs import RunStore
from marbles_rq.engine.waits import WaitStore
from marbles_rq.store import open_store
from marbles_rq.transport import dispatch
from tests.redis_procs import RedisServer

ROOT = Path(__file__).resolve().parent.parent
FLOWS = ROOT / "bench" / "waits_flows.py"
BIN = Path(sys.executable).parent
NOOP = "bench.runs_noop.noop"
QUEUE = dispatch.rq_queue_name("mrq", "default")
Q_KEY, WIP_KEY = f"rq:queue:{QUEUE}", f"rq:wip:{QUEUE}"
PLAIN, MEMQ = "bench-plain", "bench-mem"  # plain RQ's queues: served, and not served
SECTIONS = ("rq", "park", "answer", "timers", "fanout")
AIM_TIMER_P99_MS = 100
# Defaults that finish in a few minutes on a shared 2-CPU machine (the timers come due at the
# issue's rate, 10,000 over 60 s); --full is the sizes.
DEFAULT = dict(runs=2_000, answers=200, timers=2_000, timer_window=12.0, fanout=100,
               fanout_reps=3, rq_jobs=1_000, rq_latency=200, probes=20)
FULL = dict(DEFAULT, runs=10_000, timers=10_000, timer_window=60.0, rq_jobs=2_000)


class BenchError(RuntimeError):
    pass


def say(text: str = "") -> None:
    print(text, flush=True)


def stats(values: list[float], unit: str = "ms", digits: int = 0) -> str:
    if not values:
        return "no samples"
    f = f"{{:.{digits}f}}"
    return (f"p50 {f.format(pct(values, 50))} {unit}  p90 {f.format(pct(values, 90))} {unit}  "
            f"p99 {f.format(pct(values, 99))} {unit}  max {f.format(max(values))} {unit}  "
            f"(n={len(values)})")


# ------------------------------------------------------------------------------------------
# the environment


@dataclass
class Ev:
    id: str
    type: str
    attempt: int
    data: Any

    @property
    def ms(self) -> int:
        return int(self.id.split("-", 1)[0])


@dataclass
class Ref:
    """What plain RQ measured in this run (section 0)."""

    start_ms: list[float] = field(default_factory=list)
    end_ms: list[float] = field(default_factory=list)
    per_job_ms: float = float("nan")
    job_bytes: float = float("nan")
    requests: float = float("nan")


class Env:
    def __init__(self, tmp: Path, args: Any) -> None:
        self.args = args
        self.server = RedisServer.start(dir=tmp / "redis")
        self.url = self.server.url
        self.r = redis.Redis.from_url(self.url)
        self.rq = dispatch.rq_connection(self.url)
        self.runs = RunStore(open_store(self.url))
        self.waits = WaitStore(self.runs)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
        # The children run this checkout's marbles_rq, whatever the venv has installed.
        env.update(MARBLES_REDIS_URL=self.url, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        (tmp / "logs").mkdir()
        self.procs = Procs(tmp / "logs", env)
        self.ref = Ref()
        self.parked: list[str] = []  # question runs waiting (section 1)
        self.park_rate = 0.0
        self.park_stats: Any = None
        self.worker: Child | None = None
        self.rq_workers: list[Child] = []
        self.controller: Child | None = None

    # -- clocks, keys, events --------------------------------------------------------------

    def server_ms(self) -> int:
        secs, micros = self.r.time()
        return int(secs) * 1000 + int(micros) // 1000

    def total(self, key_of: Callable[[int], str], cmd: str = "zcard") -> int:
        pipe = self.r.pipeline(transaction=False)
        for bucket in range(self.runs.keys.buckets):
            getattr(pipe, cmd)(key_of(bucket))
        return int(sum(pipe.execute()))

    def events(self, run_ids: list[str]) -> dict[str, list[Ev]]:
        out: dict[str, list[Ev]] = {}
        for start in range(0, len(run_ids), 1000):
            chunk = run_ids[start:start + 1000]
            pipe = self.r.pipeline(transaction=False)
            for rid in chunk:
                pipe.xrange(self.runs.keys.output(rid))
            for rid, rows in zip(chunk, pipe.execute(), strict=True):
                out[rid] = [parse_event(eid, f) for eid, f in rows]
        return out

    def last_id(self, run_id: str) -> str:
        rows = self.r.xrevrange(self.runs.keys.output(run_id), count=1)
        return rows[0][0].decode() if rows else "0-0"

    def follow(self, run_id: str, after: str, until: Callable[[Ev], bool],
               timeout: float = 60.0) -> list[Ev]:
        """The run's events after `after`, blocking until one matches `until`."""
        key = self.runs.keys.output(run_id)
        seen: list[Ev] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self.r.xread({key: after}, block=1000, count=100)
            for _, rows in reply or []:
                for eid, f in rows:
                    ev = parse_event(eid, f)
                    seen.append(ev)
                    after = ev.id
                    if until(ev):
                        return seen
        raise BenchError(f"run {run_id}: no matching event within {timeout:.0f} s; saw "
                         f"{[(e.type, e.attempt) for e in seen]}\n{self.logs()}")

    def statuses(self, ids: list[str]) -> Counter[str]:
        counts: Counter[str] = Counter()
        for start in range(0, len(ids), 2000):
            pipe = self.r.pipeline(transaction=False)
            for rid in ids[start:start + 2000]:
                pipe.hget(self.runs.keys.run(rid), "status")
            counts.update((s or b"missing").decode() for s in pipe.execute())
        return counts

    def enqueue(self, workflow: str, items: Iterable[tuple[str, Any]]) -> None:
        batch: list[ops.RunRequest] = []

        def flush() -> None:
            done = ops.enqueue_many(self.runs, self.rq, batch)
            if not all(e.created and e.dispatched for e in done):
                raise BenchError("enqueue_many did not create and dispatch every run")
            batch.clear()

        for run_id, inp in items:
            batch.append(ops.RunRequest(workflow, msgspec.json.encode(inp), run_id))
            if len(batch) >= 500:
                flush()
        if batch:
            flush()

    def compact_aof(self) -> None:
        """Rewrite the AOF now if it grew, so no automatic rewrite lands in a measurement."""
        if int(self.r.info("persistence").get("aof_current_size", 0)) < 32 << 20:
            return
        with contextlib.suppress(redis.ResponseError):
            self.r.bgrewriteaof()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            info = self.r.info("persistence")
            if not int(info["aof_rewrite_in_progress"]) and not int(
                    info["aof_rewrite_scheduled"]):
                return
            time.sleep(0.1)

    # -- processes -------------------------------------------------------------------------

    def marbles(self, *args: str) -> list[str]:
        return [str(BIN / "marbles-rq"), "--redis-url", self.url, "--source", str(FLOWS), *args]

    def start_marbles(self) -> None:
        pool = self.args.pool
        self.controller = self.procs.start("controller", self.marbles(
            "controller", "--interval", "0.5", "--log-level", "INFO"))
        self.worker = self.procs.start("worker", self.marbles(
            "worker", "--pool", str(pool), "--log-level", "WARNING"))
        deadline = time.monotonic() + 60
        while True:
            pids = {self.worker.pid, *descendants(self.worker.pid)}
            names = [m for m in self.r.smembers("rq:workers") if pid_of(m) in pids]
            elected = "elected controller" in self.controller.log.read_text(errors="replace")
            if len(names) >= pool and elected:
                return
            if time.monotonic() > deadline or self.worker.proc.poll() is not None or (
                    self.controller.proc.poll() is not None):
                raise BenchError(f"workers or controller did not start\n{self.logs()}")
            time.sleep(0.05)

    def worker_cpu_s(self) -> float:
        assert self.worker is not None
        return sum(proc_cpu_s(p) for p in (self.worker.pid, *descendants(self.worker.pid)))

    def executor_states(self) -> list[str]:
        assert self.worker is not None
        pids = {self.worker.pid, *descendants(self.worker.pid)}
        states = []
        for m in self.r.smembers("rq:workers"):
            if pid_of(m) in pids:
                states.append((self.r.hget(m, "state") or b"?").decode())
        return states

    def logs(self) -> str:
        return "\n".join(f"--- {c.name} {c.pid} ---\n{c.tail()}" for c in self.procs.children)


def pid_of(worker_key: bytes) -> int | None:
    """The pid in a marbles-rq worker's RQ name (<host>.<random>.<pid>); plain RQ's have none."""
    last = worker_key.decode().rsplit(".", 1)[-1]
    return int(last) if last.isdigit() else None


def parse_event(eid: bytes, f: dict[bytes, bytes]) -> Ev:
    return Ev(eid.decode(), f[b"t"].decode(), int(f[b"a"]), json.loads(f[b"d"]))


def first(events: list[Ev], type: str, attempt: int | None = None) -> Ev | None:
    return next((e for e in events if e.type == type
                 and (attempt is None or e.attempt == attempt)), None)


def wait_until(env: Env, check: Callable[[], bool], timeout: float, what: str,
               interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}\n{env.logs()}")
        time.sleep(interval)


# ------------------------------------------------------------------------------------------
# memory


def key_kind(key: bytes) -> str:
    text = key.decode(errors="replace")
    if text.startswith("rq:"):
        return "rq:" + text.split(":")[1]
    if text.startswith("{") and "}:" in text:
        return text.split("}:", 1)[1].split(":", 1)[0]
    return "other"


def bytes_by_kind(r: redis.Redis) -> Counter[str]:
    keys = list(r.scan_iter(count=2000))
    out: Counter[str] = Counter()
    for start in range(0, len(keys), 2000):
        chunk = keys[start:start + 2000]
        pipe = r.pipeline(transaction=False)
        for k in chunk:
            pipe.memory_usage(k)
        for k, size in zip(chunk, pipe.execute(), strict=True):
            out[key_kind(k)] += int(size or 0)
    return out


KIND_NAMES = {
    "run": "run hash", "steps": "ledger (steps hash)", "out": "output stream",
    "asks": "questions (asks hash)", "feed": "feed zset (per bucket)",
    "idx": "run listing zset (per bucket)", "waits": "waits zset (per bucket)",
    "rq:job": "RQ job hashes of finished deliveries",
    "rq:results": "RQ result streams of finished deliveries",
    "rq:finished": "RQ finished registry",
}


# ------------------------------------------------------------------------------------------
# 0. plain RQ


def rq_worker(env: Env) -> list[str]:
    return [str(BIN / "rq"), "worker", "-q", "-u", env.url, "-S",
            "rq.serializers.JSONSerializer", "-w", "rq.worker.SimpleWorker", "-P", str(ROOT),
            PLAIN]


def rq_jobs(n: int) -> list[Any]:
    return [Queue.prepare_data(NOOP, timeout=-1, result_ttl=dispatch.RESULT_TTL_S,
                               failure_ttl=dispatch.FAILURE_TTL_S) for _ in range(n)]


def rq_probe(env: Env) -> tuple[float, float]:
    """One no-op job through the idle plain RQ workers: (enqueue -> started_at, -> ended_at)
    in ms, the driver's clock and the worker's, same host."""
    q = Queue(PLAIN, connection=env.r, serializer=RQJSONSerializer)
    t0 = time.time()
    job = q.enqueue_call(NOOP, timeout=-1, result_ttl=dispatch.RESULT_TTL_S,
                         failure_ttl=dispatch.FAILURE_TTL_S)
    if job.latest_result(timeout=30) is None:
        raise BenchError(f"RQ job {job.id} did not finish\n{env.logs()}")
    started, ended = env.r.hmget(job.key, "started_at", "ended_at")
    return ((utcparse(started.decode()).timestamp() - t0) * 1000,
            (utcparse(ended.decode()).timestamp() - t0) * 1000)


def drop_rq_leftovers(env: Env) -> None:
    """Finished plain-RQ jobs expire after result_ttl; deleted now, so they do not leave
    the database in the middle of a memory measurement."""
    pipe = env.r.pipeline(transaction=False)
    for pattern in ("rq:job:*", "rq:results:*", "rq:finished:*", "rq:execution*"):
        for key in env.r.scan_iter(match=pattern, count=2000):
            pipe.unlink(key)
    pipe.delete(f"rq:queue:{MEMQ}")
    pipe.execute()


def section_rq(env: Env) -> None:
    args = env.args
    say(f"== 0. plain RQ, for reference: two `rq worker -w rq.worker.SimpleWorker` processes "
        f"on queue {PLAIN} (kept running, idle, for the paired samples in 1 and 2), no-op jobs "
        f"({NOOP}), JSON serializer, result_ttl {dispatch.RESULT_TTL_S} s")
    env.rq_workers = [env.procs.start(f"rq-worker-{i}", rq_worker(env)) for i in range(2)]
    wait_until(env, lambda: env.r.scard("rq:workers") >= 2, 60, "two RQ workers")
    for _ in range(5):  # warm-up
        rq_probe(env)
    for _ in range(args.rq_latency):
        started, ended = rq_probe(env)
        env.ref.start_ms.append(started)
        env.ref.end_ms.append(ended)
    say(f"   one job at a time, workers idle, {args.rq_latency} jobs (the driver's clock and "
        f"the job's started_at/ended_at, same host):")
    say(f"     enqueue -> started: {stats(env.ref.start_ms, digits=1)}")
    say(f"     enqueue -> ended:   {stats(env.ref.end_ms, digits=1)}")

    n = args.rq_jobs
    fin = f"rq:finished:{PLAIN}"
    done0 = env.r.zcard(fin)
    before = server_stats(env.r)
    q = Queue(PLAIN, connection=env.r, serializer=RQJSONSerializer)
    t0 = time.perf_counter()
    for start in range(0, n, 1000):
        with env.r.pipeline() as pipe:
            q.enqueue_many(rq_jobs(min(1000, n - start)), pipeline=pipe)
            pipe.execute()
    wait_until(env, lambda: env.r.zcard(fin) - done0 >= n, 60 + n * 0.1,
               f"{n} RQ jobs to finish", interval=0.01)
    took = time.perf_counter() - t0
    spent = server_stats(env.r).minus(before)
    env.ref.per_job_ms = took * 1000 / n
    env.ref.requests = spent.reads / n
    say(f"   {n:,} no-op jobs enqueued (pipelined, 1,000 a batch) and executed by the two "
        f"workers: {took:.2f} s, {n / took:,.0f} jobs/s, {env.ref.per_job_ms:.2f} ms a job; "
        f"Redis requests (round trips) {spent.reads / n:.1f} a job, commands "
        f"{spent.commands / n:.1f}")

    drop_rq_leftovers(env)
    time.sleep(0.5)
    base = env.r.info("memory")
    q = Queue(MEMQ, connection=env.r, serializer=RQJSONSerializer)
    n = args.runs
    ids = []
    for start in range(0, n, 1000):
        with env.r.pipeline() as pipe:
            ids += [j.id for j in q.enqueue_many(rq_jobs(min(1000, n - start)), pipeline=pipe)]
            pipe.execute()
    time.sleep(0.5)
    used = env.r.info("memory")
    env.ref.job_bytes = (int(used["used_memory"]) - int(base["used_memory"])) / n
    one = env.r.memory_usage(f"rq:job:{ids[0]}")
    dataset = (int(used["used_memory_dataset"]) - int(base["used_memory_dataset"])) / n
    say(f"   {n:,} queued no-op jobs (on a queue no worker serves): used_memory "
        f"{env.ref.job_bytes:,.0f} bytes a job, dataset {dataset:,.0f} bytes; MEMORY USAGE of "
        f"one job hash {one} bytes, of the queue list "
        f"{(env.r.memory_usage(f'rq:queue:{MEMQ}') or 0) / n:,.0f} bytes a job")
    drop_rq_leftovers(env)
    say()


# ------------------------------------------------------------------------------------------
# 1. parked runs


def park_questions(env: Env, ids: list[str]) -> tuple[float, float]:
    """Enqueue question runs and wait until all of them wait: (enqueue s, park s)."""
    n = len(ids)
    feed0 = env.total(env.runs.keys.feed)
    env.park_stats = server_stats(env.r)
    t0_ms = env.server_ms()
    t0 = time.perf_counter()
    env.enqueue("bench_wait_ask", ((rid, None) for rid in ids))
    enq = time.perf_counter() - t0
    wait_until(env, lambda: env.total(env.runs.keys.feed) - feed0 >= n, 120 + n * 0.1,
               f"{n} runs to park on their question")
    pipe = env.r.pipeline(transaction=False)
    for bucket in range(env.runs.keys.buckets):
        pipe.zrevrange(env.runs.keys.feed(bucket), 0, 0, withscores=True)
    last = max(int(row[0][1]) for row in pipe.execute() if row)
    env.park_stats = server_stats(env.r).minus(env.park_stats)
    return enq, (last - t0_ms) / 1000


def section_park(env: Env) -> None:
    args = env.args
    n = args.runs
    say(f"== 1. {n:,} runs waiting on a question, one `marbles-rq worker --pool {args.pool}` "
        "and a controller")
    say("   workflow bench_wait_ask: one step, then ctx.ask.question (two choices); "
        f"worker: {shlex.join(env.marbles('worker', '--pool', str(args.pool))[1:])}")
    # A warm-up run of each kind, settled: scripts loaded and indexes created, so the
    # baseline holds what every deployment has.
    env.enqueue("bench_wait_noop", [("warm-noop", None)])
    env.follow("warm-noop", "0-0", lambda e: e.type == "final")
    env.enqueue("bench_wait_ask", [("warm-ask", None)])
    env.follow("warm-ask", "0-0", lambda e: e.type == "parked")
    answer(env, "warm-ask")
    env.follow("warm-ask", "0-0", lambda e: e.type == "final")
    time.sleep(1.0)
    base = env.r.info("memory")
    base_kinds = bytes_by_kind(env.r)
    base_keys = env.r.dbsize()

    ids = [f"w{i:05d}" for i in range(n)]
    enq, park_s = park_questions(env, ids)
    env.parked = ids
    env.park_rate = n / park_s
    counts = env.statuses(ids)
    say(f"   enqueue_many (500 a batch): {enq:.2f} s; enqueue -> the last run parked (server "
        f"clock): {park_s:.2f} s = {env.park_rate:,.0f} runs/s, {park_s * 1000 / n:.2f} ms a "
        f"run; statuses: {dict(counts)}")
    spent = env.park_stats
    say(f"   Redis requests (round trips) {spent.reads / n:.1f} a run, commands "
        f"{spent.commands / n:.1f} (scripts' commands included), while they parked")
    if env.ref.per_job_ms == env.ref.per_job_ms:
        say(f"   against plain RQ executing no-op jobs on two workers ({env.ref.per_job_ms:.2f} "
            f"ms and {env.ref.requests:.1f} requests a job): "
            f"{ratio(park_s * 1000 / n, env.ref.per_job_ms)} the time per item")

    time.sleep(1.0)
    used = env.r.info("memory")
    kinds = bytes_by_kind(env.r)
    dk = {k: kinds[k] - base_kinds.get(k, 0) for k in kinds}
    marbles = sum(v for k, v in dk.items() if not k.startswith("rq:"))
    rq_left = sum(v for k, v in dk.items() if k.startswith("rq:"))
    say(f"   memory per waiting run ({n:,} runs; the deltas from before they were enqueued):")
    say(f"     INFO used_memory {(int(used['used_memory']) - int(base['used_memory'])) / n:,.0f}"
        f" bytes, used_memory_dataset "
        f"{(int(used['used_memory_dataset']) - int(base['used_memory_dataset'])) / n:,.0f} "
        f"bytes; keys {(env.r.dbsize() - base_keys) / n:.1f} a run")
    say(f"     MEMORY USAGE: the run's own keys and its index entries {marbles / n:,.0f} bytes; "
        f"RQ's finished delivery (expires after {dispatch.RESULT_TTL_S} s) {rq_left / n:,.0f} "
        "bytes")
    rows = [[KIND_NAMES.get(k, k), f"{v / n:,.0f}"] for k, v in
            sorted(dk.items(), key=lambda kv: -kv[1]) if abs(v) >= n]
    say(table(["kind of key", "bytes a run"], rows, indent="       "))
    sample = ids[n // 2]
    k = env.runs.keys
    say(f"     one run ({sample}):")
    for key in (k.run(sample), k.steps(sample), k.output(sample), k.asks(sample)):
        say(f"       {key:36} MEMORY USAGE {env.r.memory_usage(key)} bytes "
            f"({env.r.type(key).decode()}, {env.r.object('encoding', key).decode()}, "
            f"{entries(env.r, key)} entries)")
    if env.ref.job_bytes == env.ref.job_bytes:
        say(f"     against a queued plain RQ no-op job ({env.ref.job_bytes:,.0f} bytes of "
            f"used_memory): {ratio(marbles / n, env.ref.job_bytes)} (run's keys, MEMORY USAGE)")

    say(f"   are the workers idle while {n:,} runs wait?")
    cpu0, rcpu0, ccpu0 = env.worker_cpu_s(), proc_cpu_s(env.server.pid), proc_cpu_s(
        env.controller.pid if env.controller else 0)
    t0 = time.perf_counter()
    time.sleep(args.idle_seconds)
    dt_s = time.perf_counter() - t0
    cpu1, rcpu1, ccpu1 = env.worker_cpu_s(), proc_cpu_s(env.server.pid), proc_cpu_s(
        env.controller.pid if env.controller else 0)
    say(f"     RQ queue {QUEUE}: {env.r.llen(Q_KEY)} jobs; started registry (rq:wip): "
        f"{env.r.zcard(WIP_KEY)}; executors' RQ state: {', '.join(env.executor_states())}; "
        f"runs running: {env.statuses(ids).get('running', 0)}")
    say(f"     CPU over {dt_s:.1f} s: worker (supervisor + executors) "
        f"{(cpu1 - cpu0) / dt_s * 100:.1f}% of a core, controller "
        f"{(ccpu1 - ccpu0) / dt_s * 100:.1f}%, redis-server {(rcpu1 - rcpu0) / dt_s * 100:.1f}%")
    lat: list[float] = []
    ref: list[float] = []
    for i in range(args.probes):
        rid = f"probe{i}"
        t0_ms = time.time() * 1000
        env.enqueue("bench_wait_noop", [(rid, None)])
        final = env.follow(rid, "0-0", lambda e: e.type == "final")[-1]
        lat.append(final.ms - t0_ms)
        if env.rq_workers:
            ref.append(rq_probe(env)[1])
    say(f"     {args.probes} fresh no-op runs enqueued one at a time while they wait, enqueue "
        f"-> final event: {stats(lat, digits=1)}")
    if ref:
        say(f"     paired with as many plain RQ no-op jobs (idle RQ workers), enqueue -> ended: "
            f"{stats(ref, digits=1)}; ratio of p50s {ratio(pct(lat, 50), pct(ref, 50))}")
    say()


def entries(r: redis.Redis, key: str) -> int:
    kind = r.type(key).decode()
    return int({"hash": r.hlen, "stream": r.xlen, "zset": r.zcard}.get(kind, lambda _: 0)(key))


# ------------------------------------------------------------------------------------------
# 2. answers


def answer(env: Env, run_id: str) -> tuple[float, float, int]:
    """Answer a run's question as `marbles-rq answer` does; (t0, t1, woken attempt)."""
    t0 = time.time()
    done = env.waits.answer(run_id, "ask:0", "yes", kind="question")
    if done.woken_attempt:
        dispatch.enqueue_delivery(env.rq, env.runs.keys.prefix, done.queue, run_id,
                                  done.woken_attempt)
    return t0, time.time(), done.woken_attempt


def section_answer(env: Env) -> None:
    args = env.args
    if not env.parked:
        ids = [f"w{i:05d}" for i in range(args.answers)]
        park_questions(env, ids)
        env.parked = ids
    waiting = len(env.parked)
    step = max(1, waiting // args.answers)
    picks = env.parked[::step][:args.answers]
    say(f"== 2. answer -> continue: {len(picks)} of the {waiting:,} waiting runs answered one at "
        "a time (the next after the previous one's final event), controller and workers running")
    say("   through the Python API: WaitStore.answer(run, 'ask:0', 'yes') + "
        "dispatch.enqueue_delivery, as `marbles-rq answer` does without its process start-up. "
        "Times from the call (driver clock) to output-stream ids (server ms, same host; 1 ms "
        "resolution)")
    call: list[float] = []
    answered: list[float] = []
    woken: list[float] = []
    started: list[float] = []
    final: list[float] = []
    ref_start: list[float] = []
    ref_end: list[float] = []
    for rid in picks:
        after = env.last_id(rid)
        t0, t1, attempt = answer(env, rid)
        evs = env.follow(rid, after, lambda e: e.type == "final")
        t0_ms = t0 * 1000
        call.append((t1 - t0) * 1000)
        for bucket, type_, att in ((answered, "answered", None), (woken, "woken", attempt),
                                   (started, "attempt_started", attempt),
                                   (final, "final", None)):
            ev = first(evs, type_, att)
            if ev is not None:
                bucket.append(ev.ms - t0_ms)
        if env.rq_workers:  # a plain RQ job right after, under the same load
            a, b = rq_probe(env)
            ref_start.append(a)
            ref_end.append(b)
    env.parked = [r for r in env.parked if r not in set(picks)]
    say(f"     answer call (script + enqueue, client): {stats(call, digits=1)}")
    say(f"     -> 'answered' event:                    {stats(answered, digits=1)}")
    say(f"     -> next attempt_started:                {stats(started, digits=1)}")
    say(f"     -> final event:                         {stats(final, digits=1)}")
    if ref_start:
        say("   paired: a plain RQ no-op job after each answered run's final event (idle RQ "
            "workers, the same moment's load):")
        say(f"     RQ enqueue -> started:                  {stats(ref_start, digits=1)}")
        say(f"     RQ enqueue -> ended:                    {stats(ref_end, digits=1)}")
        say(f"   ratio answer -> attempt_started / RQ enqueue -> started: p50 "
            f"{ratio(pct(started, 50), pct(ref_start, 50))}, p99 "
            f"{ratio(pct(started, 99), pct(ref_start, 99))}; answer -> final / RQ enqueue -> "
            f"ended: p50 {ratio(pct(final, 50), pct(ref_end, 50))}, p99 "
            f"{ratio(pct(final, 99), pct(ref_end, 99))}")
    say()


# ------------------------------------------------------------------------------------------
# 3. timers


def section_timers(env: Env) -> None:
    args = env.args
    n = args.timers
    window_ms = int(args.timer_window * 1000)
    rate = env.park_rate or 30.0
    # Enough for the workers to park them all first (those that park late are counted apart).
    lead = args.timer_lead if args.timer_lead is not None else max(10.0, 1.6 * n / rate + 10)
    env.compact_aof()
    others = env.total(env.runs.keys.feed)
    say(f"== 3. timer lateness: {n:,} runs mr.sleep_until due times spread evenly over "
        f"{args.timer_window:g} s, the first {lead:.0f} s after enqueueing (parking rate "
        f"{'measured in 1' if env.park_rate else 'assumed'}: {rate:,.0f}/s); real controller "
        f"(WaitingDuty thread) and `worker --pool {args.pool}`; {others:,} other runs wait on "
        "questions meanwhile")
    waits0 = env.total(env.runs.keys.run_waits)
    t_enq_ms = env.server_ms()
    first_due = t_enq_ms + int(lead * 1000)
    ids = [f"t{i:05d}" for i in range(n)]
    dues = [first_due + window_ms * i // max(1, n - 1) for i in range(n)]
    t0 = time.perf_counter()
    env.enqueue("bench_wait_sleep", ((rid, {"due_ms": due}) for rid, due in zip(ids, dues,
                                                                                 strict=True)))
    enq = time.perf_counter() - t0

    def parked_all() -> bool:
        return env.total(env.runs.keys.run_waits) - waits0 >= n or env.server_ms() >= first_due

    wait_until(env, parked_all, lead + 60, "the timer runs to park")
    parked_at = env.server_ms()
    pending = env.total(env.runs.keys.run_waits)
    say(f"   enqueue_many: {enq:.2f} s; {pending:,} timers pending "
        f"{(first_due - parked_at) / 1000:.1f} s before the first is due")
    # While they come due: RQ queue length (the workers' backlog), sampled.
    backlog = []
    cpu0, ccpu0, rcpu0 = env.worker_cpu_s(), proc_cpu_s(env.controller.pid), proc_cpu_s(
        env.server.pid)
    w0 = time.perf_counter()
    while env.server_ms() < first_due + window_ms:
        backlog.append(env.r.llen(Q_KEY))
        time.sleep(0.25)
    w1 = time.perf_counter()
    cpu1, ccpu1, rcpu1 = env.worker_cpu_s(), proc_cpu_s(env.controller.pid), proc_cpu_s(
        env.server.pid)
    drain = n / (env.park_rate or 50.0) * 2 + 60
    wait_until(env, lambda: env.statuses(ids).get("succeeded", 0) >= n, drain,
               "the timer runs to finish", interval=1.0)
    evs = env.events(ids)
    wake, start, fin, parked_late, early = [], [], [], 0, 0
    never_parked = 0
    by_half: list[list[float]] = [[], []]
    for i, rid in enumerate(ids):
        e = evs[rid]
        parked = first(e, "parked")
        if parked is None:
            never_parked += 1
            continue
        due = int(parked.data.get("until_ms") or dues[i])
        if parked.ms >= due:
            parked_late += 1
            continue
        woken = first(e, "woken")
        if woken is None:
            continue
        wake.append(woken.ms - due)
        early += woken.ms < due
        by_half[0 if i < n // 2 else 1].append(woken.ms - due)
        st = first(e, "attempt_started", woken.attempt)
        if st is not None:
            start.append(st.ms - due)
        f = first(e, "final")
        if f is not None:
            fin.append(f.ms - due)
    span = w1 - w0
    say(f"   measured: {len(wake):,} timers that parked before their due time "
        f"({parked_late} parked after it, {never_parked} ran after it and never parked)")
    say(f"     due -> 'woken' (WaitingDuty):   {stats(wake)}")
    met = wake and pct(wake, 99) <= AIM_TIMER_P99_MS
    say(f"       aim: wake lateness p99 <= {AIM_TIMER_P99_MS} ms: {'met' if met else 'NOT MET'}"
        f"; woken before their due time: {early}; first half p50 {pct(by_half[0], 50):.0f} "
        f"ms p99 {pct(by_half[0], 99):.0f} ms, second half p50 {pct(by_half[1], 50):.0f} ms "
        f"p99 {pct(by_half[1], 99):.0f} ms")
    say(f"     due -> next attempt_started:   {stats(start)}")
    say(f"     due -> final event:            {stats(fin)}")
    say(f"     due rate {n / args.timer_window:,.1f}/s; RQ queue length while they came due: "
        f"p50 {pct(backlog, 50):.0f}, max {max(backlog) if backlog else 0}; CPU over the window: "
        f"workers {(cpu1 - cpu0) / span * 100:.0f}%, controller {(ccpu1 - ccpu0) / span * 100:.0f}"
        f"%, redis-server {(rcpu1 - rcpu0) / span * 100:.0f}% of a core")
    say()


# ------------------------------------------------------------------------------------------
# 4. fan-out


def one_run(env: Env, workflow: str, run_id: str, inp: Any) -> tuple[float, list[Ev], Any]:
    """Enqueue a run and wait for its final event: (wall ms from its created_ms, events,
    result)."""
    env.enqueue(workflow, [(run_id, inp)])
    evs = env.follow(run_id, "0-0", lambda e: e.type == "final", timeout=300)
    created = int(env.r.hget(env.runs.keys.run(run_id), "created_ms"))
    view = env.runs.get(run_id)
    result = None if view is None or view.result is None else msgspec.json.decode(view.result)
    status = None if view is None else view.status
    if status != "succeeded":
        raise BenchError(f"run {run_id} ended {status}: {view and view.error}\n{env.logs()}")
    return evs[-1].ms - created, evs, result


def workers_of(evs: Iterable[Ev]) -> set[str]:
    return {e.data.get("worker") for e in evs if e.type == "attempt_started"}


def section_fanout(env: Env) -> None:
    args = env.args
    n = args.fanout
    say(f"== 4. fan-out: {n} children / {n} parallel branches, {args.fanout_reps} repetitions "
        f"(median shown), `worker --pool {args.pool}` and a controller; wall = the parent's "
        "final event - its created_ms (server clock)")
    rows: dict[str, list[tuple[float, int, int, str]]] = {}
    expected = sum(range(n))
    for rep in range(args.fanout_reps):
        wall, evs, result = one_run(env, "bench_wait_fanout", f"fan{rep}", {"n": n})
        kids = [f"fan{rep}.k{i}" for i in range(n)]
        kid_evs = env.events(kids)
        used = workers_of(evs) | workers_of(e for es in kid_evs.values() for e in es)
        deliveries = sum(1 for e in evs if e.type == "attempt_started")
        check = "ok" if result == expected else f"result {result}!"
        rows.setdefault("start_child x N + gather", []).append((wall, len(used), deliveries,
                                                                  check))

        ids = [f"direct{rep}.{i}" for i in range(n)]
        t0 = env.server_ms()
        env.enqueue("bench_wait_child", ((rid, i) for i, rid in enumerate(ids)))
        wait_until(env, lambda ids=ids: env.statuses(ids).get("succeeded", 0) >= n, 300,
                   "the direct runs", interval=0.02)
        d_evs = env.events(ids)
        end = max(first(es, "final").ms for es in d_evs.values())  # type: ignore[union-attr]
        used = workers_of(e for es in d_evs.values() for e in es)
        rows.setdefault("the same N runs, enqueue_many", []).append((end - t0, len(used), 1,
                                                                       "ok"))

        wall, evs, result = one_run(env, "bench_wait_parallel", f"par{rep}", {"n": n})
        rows.setdefault("mr.parallel over N steps", []).append(
            (wall, len(workers_of(evs)), sum(1 for e in evs if e.type == "attempt_started"),
             "ok" if result == expected else f"result {result}!"))
        wall, evs, result = one_run(env, "bench_wait_seq", f"seq{rep}", {"n": n})
        rows.setdefault("the same N steps in sequence", []).append(
            (wall, len(workers_of(evs)), sum(1 for e in evs if e.type == "attempt_started"),
             "ok" if result == expected else f"result {result}!"))
    out = []
    medians = {}
    for name, samples in rows.items():
        wall = statistics.median(s[0] for s in samples)
        medians[name] = wall
        out.append([name, f"{wall:,.0f}", f"{min(s[0] for s in samples):,.0f}",
                    f"{max(s[0] for s in samples):,.0f}", f"{wall / n:.2f}",
                    "/".join(str(s[1]) for s in samples),
                    "/".join(str(s[2]) for s in samples),
                    ",".join(sorted({s[3] for s in samples}))])
    say(table(["case", "wall ms", "min", "max", "ms per child/step", "executors used",
               "parent deliveries", "result"], out, indent="   "))
    names = list(rows)
    say(f"   fan-out / direct: {ratio(medians[names[0]], medians[names[1]])}; parallel / "
        f"sequence: {ratio(medians[names[2]], medians[names[3]])}; parallel runs its branches "
        f"in {n} threads of one executor")
    if env.ref.per_job_ms == env.ref.per_job_ms:
        say(f"   plain RQ, two workers: {env.ref.per_job_ms:.2f} ms a no-op job; fan-out per "
            f"child {ratio(medians[names[0]] / n, env.ref.per_job_ms)} that")
    say()


# ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = parser.add_argument_group(
        "sizes", "defaults: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                        DEFAULT.items()) +
        "; --full: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in FULL.items()
                                 if DEFAULT[k] != v))
    sizes.add_argument("--full", action="store_true",
                       help="the issue's sizes (10,000 waiting runs, 10,000 timers over 60 s)")
    sizes.add_argument("--runs", type=int, help="runs parked on a question")
    sizes.add_argument("--answers", type=int)
    sizes.add_argument("--timers", type=int)
    sizes.add_argument("--timer-window", type=float, help="seconds")
    sizes.add_argument("--fanout", type=int)
    sizes.add_argument("--fanout-reps", type=int)
    sizes.add_argument("--rq-jobs", type=int)
    sizes.add_argument("--rq-latency", type=int)
    sizes.add_argument("--probes", type=int)
    parser.add_argument("--timer-lead", type=float, default=None,
                        help="seconds from enqueueing to the first due time (default: from "
                        "the parking rate measured in section 1)")
    parser.add_argument("--pool", type=int, default=2, help="executors of the one worker")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of {','.join(SECTIONS)}")
    args = parser.parse_args(argv)
    for name, value in (FULL if args.full else DEFAULT).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    load_source(str(FLOWS))
    with tempfile.TemporaryDirectory(prefix="marbles-bench-waits-") as tmp:
        env = Env(Path(tmp), args)
        try:
            header(env, argv)
            if "rq" in sections:
                section_rq(env)
            env.start_marbles()
            started = time.perf_counter()
            for name, fn in (("park", section_park), ("answer", section_answer),
                             ("timers", section_timers), ("fanout", section_fanout)):
                if name in sections:
                    fn(env)
            bad = [c.name for c in env.procs.children if c.proc.poll() is not None]
            say(f"done in {time.perf_counter() - started:.0f} s after start-up; processes that "
                f"exited early: {bad or 'none'}; {load_line()}")
        finally:
            strays = env.procs.cleanup()
            env.server.stop()
            if strays:
                say(f"! processes still alive after cleanup: {strays}")


def header(env: Env, argv: list[str] | None) -> None:
    info = env.r.info("server")
    conf = {k: env.r.config_get(k)[k] for k in ("appendonly", "appendfsync")}
    say("marbles-rq benchmark: runs that wait (issue 8, item 10)")
    say(f"command  : python bench/waits.py {shlex.join(sys.argv[1:] if argv is None else argv)}")
    a = env.args
    say(f"sizes    : --runs {a.runs} --answers {a.answers} --timers {a.timers} --timer-window "
        f"{a.timer_window:g} --fanout {a.fanout} --fanout-reps {a.fanout_reps} --rq-jobs "
        f"{a.rq_jobs} --rq-latency {a.rq_latency} --probes {a.probes} --pool {a.pool}")
    say(f"machine  : {os.cpu_count()} CPUs ({cpu_model()}), {mem_total()}; {platform.system()} "
        f"{platform.release()}; Python {platform.python_version()}; {load_line()}")
    say(f"redis    : {info['redis_version']}, appendonly {conf['appendonly']}, appendfsync "
        f"{conf['appendfsync']}, buckets {env.runs.keys.buckets}; rq {rq.__version__}, "
        f"redis-py {redis.__version__}")
    say()


if __name__ == "__main__":
    main()
