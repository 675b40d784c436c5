"""A step retried after 100 ms: waiting in the worker against parking the run.

    .venv/bin/python bench/retry_park.py [--runs 40] [--rounds 3]

Starts its own redis-server from ops/redis.conf (appendonly yes, appendfsync always), one
`marbles-rq controller` and two forking `marbles-rq worker`s on bench/retry_park_flows.py:
one with MARBLES_RETRY_INLINE_MS=1000 (the 100 ms wait is slept in the worker: `inline`), one
with 0 (the run parks on a durable timer and the controller wakes it: `parked`). A `plain`
run of one step that does not fail is the baseline. In interleaved rounds, each way runs
`--runs` runs one after the other (enqueue -> final), and the bench prints per run: the wall
time from enqueue to success, its part beyond the 100 ms wait, the CPU of the worker (its
work-horses included) and of the controller, and Redis commands; then the ratios against
`plain` and `inline` measured in the same rounds. Nothing asserts; it prints.
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

from bench.runs_util import CLK_TCK, Procs, _stat, load_line, median, server_stats, table
from marbles_rq.engine import ops
from marbles_rq.engine.authoring import load_source
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport import dispatch
from tests.redis_procs import RedisServer

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FLOWS = ROOT / "bench" / "retry_park_flows.py"
WAYS = {"plain": "rp_plain", "inline": "rp_inline", "parked": "rp_parked"}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its reaped children (RQ's work-horses)."""
    fields = _stat(pid)
    if fields is None:
        return float("nan")
    return sum(int(f) for f in fields[11:15]) / CLK_TCK


def wait_until(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.002)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load_source(str(FLOWS))
    with tempfile.TemporaryDirectory(prefix="mrq-retry-bench-") as tmp:
        server = RedisServer.start(dir=Path(tmp) / "redis")
        url = server.url
        env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
        env.update(MARBLES_REDIS_URL=url, PYTHONUNBUFFERED="1")
        (Path(tmp) / "logs").mkdir()
        procs = Procs(Path(tmp) / "logs", env)
        base = [str(BIN / "marbles-rq"), "--redis-url", url, "--source", str(FLOWS)]
        try:
            ctl = procs.start("controller", [*base, "controller", "--interval", "0.2"])
            procs.env = {**env, "MARBLES_RETRY_INLINE_MS": "1000"}
            inline = procs.start("worker-inline", [*base, "worker", "--queues", "rp_inline",
                                                   "--log-level", "WARNING"])
            procs.env = {**env, "MARBLES_RETRY_INLINE_MS": "0"}
            parked = procs.start("worker-parked", [*base, "worker", "--queues", "rp_parked",
                                                   "--log-level", "WARNING"])
            r = redis.Redis.from_url(url)
            wait_until(lambda: r.scard("rq:workers") >= 2, 60, "the workers")
            runs = RunStore(open_store(url))
            rq = dispatch.rq_connection(url)
            worker_of = {"plain": inline, "inline": inline, "parked": parked}
            got: dict[str, dict[str, list[float]]] = {
                w: {"wall": [], "cpu_w": [], "cpu_c": [], "cmds": []} for w in WAYS}
            n = 0
            for rnd in range(args.rounds):
                for way, name in WAYS.items():
                    walls = []
                    w_cpu, c_cpu = tree_cpu_s(worker_of[way].pid), tree_cpu_s(ctl.pid)
                    before = server_stats(r)
                    for _ in range(args.runs):
                        n += 1
                        run_id = f"{way}-{rnd}-{n}"
                        t0 = time.perf_counter()
                        ops.enqueue(runs, rq, ops.RunRequest(name, b"null", run_id))
                        key = runs.keys.run(run_id)
                        wait_until(lambda key=key: r.hget(key, "status") == b"succeeded", 60,
                                   run_id)
                        walls.append((time.perf_counter() - t0) * 1000)
                    stats = server_stats(r).minus(before)
                    got[way]["wall"].append(median(walls))
                    got[way]["cpu_w"].append((tree_cpu_s(worker_of[way].pid) - w_cpu)
                                             * 1000 / args.runs)
                    got[way]["cpu_c"].append((tree_cpu_s(ctl.pid) - c_cpu) * 1000 / args.runs)
                    # Less the bench's own polling of the run's status (HGET).
                    got[way]["cmds"].append((stats.commands - stats.calls.get("hget", 0))
                                            / args.runs)
            print(f"retry_park: {args.runs} runs x {args.rounds} rounds per way; "
                  f"{load_line()}")
            rows = []
            for way in WAYS:
                g = {k: median(v) for k, v in got[way].items()}
                beyond = g["wall"] - (0 if way == "plain" else 100)
                rows.append([way, f"{g['wall']:.1f}", f"{beyond:.1f}", f"{g['cpu_w']:.1f}",
                             f"{g['cpu_c']:.1f}", f"{g['cmds']:.0f}"])
            print(table(["way", "wall ms (median)", "beyond the 100 ms wait", "worker CPU ms/run",
                         "controller CPU ms/run", "Redis commands/run"], rows))
            m = {w: {k: median(v) for k, v in got[w].items()} for w in WAYS}
            print(f"parked / inline: wall beyond the wait "
                  f"{(m['parked']['wall'] - 100) / max(0.1, m['inline']['wall'] - 100):.2f}x, "
                  f"worker CPU {m['parked']['cpu_w'] / max(0.01, m['inline']['cpu_w']):.2f}x, "
                  f"commands {m['parked']['cmds'] / max(1, m['inline']['cmds']):.2f}x; "
                  f"inline / plain worker CPU "
                  f"{m['inline']['cpu_w'] / max(0.01, m['plain']['cpu_w']):.2f}x")
        finally:
            strays = procs.cleanup()
            server.stop()
            if strays:
                print(f"strays left: {strays}")


if __name__ == "__main__":
    main()
