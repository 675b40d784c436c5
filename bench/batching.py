"""Sending events into a batched trigger vs an unbatched trigger vs a plain enqueue.

    .venv/bin/python bench/batching.py [--events 2000] [--rounds 3] [--batch 100]

Starts its own redis-server from ops/redis.conf (appendonly yes, appendfsync always) in a
temporary directory. In each round, interleaved (the order rotates, so drift on a shared box
hits every case), one client in this process sends `--events` items through each path:

* `plain enqueue`: `ops.enqueue` of a run of `bb_plain` with a fresh id (the baseline);
* `unbatched event`: `Events.send` to a trigger of one run per event (journal, offer, record
  the run, mark it started);
* `batched event`: `Events.send` to a trigger batching 100 per run (journal, offer, append to
  the batch, mark it batched; every 100th also records the batch's run).

It prints per path: items/s (median round) and the ratio to plain enqueue, client CPU and
redis-server CPU per item, Redis commands per item, and runs started per 1,000 items. No
worker runs: the runs are recorded and enqueued, not executed. Nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

import bench.batching_flows  # noqa: F401  (declares the triggers and workflows here)
from bench.runs_util import cpu_model, load_line, proc_cpu_s, server_stats, table
from marbles_rq.engine import ops
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.triggers.events import Events
from tests.redis_procs import DEFAULT_CONF, RedisServer

CASES = ("plain enqueue", "unbatched event", "batched event")


def say(text: str) -> None:
    print(text, flush=True)


def run_case(case: str, round_no: int, n: int, events: Events, runs: RunStore,
             rq: redis.Redis, server_pid: int, client: redis.Redis) -> dict[str, float]:
    payloads = [json.dumps({"order": i, "amount": i * 3}).encode() for i in range(n)]
    runs_before = _run_count(client)
    stats0 = server_stats(client)
    srv0, cpu0, t0 = proc_cpu_s(server_pid), time.process_time(), time.perf_counter()
    if case == "plain enqueue":
        for i in range(n):
            ops.enqueue(runs, rq, ops.RunRequest("bb_plain", payloads[i], f"p{round_no}-{i}"))
    else:
        source = "bb-batched" if case == "batched event" else "bb-single"
        for i in range(n):
            events.send(source, f"r{round_no}-{i}", payload=payloads[i])
    wall = time.perf_counter() - t0
    cpu, srv = time.process_time() - cpu0, proc_cpu_s(server_pid) - srv0
    stats = server_stats(client).minus(stats0)
    started = _run_count(client) - runs_before
    return {"per_s": n / wall, "cpu_us": cpu / n * 1e6, "srv_us": srv / n * 1e6,
            "commands": (stats.commands - 2) / n, "runs_per_1000": started / n * 1000}


def _run_count(client: redis.Redis) -> int:
    count = 0
    for _ in client.scan_iter(match="*:run:*", count=5000):
        count += 1
    return count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-batching-") as tmp:
        server = RedisServer.start(dir=Path(tmp) / "redis", conf=DEFAULT_CONF)
        try:
            client = redis.Redis.from_url(server.url)
            conf = {k: client.config_get(k)[k] for k in ("appendonly", "appendfsync")}
            say(f"bench/batching.py: {args.events:,} items per case per round, {args.rounds} "
                f"rounds; redis {client.info('server')['redis_version']} {conf}; "
                f"{os.cpu_count()} CPUs ({cpu_model()})")
            say(f"  {load_line()}")
            runs = RunStore(open_store(server.url))
            rq = rq_connection(server.url)
            events = Events(runs, rq)
            # Warm-up: scripts loaded, connections open, a batch group created.
            for case in CASES:
                run_case(case, 999, 20, events, runs, rq, server.pid, client)
            results: dict[str, list[dict[str, float]]] = {c: [] for c in CASES}
            for r in range(args.rounds):
                order = CASES[r % 3:] + CASES[:r % 3]
                for case in order:
                    results[case].append(run_case(case, r, args.events, events, runs, rq,
                                                  server.pid, client))
                say(f"  round {r + 1}: " + ", ".join(
                    f"{c} {results[c][-1]['per_s']:,.0f}/s" for c in CASES))
            base = statistics.median(x["per_s"] for x in results[CASES[0]])
            rows = []
            for case in CASES:
                med = {k: statistics.median(x[k] for x in results[case])
                       for k in results[case][0]}
                rows.append([case, f"{med['per_s']:,.0f}", f"{med['per_s'] / base:.2f}x",
                             f"{med['cpu_us']:.0f}", f"{med['srv_us']:.0f}",
                             f"{med['commands']:.1f}", f"{med['runs_per_1000']:.0f}"])
            say("")
            say(table(["path", "items/s", "vs plain", "client CPU us/item",
                       "redis CPU us/item", "commands/item", "runs per 1,000"], rows))
            say(f"  {load_line()}")
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"total {time.monotonic() - started:.0f} s")
    sys.exit(code)
