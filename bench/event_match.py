"""What sending one event costs while many runs wait for events of other match values.

    .venv/bin/python bench/event_match.py [--levels 0,1000,10000] [--sends 200]
                                          [--deliveries 15] [--hot 2000]

Starts its own redis-server from ops/redis.conf (appendonly yes, appendfsync always) in a
temporary directory and one `marbles-rq worker` on bench/event_match_flows.py. Then:

1. parks `--deliveries` x (number of levels) real runs, each waiting (ctx.wait_for_event) for a
   "shop"/"paid" event with its own `order`;
2. for each level N of `--levels`: brings the index to N waits on *other* order values, then
   times `Events.send` (the whole path of `marbles-rq events send` minus process start-up:
   validate, journal, note the event, deliver) for
   - `--sends` events that match no wait, and
   - `--deliveries` events that each match one of the real parked runs (the send includes
     delivering the event to it and enqueueing its wake), plus the time from the send to the
     woken run's final event;
3. a contrast: `--hot` waits that share the event's own term (the same order, a second match
   field the event does not have): what an event costs when the waits under its term do
   not match, i.e. the cost grows with the waits sharing its term, not with all waits.

The N waits of step 2 are written with the script a real wait writes (add_event_wait, the
same spec); they are not parked runs (parking 10,000 real runs takes minutes on a small
machine), and an event that does not match them never reads their runs: only the index
entries under the event's own terms are read. Nothing asserts; it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec
import redis

import bench.event_match_flows  # noqa: F401  (registers em_wait here: runs are validated)
from bench.runs_util import Procs, cpu_model, load_line, pct
from marbles_rq.engine import ops
from marbles_rq.engine.event_waits import _spec_key, _term_keys, wait_term
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport import dispatch
from marbles_rq.triggers.events import Events
from tests.redis_procs import RedisServer

ROOT = Path(__file__).resolve().parent.parent
FLOWS = ROOT / "bench" / "event_match_flows.py"
BIN = Path(sys.executable).parent


def seed(runs: RunStore, start: int, stop: int, match: dict[str, str] | None = None) -> None:
    """Index waits start..stop-1 as add_event_wait does for a real wait (pipelined)."""
    calls = []
    for i in range(start, stop):
        m = match or {"order": f"other-{i}"}
        run_id, key = f"seeded-{i}" if match is None else f"hot-{i}", "em_wait.|event#0"
        spec = {"run": run_id, "key": key, "seq": 0, "source": "shop", "type": "paid",
                "match": m}
        calls.append(([_term_keys(runs.keys, wait_term("shop", "paid", m))[1],
                       _spec_key(runs.keys)],
                      [f"{run_id}|{key}", msgspec.json.encode(spec)]))
    for i in range(0, len(calls), 2000):
        runs.scripts.call_many("add_event_wait", calls[i:i + 2000])


def server_usec(r: redis.Redis) -> int:
    """Microseconds the server has spent executing commands (INFO commandstats): the work
    behind a send, less swayed than wall-clock times by other load on a shared machine."""
    stats = r.info("commandstats")
    return sum(int(v["usec"]) for v in stats.values())


def ms(values: list[float]) -> str:
    return f"p50 {pct(values, 50):7.2f} ms  p99 {pct(values, 99):7.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="0,1000,10000")
    parser.add_argument("--sends", type=int, default=200)
    parser.add_argument("--deliveries", type=int, default=15)
    parser.add_argument("--hot", type=int, default=2000)
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    with tempfile.TemporaryDirectory(prefix="bench-evm-") as tmp_name:
        tmp = Path(tmp_name)
        server = RedisServer.start(dir=tmp / "redis")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
        env.update(MARBLES_REDIS_URL=server.url, PYTHONUNBUFFERED="1")
        (tmp / "logs").mkdir()
        procs = Procs(tmp / "logs", env)
        try:
            run(server.url, procs, levels, args)
        finally:
            procs.cleanup()
            server.stop()


def run(url: str, procs: Procs, levels: list[int], args: argparse.Namespace) -> None:
    r = redis.Redis.from_url(url)
    rq = dispatch.rq_connection(url)
    runs = RunStore(open_store(url))
    events = Events(runs, rq)
    print(f"# bench/event_match.py {' '.join(sys.argv[1:])}")
    print(f"# redis {r.info('server')['redis_version']}, appendfsync "
          f"{r.config_get('appendfsync')['appendfsync']}; {cpu_model()}, {os.cpu_count()} CPUs;"
          f" {load_line()}")
    procs.start("worker", [str(BIN / "marbles-rq"), "--redis-url", url, "--source", str(FLOWS),
                           "worker", "--log-level", "WARNING"])
    real = [f"real-{i}" for i in range(args.deliveries * len(levels))]
    ops.enqueue_many(runs, rq, [ops.RunRequest("em_wait", json.dumps(f"order-{rid}").encode(),
                                               rid) for rid in real])
    deadline = time.monotonic() + 300
    while True:
        pipe = r.pipeline(transaction=False)
        for rid in real:
            pipe.hget(runs.keys.run(rid), "status")
        if all(s == b"waiting" for s in pipe.execute()):
            break
        if time.monotonic() > deadline:
            raise SystemExit("the real runs did not all park within 300 s:\n"
                             + procs.children[0].tail())
        time.sleep(0.1)
    print(f"{len(real)} real runs parked, each waiting for its own order\n")

    seeded, n = 0, 0
    print(f"{'waits on other values':>21} | {'send, matching no wait':<31} | server "
          f"| {'send, waking one parked run':<31} | send -> that run's final event")
    for level in levels:
        seed(runs, seeded, level)
        seeded = max(seeded, level)
        none: list[float] = []
        before = server_usec(r)
        for _ in range(args.sends):
            n += 1
            payload = json.dumps({"order": f"nobody-{n}", "amount": 1}).encode()
            t0 = time.perf_counter()
            events.send("shop", f"e-{n}", type="paid", payload=payload)
            none.append((time.perf_counter() - t0) * 1000)
        server = (server_usec(r) - before) / args.sends
        woke: list[float] = []
        finals: list[float] = []
        batch = real[:args.deliveries]
        real = real[args.deliveries:]
        for rid in batch:
            n += 1
            payload = json.dumps({"order": f"order-{rid}"}).encode()
            last = r.xrevrange(runs.keys.output(rid), count=1)
            after = last[0][0].decode() if last else "0-0"
            t0 = time.perf_counter()
            sent = events.send("shop", f"e-{n}", type="paid", payload=payload)
            woke.append((time.perf_counter() - t0) * 1000)
            assert sent.delivered == (rid,), sent
            done = False
            while not done:
                for entry in runs.output(rid, after=after, block_ms=2000):
                    after = entry.id
                    done = done or entry.type == "final"
            finals.append((time.perf_counter() - t0) * 1000)
        print(f"{level:>21,} | {ms(none)} | {server:4.0f} µs | {ms(woke)} | {ms(finals)}")

    hot = {"order": "hot", "sku": "none-of-them"}
    print("\ncontrast: waits sharing the event's own term (order \"hot\", plus a field the "
          "event lacks)")
    for count in (0, args.hot // 10, args.hot):
        if count:
            seed(runs, 0, count, hot)
        times = []
        before = server_usec(r)
        for _ in range(max(20, args.sends // 5)):
            n += 1
            t0 = time.perf_counter()
            events.send("shop", f"e-{n}", type="paid",
                        payload=json.dumps({"order": "hot"}).encode())
            times.append((time.perf_counter() - t0) * 1000)
        server = (server_usec(r) - before) / len(times)
        print(f"{count:>6,} waits under the event's term: send {ms(times)}; server "
              f"{server:.0f} µs per send")


if __name__ == "__main__":
    main()
