"""Signal latency: a signal sent to a parked run -> the run's next step started.

    .venv/bin/python bench/signal_latency.py [--signals 200] [--modes fork,pool]

Starts its own redis-server from ops/redis.conf (appendonly yes, appendfsync always) in a
temporary directory, a `marbles-rq controller` and, per mode, one `marbles-rq worker`
(fork: RQ's forking work-horse per delivery, the default; pool: `--pool 1`, a non-forking
executor), all on tests/signal_workflows.py. One `sg_pingpong` run waits for signal "ping"
`--signals` times; after each it runs a step that stamps its start time (time.time(), the
same host's clock as the sender's). For each signal the driver waits until the run is
parked (status waiting: no worker holds it), then sends the signal through the engine
function (`send_signal`: one script appends it and wakes the run, then the delivery is
enqueued on RQ, as `marbles-rq signal` does minus process start-up) and measures send ->
that step's start. Goal: p99 <= 50 ms on a quiet box. Nothing asserts; it prints.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from bench.runs_util import Procs, descendants, load_line, median, pct
from marbles_rq.engine import ops
from marbles_rq.engine.authoring import load_source
from marbles_rq.engine.runs import RunStore
from marbles_rq.engine.signals import send_signal
from marbles_rq.store import open_store
from marbles_rq.transport import dispatch
from tests.redis_procs import RedisServer

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FLOWS = ROOT / "tests" / "signal_workflows.py"


def wait_until(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.001)


def measure(url: str, procs: Procs, mode: str, n: int) -> list[float]:
    r = redis.Redis.from_url(url)
    runs = RunStore(open_store(url))
    rq = dispatch.rq_connection(url)
    argv = [str(BIN / "marbles-rq"), "--redis-url", url, "--source", str(FLOWS), "worker",
            "--log-level", "WARNING", *(["--pool", "1"] if mode == "pool" else [])]
    worker = procs.start(f"worker-{mode}", argv)
    wait_until(lambda: any(int(m.decode().rsplit(".", 1)[-1]) in {worker.pid,
                                                                   *descendants(worker.pid)}
                           for m in r.smembers("rq:workers")
                           if m.decode().rsplit(".", 1)[-1].isdigit()),
               60, f"the {mode} worker")
    run_id = f"ping-{mode}"
    ops.enqueue(runs, rq, ops.RunRequest("sg_pingpong", f'{{"n": {n}}}'.encode(), run_id))
    run_key = runs.keys.run(run_id)
    stamps = f"sg:stamp:{run_id}"
    out: list[float] = []
    for i in range(n):
        wait_until(lambda: r.hget(run_key, "status") == b"waiting", 60, f"park {i}")
        sent = time.time()
        send_signal(runs, run_id, "ping", i, rq=rq)
        got = r.blpop([stamps], timeout=30)
        if got is None:
            raise SystemExit(f"signal {i}: the step never started\n{worker.tail()}")
        index, started = got[1].decode().split(":")
        assert int(index) == i
        out.append((float(started) - sent) * 1000)
    procs.stop(worker)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--signals", type=int, default=200)
    parser.add_argument("--modes", default="fork,pool")
    args = parser.parse_args()
    load_source(str(FLOWS))
    with tempfile.TemporaryDirectory(prefix="mrq-signal-bench-") as tmp:
        server = RedisServer.start(dir=Path(tmp) / "redis")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
        env.update(MARBLES_REDIS_URL=server.url, PYTHONUNBUFFERED="1")
        (Path(tmp) / "logs").mkdir()
        procs = Procs(Path(tmp) / "logs", env)
        try:
            procs.start("controller", [str(BIN / "marbles-rq"), "--redis-url", server.url,
                                       "--source", str(FLOWS), "controller", "--interval",
                                       "0.5"])
            print(f"signal -> next step started, {args.signals} signals per mode; "
                  f"{load_line()}")
            for mode in args.modes.split(","):
                lat = measure(server.url, procs, mode, args.signals)
                print(f"  {mode:5s} p50 {median(lat):6.1f} ms   p99 {pct(lat, 99):6.1f} ms   "
                      f"max {max(lat):6.1f} ms   (n={len(lat)})")
        finally:
            strays = procs.cleanup()
            server.stop()
            if strays:
                print(f"strays left: {strays}")


if __name__ == "__main__":
    main()
