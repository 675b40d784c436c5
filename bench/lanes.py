"""What a controller pass costs over idle lanes: commands, Redis time and wall time per pass,
for one controller process leading its share of the lanes.

    .venv/bin/python bench/lanes.py [--buckets 1024] [--lanes 1,16] [--controllers 1,4]
                                    [--passes 20]

Starts its own redis-server from ops/redis.conf in a temporary directory. For each lane
count and controller count it builds, in this process, the lane controllers one controller
process leads (its share: lanes / controllers, at least one), with every duty the
`marbles-rq controller` keeps, unthreaded so that one pass does all of them (redelivery,
lost workers, dispatch checks, RQ's in-flight deliveries, inbound events, waiting runs,
schedules, monitors), wins their leases, recovers, makes a warm-up pass, then `--passes`
passes with nothing due. "commands/pass" is the median over the passes of the INFO
commandstats calls of one pass (after CONFIG RESETSTAT; commands a script calls inside count
too), "max" the largest (a pass that also prunes: every 5 s); "Redis ms" is the server's own
time for the median pass; "wall ms" the median pass in this process, Python included.

Run it with PYTHONPATH pointing at an older checkout to measure that code: a Controller
without lanes is measured with one lane only. Nothing asserts; it prints.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from marbles_rq.controller import Controller
from marbles_rq.controller.waiting import WaitingDuty
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.triggers.events import EventsDuty
from marbles_rq.triggers.monitors import MonitorsDuty
from marbles_rq.triggers.schedules import ScheduleDuty
from tests.redis_procs import RedisServer

HAS_LANES = "lane" in inspect.signature(Controller.__init__).parameters


def commands(client: redis.Redis) -> tuple[int, int]:
    """(calls, usec) over every command since the last CONFIG RESETSTAT, but INFO's own."""
    stats = client.info("commandstats")
    calls = usec = 0
    for name, row in stats.items():
        if name in ("cmdstat_info", "cmdstat_config|resetstat"):
            continue
        calls += int(row["calls"])
        usec += int(row["usec"])
    return calls, usec


def measure(url: str, *, buckets: int, lanes: int, controllers: int, passes: int,
            prefix: str) -> dict[str, Any]:
    store = open_store(url, prefix=prefix, buckets=buckets, **({"lanes": lanes} if HAS_LANES
                                                                 else {}))
    runs = RunStore(store)
    rq = rq_connection(url)
    share = max(1, -(-lanes // controllers))

    def duties() -> list[Any]:
        return [EventsDuty(), WaitingDuty(threaded=False), ScheduleDuty(threaded=False),
                MonitorsDuty()]

    ctls = ([Controller(runs, rq, lane=k, lease_ms=60_000, duties=duties())
             for k in range(share)] if HAS_LANES
            else [Controller(runs, rq, lease_ms=60_000, duties=duties())])
    for ctl in ctls:
        assert ctl.lead()
        ctl.recover()
        ctl.pass_once()  # warm: scripts loaded, first prune and scans made
    client = redis.Redis.from_url(url)
    walls, calls, usecs = [], [], []
    for _ in range(passes):
        client.config_resetstat()
        started = time.perf_counter()
        for ctl in ctls:
            ctl.pass_once()
        walls.append((time.perf_counter() - started) * 1000)
        n, usec = commands(client)
        calls.append(n)
        usecs.append(usec)
    for ctl in ctls:
        if ctl.lease is not None:
            store.release_lease(ctl.lease)
            ctl.lease = None
    led = sum(len(ctl.buckets) for ctl in ctls) if HAS_LANES else buckets
    return {"lanes": lanes, "controllers": controllers, "led_lanes": len(ctls),
            "led_buckets": led, "commands": median(calls), "max": max(calls),
            "redis_ms": median(usecs) / 1000, "wall_ms": median(walls)}


def median(values: list[Any]) -> Any:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buckets", type=int, default=1024)
    parser.add_argument("--lanes", default="1,16")
    parser.add_argument("--controllers", default="1,4")
    parser.add_argument("--passes", type=int, default=20)
    args = parser.parse_args()
    lane_counts = [int(x) for x in args.lanes.split(",")] if HAS_LANES else [1]
    controller_counts = [int(x) for x in args.controllers.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-lanes-") as tmp:
        server = RedisServer.start(dir=Path(tmp) / "redis")
        try:
            info = redis.Redis.from_url(server.url).info("server")
            print(f"redis {info['redis_version']}, buckets {args.buckets}, passes "
                  f"{args.passes}, code {'with' if HAS_LANES else 'without'} lanes "
                  f"({Path(inspect.getfile(Controller)).parent.parent.parent})")
            print(f"{'lanes':>5} {'ctls':>4} {'led':>9} {'commands/pass':>14} {'max':>6} "
                  f"{'per bucket':>10} {'Redis ms':>9} {'wall ms':>8}")
            n = 0
            for lanes in lane_counts:
                for controllers in controller_counts:
                    if controllers > lanes and lanes > 1:
                        continue
                    n += 1
                    row = measure(server.url, buckets=args.buckets, lanes=lanes,
                                  controllers=controllers, passes=args.passes,
                                  prefix=f"b{n}")
                    print(f"{row['lanes']:>5} {row['controllers']:>4} "
                          f"{row['led_lanes']:>3}/{row['led_buckets']:<5} "
                          f"{row['commands']:>14} {row['max']:>6} "
                          f"{row['commands'] / row['led_buckets']:>10.2f} "
                          f"{row['redis_ms']:>9.2f} {row['wall_ms']:>8.1f}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
