"""Controller failover: how long after kill -9 of the leading controller a standby leads.

    .venv/bin/python bench/failover.py [--kills 10] [--ttls 10000,2000]

Starts its own durable redis-server and two `marbles-rq controller` processes per lease
TTL. For each kill: find the leader, SIGKILL it, time until the standby holds the lease
(polled every 20 ms from this process, reading the lease as `marbles-rq leader` does), then
start a fresh standby in place of the killed one, as a supervisor would. Prints p50 and max
per TTL, and the ratio to the TTL. Nothing asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from marbles_rq.controller.loop import LEASE_NAME
from marbles_rq.store import open_store
from tests.procs import HOSTNAME, Procs
from tests.redis_procs import RedisServer


def measure(url: str, workdir: Path, ttl_ms: int, kills: int) -> list[float]:
    procs = Procs(url, workdir, sources=())
    store = open_store(url)
    try:
        live = [procs.controller(lease_ms=ttl_ms, ready=False) for _ in range(2)]
        live[0].wait_log("controller ")
        live[1].wait_log("controller ")
        times: list[float] = []
        for _ in range(kills):
            info = None
            while info is None:
                info = store.lease_holder(LEASE_NAME)
                time.sleep(0.02)
            leader = next(p for p in live if info.token.startswith(f"{HOSTNAME}:{p.pid}:"))
            standby = next(p for p in live if p is not leader)
            leader.kill9()
            killed = time.monotonic()
            while True:
                now = store.lease_holder(LEASE_NAME)
                if now is not None and now.token.startswith(f"{HOSTNAME}:{standby.pid}:"):
                    break
                time.sleep(0.02)
            times.append(time.monotonic() - killed)
            fresh = procs.controller(lease_ms=ttl_ms, ready=False)
            fresh.wait_log("controller ")
            live = [standby, fresh]
        return times
    finally:
        procs.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--ttls", default="10000,2000")
    args = parser.parse_args()
    print("marbles-rq controller failover benchmark")
    print(f"command  : python bench/failover.py --kills {args.kills} --ttls {args.ttls}")
    with tempfile.TemporaryDirectory(prefix="marbles-bench-failover-") as tmp:
        server = RedisServer.start(dir=Path(tmp) / "redis")
        try:
            for ttl in (int(t) for t in args.ttls.split(",")):
                times = measure(server.url, Path(tmp) / f"procs-{ttl}", ttl, args.kills)
                p50, worst = statistics.median(times), max(times)
                print(f"lease {ttl:>6} ms, {len(times)} kills: kill -9 -> standby leads "
                      f"p50 {p50:.2f} s, max {worst:.2f} s ({worst * 1000 / ttl:.2f}x TTL; "
                      f"aim <= TTL + 1 s: {'met' if worst <= ttl / 1000 + 1 else 'NOT MET'})")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
