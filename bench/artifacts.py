"""What an artifact put and get cost, at 1 KB and 10 MB:

    .venv/bin/python -m bench.artifacts [--small-n 300] [--large-n 8] [--large-mb 10]

Starts its own durable redis-server (ops/redis.conf: appendonly, appendfsync always) in a
temporary directory, then, from one client in this process:

* **put** of fresh content (a new blob each time: the blob's pipeline SADD + SET NX, then
  put_artifact.lua): latency p50/p99 and MB/s;
* **put of identical content** (the blob exists: SET NX writes nothing; a new version
  still is);
* **get** of the latest version (HGET latest, HGET v:<n>, GET of the blob);
* the baseline: a plain ``SET key <bytes>`` of the same size on the same server (what RQ
  does to store a job's payload), and the ratio put / SET.

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import marbles_rq as mr
from tests.redis_procs import RedisServer


def _timed(fn: Callable[[int], object], n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def _row(label: str, size: int, times: list[float], base: list[float] | None = None) -> str:
    p50 = statistics.median(times)
    p99 = sorted(times)[min(len(times) - 1, int(len(times) * 0.99))]
    mbs = size / p50 / 1e6
    ratio = "" if base is None else f"  {p50 / statistics.median(base):5.2f}x SET"
    return (f"{label:<34} n={len(times):<4} p50 {p50 * 1000:8.2f} ms  p99 "
            f"{p99 * 1000:8.2f} ms  {mbs:8.1f} MB/s{ratio}")


def _measure(client: mr.Client, raw: Any, label: str, size: int, n: int) -> None:
    contents = [os.urandom(size) for _ in range(n)]
    art = client.artifact(f"bench-{size}")
    art.put(b"warm-up")
    raw.set("warm", b"x")
    base = _timed(lambda i: raw.set(f"bench:set:{size}:{i}", contents[i]), n)
    puts = _timed(lambda i: art.put(contents[i]), n)
    same = _timed(lambda i: art.put(contents[0]), n)
    gets = _timed(lambda i: art.get(i + 2), n)
    assert art.get(2) == contents[0]  # a sanity check of the read, not a test
    print(f"-- {label} ({size:,} bytes)")
    print(_row("SET (baseline, RQ's payload write)", size, base))
    print(_row("artifact put, new content", size, puts, base))
    print(_row("artifact put, identical content", size, same, base))
    print(_row("artifact get (by version)", size, gets))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small-n", type=int, default=300)
    parser.add_argument("--large-n", type=int, default=8)
    parser.add_argument("--large-mb", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-artifacts-") as tmp:
        server = RedisServer.start(dir=Path(tmp))
        try:
            raw = server.client(decode_responses=False)
            fsync = server.client().config_get("appendfsync").get("appendfsync", "?")
            print(f"redis {raw.info()['redis_version']}  appendfsync {fsync}  "
                  f"cpus {os.cpu_count()}  python {sys.version.split()[0]}")
            client = mr.connect(server.url)
            for label, size, n in (("1 KB", 1024, args.small_n),
                                   (f"{args.large_mb} MB", args.large_mb << 20, args.large_n)):
                _measure(client, raw, label, size, n)
            client.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
