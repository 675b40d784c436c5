"""Bulk enqueue: `marbles-rq enqueue bulk_item --batch FILE` of N lines (default 100,000)
next to RQ's `Queue.enqueue_many` of N no-op jobs, on one durable redis-server
(ops/redis.conf: appendonly yes, appendfsync always) started here, in alternating rounds.

Run from the repo root::

    python -m bench.bulk [--lines 100000] [--rounds 2]

What each side does:

* marbles-rq: the real command, a separate process (its start-up counted), reading the
  file line by line, validating each input against the workflow's struct (strict), and per
  chunk of 500 one claim_runs script call that records each run and enqueues its RQ job:
  one round trip and one fsync per chunk, the next chunk built while the server writes
  this one. Its peak RSS is read from wait4, to show memory stays bounded.
* RQ: `Queue.prepare_data` + `Queue.enqueue_many` per 500 in one pipeline (one round trip
  per chunk), in this process, no file and no validation: the floor of an RQ batch enqueue.

Between rounds the server is emptied (FLUSHALL) and its AOF compacted. Besides wall-clock
rates it prints CPU seconds (the client's user+system, and redis-server's, from /proc) per
100,000, which a box loaded by other work moves much less than wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from rq import Queue
from rq.serializers import JSONSerializer as RQJSONSerializer

from marbles_rq.transport import dispatch
from tests.redis_procs import DEFAULT_CONF, RedisServer

from .runs_util import REPO_ROOT, load_line, median, proc_cpu_s, ratio, table

NOOP = "bench.runs_noop.noop"
QUEUE = dispatch.rq_queue_name("mrq", "default")
CHUNK = 500


def say(text: str = "") -> None:
    print(text, flush=True)


def write_file(path: Path, n: int) -> None:
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"n": i, "note": f"item {i}"}) + "\n")


def compact(r: redis.Redis) -> None:
    r.flushall()
    r.bgrewriteaof()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        info = r.info("persistence")
        if not int(info["aof_rewrite_in_progress"]) and not int(info["aof_rewrite_scheduled"]):
            return
        time.sleep(0.05)


def marbles_round(url: str, path: Path, n: int) -> tuple[float, int, str, float]:
    """(seconds, peak RSS in KiB, the summary line, CPU seconds) of one `enqueue --batch`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    argv = [sys.executable, "-m", "marbles_rq", "--redis-url", url, "--source",
            "bench/bulk_flows.py", "enqueue", "bulk_item", "--batch", str(path)]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    out = (proc.stdout.read() if proc.stdout else b"").decode().strip()
    err = (proc.stderr.read() if proc.stderr else b"").decode().strip()
    if proc.returncode != 0 or f"{n} enqueued" not in out:
        raise SystemExit(f"marbles-rq enqueue --batch failed ({proc.returncode}): {out} {err}")
    return elapsed, usage.ru_maxrss, out, usage.ru_utime + usage.ru_stime


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rq_round(r: redis.Redis, n: int) -> tuple[float, float]:
    """(seconds, this process's CPU seconds) of RQ's enqueue_many of `n` no-op jobs."""
    q = Queue(QUEUE, connection=r, serializer=RQJSONSerializer)
    cpu = _self_cpu()
    started = time.perf_counter()
    for start in range(0, n, CHUNK):
        datas = [Queue.prepare_data(NOOP, timeout=-1) for _ in range(min(CHUNK, n - start))]
        with r.pipeline() as pipe:
            q.enqueue_many(datas, pipeline=pipe)
            pipe.execute()
    elapsed = time.perf_counter() - started
    cpu = _self_cpu() - cpu
    if r.llen(Queue.redis_queue_namespace_prefix + QUEUE) != n:
        raise SystemExit("RQ's queue does not hold every job")
    return elapsed, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-bulk-") as tmp_name:
        tmp = Path(tmp_name)
        server = RedisServer.start(dir=tmp / "redis", conf=DEFAULT_CONF)
        try:
            r = redis.Redis.from_url(server.url)
            conf = {k: r.config_get(k)[k] for k in ("appendonly", "appendfsync")}
            say(f"bench/bulk.py: {args.lines:,} lines, {args.rounds} rounds; redis "
                f"{r.info('server')['redis_version']} {conf}; {os.cpu_count()} CPUs")
            say(f"  {load_line()}")
            path = tmp / "batch.jsonl"
            write_file(path, args.lines)
            say(f"  file {path.stat().st_size / 1e6:.1f} MB")
            ours: list[float] = []
            theirs: list[float] = []
            rss: list[int] = []
            cpu_ours: list[tuple[float, float]] = []  # (client, redis-server) CPU seconds
            cpu_theirs: list[tuple[float, float]] = []
            per = 100_000 / args.lines
            for i in range(args.rounds):
                # Alternate which side goes first, so drift on a shared box hits both.
                order = ("marbles", "rq") if i % 2 == 0 else ("rq", "marbles")
                for side in order:
                    compact(r)
                    server_cpu = proc_cpu_s(server.pid)
                    if side == "marbles":
                        secs, peak, line, cpu = marbles_round(server.url, path, args.lines)
                        cpu_ours.append((cpu * per, (proc_cpu_s(server.pid) - server_cpu)
                                         * per))
                        ours.append(args.lines / secs)
                        rss.append(peak)
                        say(f"  round {i + 1} marbles-rq: {secs:.2f} s, {ours[-1]:,.0f} "
                            f"lines/s, CPU per 100k: command {cpu_ours[-1][0]:.2f} s, "
                            f"redis-server {cpu_ours[-1][1]:.2f} s, peak RSS "
                            f"{peak / 1024:.0f} MiB ({line})")
                    else:
                        secs, cpu = rq_round(r, args.lines)
                        cpu_theirs.append((cpu * per, (proc_cpu_s(server.pid) - server_cpu)
                                           * per))
                        theirs.append(args.lines / secs)
                        say(f"  round {i + 1} RQ enqueue_many: {secs:.2f} s, "
                            f"{theirs[-1]:,.0f} jobs/s, CPU per 100k: client "
                            f"{cpu_theirs[-1][0]:.2f} s, redis-server "
                            f"{cpu_theirs[-1][1]:.2f} s")
            say()
            say(table(["what", "median /s", "rounds"],
                      [["marbles-rq enqueue --batch (lines/s, whole command)",
                        f"{median(ours):,.0f}", " ".join(f"{x:,.0f}" for x in ours)],
                       ["RQ Queue.enqueue_many (no-op jobs/s)", f"{median(theirs):,.0f}",
                        " ".join(f"{x:,.0f}" for x in theirs)]]))
            paired = [a / b for a, b in zip(ours, theirs, strict=True)]
            mine = median([a + b for a, b in cpu_ours])
            rqs = median([a + b for a, b in cpu_theirs])
            say(f"  ratio marbles-rq / RQ, wall: {ratio(median(ours), median(theirs))} "
                f"(per round: {' '.join(f'{x:.2f}x' for x in paired)})")
            say(f"  CPU per 100,000 (client + redis-server, medians): marbles-rq "
                f"{median([a for a, _ in cpu_ours]):.2f} + {median([b for _, b in cpu_ours]):.2f}"
                f" s, RQ {median([a for a, _ in cpu_theirs]):.2f} + "
                f"{median([b for _, b in cpu_theirs]):.2f} s; by CPU marbles-rq / RQ: "
                f"{ratio(rqs, mine)}")
            say(f"  marbles-rq peak RSS max {max(rss) / 1024:.0f} MiB")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
