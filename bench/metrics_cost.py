"""Benchmark (not a test): what metrics cost the engine's hot path, in CPU time.

Run from the repo root::

    python -m bench.metrics_cost [--runs 300] [--rounds 6]

One durable ``redis-server``; one process records runs of ``one_step`` and ``ten_steps``
(bench/runs_flows.py) and executes them in-process (``execute()``, no RQ), in blocks that
alternate metrics off and on (multiprocess mode, as a worker with ``--metrics-port``: every
value is written to a memory-mapped file). Metrics are switched by the module's own switch,
so both sides run in one process and see the same load. CPU time of this process per run
(``time.process_time``) is less sensitive to other load on the box than wall time; the wall
rate is printed too. Also: the cost of each recording call alone (off, on)."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import timeit
from pathlib import Path

from tests.redis_procs import DEFAULT_CONF, RedisServer

from .runs_util import load_line, median

FLOWS = "bench/runs_flows.py"


def say(text: str = "") -> None:
    print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)

    from marbles_rq import metrics
    from marbles_rq.engine import ops
    from marbles_rq.engine.authoring import REGISTRY, load_source
    from marbles_rq.engine.execute import execute
    from marbles_rq.engine.runs import RunStore
    from marbles_rq.store import open_store

    say(f"host load at start: {load_line()}")
    tmp = Path(tempfile.mkdtemp(prefix="marbles-bench-metrics-"))
    server = RedisServer.start(dir=tmp / "redis", conf=DEFAULT_CONF)
    try:
        load_source(FLOWS)
        runs = RunStore(open_store(server.url))
        # Where a worker's endpoint puts its files (/dev/shm when there is one).
        metrics.enable(multiprocess_dir=metrics.multiprocess_dir("bench", os.getpid() % 65536))
        on = metrics._M
        cpu: dict[tuple[str, bool], list[float]] = {}
        wall: dict[tuple[str, bool], list[float]] = {}
        for rnd in range(args.rounds):
            for workflow in ("one_step", "ten_steps"):
                for enabled in ((False, True) if rnd % 2 == 0 else (True, False)):
                    ids = [runs.record(ops.prepare(ops.RunRequest(workflow))).record.id
                           for _ in range(args.runs)]
                    metrics._M = on if enabled else None
                    c0, w0 = time.process_time(), time.perf_counter()
                    for rid in ids:
                        execute(runs, REGISTRY, rid, 1, worker="bench-metrics",
                                lease_ms=10_000, hard_exit=False)
                    c1, w1 = time.process_time(), time.perf_counter()
                    cpu.setdefault((workflow, enabled), []).append((c1 - c0) / args.runs)
                    wall.setdefault((workflow, enabled), []).append(args.runs / (w1 - w0))
            say(f"  round {rnd + 1}: " + ", ".join(
                f"{w} {'on ' if e else 'off'} {cpu[(w, e)][-1] * 1e3:.3f} ms CPU/run "
                f"{wall[(w, e)][-1]:.0f} runs/s" for w in ("one_step", "ten_steps")
                for e in (False, True)))
        say()
        say("medians over rounds (CPU of the executing process per run; wall runs/s):")
        for workflow in ("one_step", "ten_steps"):
            off_c, on_c = median(cpu[(workflow, False)]), median(cpu[(workflow, True)])
            best = min(cpu[(workflow, False)]), min(cpu[(workflow, True)])
            say(f"  {workflow:9}  off {off_c * 1e3:.3f} ms  on {on_c * 1e3:.3f} ms  "
                f"delta {(on_c - off_c) * 1e6:+.1f} us ({(on_c / off_c - 1) * 100:+.1f} %); "
                f"best rounds off {best[0] * 1e3:.3f} on {best[1] * 1e3:.3f} ms;  "
                f"runs/s off {median(wall[(workflow, False)]):.0f} "
                f"on {median(wall[(workflow, True)]):.0f}")
        say()
        say("one recording call alone (best of 5 x 20,000: the cost without other load):")
        calls = {
            "run_started": lambda: metrics.run_started("one_step"),
            "step_tried": lambda: metrics.step_tried("one_step", "succeeded", 0.0012),
            "run_finished": lambda: metrics.run_finished("one_step", "succeeded", 0.05),
        }
        for name, fn in calls.items():
            row = []
            for enabled in (False, True):
                metrics._M = on if enabled else None
                row.append(min(timeit.repeat(fn, number=20_000, repeat=5)) / 20_000)
            say(f"  {name:13} off {row[0] * 1e6:.2f} us  on {row[1] * 1e6:.2f} us")
        metrics._M = on
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"host load at end: {load_line()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
