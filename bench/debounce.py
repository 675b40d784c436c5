"""Benchmark (not a test): enqueues/s of debounced, throttled and singleton workflows next
to plain enqueue, in one run.

Run from the repo root::

    .venv/bin/python -m bench.debounce [--enqueues 500] [--rounds 3]

One sample is one ``client.start(workflow, input)`` from this process (sequential, one
connection pool), against a durable redis-server (``ops/redis.conf``: appendonly yes,
appendfsync always) the bench starts in a temporary directory; no worker runs (what is
measured is the enqueue). The rows, each ``--enqueues`` starts per round, interleaved round
by round so every row sees the same load:

- ``plain``: no gate (the run is recorded and its first delivery pushed, one script call);
- ``debounce merge``: every start merges into one open window (one key);
- ``debounce open``: every start opens a window (a new key each time: a run id solved into
  the key's bucket, the window written);
- ``debounce reduce``: merges with a reducer (a compare-and-set: a read of the window's
  input in the conflict reply, then the write);
- ``throttle started``: let through by the throttle, then recorded as plain;
- ``throttle dropped``: refused by the throttle (nothing recorded);
- ``singleton skipped``: the key's run is unfinished (nothing recorded);
- ``singleton started``: a new key each time (the decision, then the record).

Per row: enqueues/s (median round), its ratio to ``plain`` in the same rounds, this
process's CPU per enqueue and redis-server's CPU per enqueue (INFO used_cpu_*).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

import marbles_rq as mr
from marbles_rq.engine.authoring import load_source
from tests.redis_procs import DEFAULT_CONF, RedisServer

from .runs_util import cpu_model, load_line, ratio, table

FLOWS = Path(__file__).with_name("debounce_flows.py")


def _server_cpu(conn: redis.Redis) -> float:
    info: Any = conn.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--enqueues", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load_source(str(FLOWS))
    with tempfile.TemporaryDirectory(prefix="mrq-bench-debounce-") as tmp:
        server = RedisServer.start(dir=Path(tmp) / "redis", conf=DEFAULT_CONF)
        try:
            _bench(server.url, args.enqueues, args.rounds)
        finally:
            server.stop()


def _bench(url: str, n: int, rounds: int) -> None:
    client = mr.connect(url)
    conn = redis.Redis.from_url(url)
    counter = iter(range(10**9))

    def start(workflow: str, customer: Callable[[], str], expect: str) -> Callable[[], None]:
        def one() -> None:
            i = next(counter)
            handle = client.start(workflow, {"customer": customer(), "n": i, "items": [i]})
            outcome = handle.decision.outcome if handle.decision else "started"
            assert outcome == expect, (workflow, outcome)
        return one

    # A throttle that is full, and a singleton whose key's run is unfinished (no worker).
    full = "bench-full"
    client.start("b_throttle_full", {"customer": full})
    client.start("b_singleton", {"customer": "bench-one"})
    rows: dict[str, Callable[[], None]] = {
        "plain": start("b_plain", lambda: "c", "started"),
        "debounce merge": start("b_debounce", lambda: "one-key", "merged"),
        "debounce open": start("b_debounce", lambda: f"k{next(counter)}", "started"),
        "debounce reduce": start("b_reduce", lambda: "one-key", "merged"),
        "throttle started": start("b_throttle", lambda: "t", "started"),
        "throttle dropped": start("b_throttle_full", lambda: full, "dropped"),
        "singleton skipped": start("b_singleton", lambda: "bench-one", "skipped"),
        "singleton started": start("b_singleton", lambda: f"s{next(counter)}", "started"),
    }
    # Warm-up: scripts loaded, the merge rows' windows opened (their first start opens).
    for name, row in rows.items():
        for i in range(20):
            try:
                row()
            except AssertionError:
                if not (name.endswith("merge") or name.endswith("reduce")) or i:
                    raise
    rates: dict[str, list[float]] = {k: [] for k in rows}
    cpu: dict[str, list[float]] = {k: [] for k in rows}
    server: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(rounds):
        for name, row in rows.items():
            s0, c0, t0 = _server_cpu(conn), time.process_time(), time.perf_counter()
            for _ in range(n):
                row()
            t1, c1, s1 = time.perf_counter(), time.process_time(), _server_cpu(conn)
            rates[name].append(n / (t1 - t0))
            cpu[name].append((c1 - c0) / n * 1e6)
            server[name].append((s1 - s0) / n * 1e6)
    base = statistics.median(rates["plain"])
    print(f"bench.debounce: {n} enqueues per row per round, {rounds} rounds interleaved; "
          f"redis {conn.info('server')['redis_version']}, appendfsync "
          f"{conn.config_get('appendfsync')['appendfsync']}; {cpu_model()}; {load_line()}")
    print(f"command: {' '.join(sys.argv)}")
    print(table(["row", "enqueues/s", "vs plain", "client CPU us/enq", "redis CPU us/enq"],
                [[name, f"{statistics.median(rates[name]):.0f}",
                  ratio(statistics.median(rates[name]), base),
                  f"{statistics.median(cpu[name]):.0f}",
                  f"{statistics.median(server[name]):.0f}"] for name in rows]))


if __name__ == "__main__":
    main()
