"""Benchmark (not a test): the client's round trip next to plain RQ's, in one run.

Run from the repo root (so ``tests`` and ``bench`` are importable)::

    .venv/bin/python -m bench.client_roundtrip [--runs 500] [--block 50] [--mode pool|fork]
                                               [--source]

One sample is one sequential round trip from this process:

- marbles-rq: ``client.start("one_step")`` then ``handle.result(timeout=30)``, a one-step
  run (``bench/runs_flows.py``) executed by ``marbles-rq worker --pool 1`` (``--mode fork``:
  the forking ``marbles-rq worker``);
- RQ 3: ``queue.enqueue(noop)`` then ``job.latest_result(timeout=30)``, a no-op job
  (``bench.runs_noop.noop``, RQ's JSON serializer) executed by ``rq worker -w
  rq.worker.SimpleWorker`` (``--mode fork``: ``rq.worker.Worker``).

Both workers run the whole time against the same durable redis-server (``ops/redis.conf``:
appendonly yes, appendfsync always) that the bench starts in a temporary directory; the two
sides alternate in blocks of ``--block`` samples so both see the same load. The client is
``mr.connect(url)`` without the workflow's source (a caller that knows the workflow by name
from the workers' declarations), or with it imported (``--source``).

Besides p50/p90/p99 of each side and their ratio, it prints where the time goes: the round
trips this process made per sample (every request or pipeline this process sent, counted
on redis-py's connection), the server's round trips per sample (INFO
total_reads_processed: this process and the worker), and, for marbles-rq, how many blocking
reads ``result()`` made before the final entry and how long it waited in them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from rq import Queue
from rq.serializers import JSONSerializer as RQJSONSerializer

import marbles_rq as mr
from marbles_rq.client import sync as client_sync
from tests.redis_procs import DEFAULT_CONF, RedisServer

from .runs_util import (
    REPO_ROOT,
    VENV_BIN,
    Procs,
    cpu_model,
    load_line,
    pct,
    ratio,
    table,
)

FLOWS = "bench/runs_flows.py"
NOOP = "bench.runs_noop.noop"
RQ_QUEUE = "bench-plain"  # not a queue marbles-rq's deliveries use


def say(text: str = "") -> None:
    print(text, flush=True)


class Requests:
    """Counts the requests this process sends (a pipeline is one): its round trips."""

    def __init__(self) -> None:
        self.n = 0
        self._orig = redis.connection.AbstractConnection.send_packed_command

        counter = self

        def counting(conn: Any, command: Any, check_health: bool = True) -> None:
            counter.n += 1
            counter._orig(conn, command, check_health)

        redis.connection.AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]


class ResultReads:
    """How many blocking output reads `result()` made, and the time spent in them."""

    def __init__(self) -> None:
        self.reads = 0
        self.wait_s = 0.0
        orig = client_sync.RunStore.output
        counter = self

        def output(store: Any, run_id: str, **kw: Any) -> Any:
            if kw.get("block_ms") is None:
                return orig(store, run_id, **kw)
            t0 = time.perf_counter()
            try:
                return orig(store, run_id, **kw)
            finally:
                counter.reads += 1
                counter.wait_s += time.perf_counter() - t0

        client_sync.RunStore.output = output  # type: ignore[method-assign]


class Side:
    def __init__(self, name: str, once: Callable[[], float]) -> None:
        self.name, self.once = name, once
        self.samples: list[float] = []
        self.starts: list[float] = []  # the start / enqueue part of each sample
        self.requests = 0
        self.server_reads = 0
        self.count = 0


def server_reads(r: redis.Redis) -> int:
    return int(r.info("stats")["total_reads_processed"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=500, help="samples per side (default 500)")
    ap.add_argument("--block", type=int, default=50, help="samples per block (default 50)")
    ap.add_argument("--warmup", type=int, default=30, help="unmeasured samples per side")
    ap.add_argument("--mode", choices=("pool", "fork"), default="pool",
                    help="pool: marbles-rq worker --pool 1 vs rq SimpleWorker (default); "
                         "fork: the forking workers of both")
    ap.add_argument("--source", action="store_true",
                    help="import the workflow's source in the client (validated here)")
    args = ap.parse_args(argv)

    requests, reads = Requests(), ResultReads()
    tmp = Path(tempfile.mkdtemp(prefix="bench-client-"))
    server = RedisServer.start(dir=tmp / "redis", conf=DEFAULT_CONF)
    (tmp / "logs").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
    env.update(MARBLES_REDIS_URL=server.url, PYTHONUNBUFFERED="1")
    procs = Procs(tmp / "logs", env)
    try:
        r = redis.Redis.from_url(server.url)
        cfg = r.config_get("append*")
        say(f"client round trip, {args.runs} sequential samples per side, blocks of "
            f"{args.block}, mode {args.mode}; redis {r.info('server')['redis_version']} "
            f"appendonly={cfg.get('appendonly')} appendfsync={cfg.get('appendfsync')}")
        say(f"  {cpu_model()}, {os.cpu_count()} CPUs; {load_line()}")
        pool = ["--pool", "1"] if args.mode == "pool" else []
        mw = procs.start("marbles-worker", [
            str(VENV_BIN / "marbles-rq"), "--redis-url", server.url, "--source", FLOWS,
            "worker", "--log-level", "WARNING", "--lease-ms", "10000", *pool])
        rw = procs.start("rq-worker", [
            str(VENV_BIN / "rq"), "worker", "-q", "-u", server.url,
            "-S", "rq.serializers.JSONSerializer",
            "-w", "rq.worker.SimpleWorker" if args.mode == "pool" else "rq.worker.Worker",
            "-P", str(REPO_ROOT), RQ_QUEUE])
        # A worker declares its workflows once it has started: wait for that.
        deadline = time.monotonic() + 60
        while not r.hexists("{mrq}:workflows", "one_step"):
            if time.monotonic() > deadline or mw.proc.poll() is not None:
                raise SystemExit(f"the marbles-rq worker did not declare one_step:\n"
                                 f"{mw.tail()}")
            time.sleep(0.05)
        deadline = time.monotonic() + 60
        while not r.scard(f"rq:workers:{RQ_QUEUE}"):  # registered: it listens
            if time.monotonic() > deadline or rw.proc.poll() is not None:
                raise SystemExit(f"the RQ worker did not start:\n{rw.tail()}")
            time.sleep(0.05)

        client = mr.connect(server.url, source=FLOWS if args.source else None)
        queue = Queue(RQ_QUEUE, connection=redis.Redis.from_url(server.url),
                      serializer=RQJSONSerializer)

        def marbles_once() -> float:
            t0 = time.perf_counter()
            run = client.start("one_step")
            started = time.perf_counter() - t0
            value = run.result(timeout=30)
            if value != 0:
                raise SystemExit(f"one_step returned {value!r}")
            return started

        def rq_once() -> float:
            t0 = time.perf_counter()
            job = queue.enqueue(NOOP)
            started = time.perf_counter() - t0
            got = job.latest_result(timeout=30)
            if got is None or got.type != got.Type.SUCCESSFUL:
                raise SystemExit(f"RQ job {job.id}: {got}\n{rw.tail()}")
            return started

        sides = [Side("marbles-rq start+result", marbles_once),
                 Side("RQ enqueue+latest_result", rq_once)]
        for side in sides:
            for _ in range(args.warmup):
                side.once()
        reads.reads, reads.wait_s = 0, 0.0
        done = 0
        while done < args.runs:
            n = min(args.block, args.runs - done)
            for side in sides:
                req0, srv0 = requests.n, server_reads(r)
                for _ in range(n):
                    t0 = time.perf_counter()
                    side.starts.append(side.once())
                    side.samples.append(time.perf_counter() - t0)
                side.requests += requests.n - req0
                side.server_reads += server_reads(r) - srv0 - 1  # less the INFO itself
                side.count += n
            sides.reverse()  # alternate who goes first
            done += n
        sides.sort(key=lambda s: not s.name.startswith("marbles"))

        rows = []
        for side in sides:
            s = side.samples
            rows.append([side.name, len(s), f"{pct(s, 50) * 1000:.2f}",
                         f"{pct(s, 90) * 1000:.2f}", f"{pct(s, 99) * 1000:.2f}",
                         f"{max(s) * 1000:.2f}", f"{side.requests / side.count:.2f}",
                         f"{side.server_reads / side.count:.1f}"])
        m, q = sides
        rows.append(["ratio (marbles-rq / RQ)", "", ratio(pct(m.samples, 50), pct(q.samples, 50)),
                     ratio(pct(m.samples, 90), pct(q.samples, 90)),
                     ratio(pct(m.samples, 99), pct(q.samples, 99)), "", "", ""])
        say()
        say(table(["", "n", "p50 ms", "p90 ms", "p99 ms", "max ms", "client round trips",
                   "server round trips"], rows))
        for side in sides:
            waits = [a - b for a, b in zip(side.samples, side.starts, strict=True)]
            say(f"  {side.name}: the start p50 {pct(side.starts, 50) * 1000:.2f} ms, p99 "
                f"{pct(side.starts, 99) * 1000:.2f} ms; the wait for the result p50 "
                f"{pct(waits, 50) * 1000:.2f} ms, p99 {pct(waits, 99) * 1000:.2f} ms")
        say(f"  result(): {reads.reads / m.count:.2f} blocking reads per run, "
            f"{reads.wait_s / m.count * 1000:.2f} ms waiting in them on average")
        p50 = pct(m.samples, 50) / pct(q.samples, 50)
        say(f"  goal: within 1.2x of RQ at p50: {p50:.2f}x -> "
            f"{'met' if p50 <= 1.2 else 'NOT met'}")
        say(f"  {load_line()}")
        given = argv if argv is not None else sys.argv[1:]
        say(f"  command: python -m bench.client_roundtrip {' '.join(given)}")
    finally:
        strays = procs.cleanup()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        if strays:
            say(f"  stray processes left: {strays}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
