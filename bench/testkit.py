"""Benchmark (not a test): what a step costs in the test kit (marbles_rq.testing: the
executor in memory, on a virtual clock) against the same workflow on a real worker.

Run from the repo root::

    .venv/bin/python -m bench.testkit [--runs 150] [--rounds 3]

One durable ``redis-server`` (``ops/redis.conf``: appendfsync always). Each round, in turn:
``--runs`` runs of ``one_step`` and ``--runs // 2`` of ``ten_steps`` (bench/runs_flows.py:
trivial steps, no retries) pre-enqueued and drained by one ``marbles-rq worker --burst
--pool 1`` (non-forking: the kit does not fork either), timed from its first dequeue to the
last settle, its CPU (user+sys, minus an idle burst's start-up and shutdown) per run; then
the same numbers of runs started in an ``Environment`` and delivered by
``run_until_idle()`` (wall and this process's CPU per run). Per step = (ten_steps -
one_step) / 9 per run: what one more step adds. The ratio is kit / worker. The kit's CPU is
this process's, the worker's is the worker's (the redis-server's own CPU is left out).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from marbles_rq.engine.authoring import load_source

from .runs import QUICK, Bench, drain, idle_cpu
from .runs_util import load_line, median, ratio, table

FLOWS = "bench/runs_flows.py"


def say(text: str = "") -> None:
    print(text, flush=True)


def worker_side(b: Bench, workflow: str, n: int, idle_s: float) -> tuple[float, float]:
    """(wall s, worker CPU s) per run of `workflow` on a real worker."""
    b.reset()
    b.fill_marbles(workflow, n)
    done = drain(b, f"worker-{workflow}", b.marbles_worker(pool=True), n)
    if done.finished < n:
        raise RuntimeError(f"{workflow}: {done.finished} of {n} runs finished")
    return done.seconds / n, max(0.0, done.worker_cpu_s - idle_s) / n


def kit_side(workflow: str, n: int) -> tuple[float, float]:
    """(wall s, CPU s) per run of `workflow` in a test kit Environment."""
    from marbles_rq.testing import Environment

    env = Environment(schedules=False)
    handles = [env.start(workflow) for _ in range(n)]
    wall, cpu = time.perf_counter(), time.process_time()
    env.run_until_idle()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if any(h.status().status != "succeeded" for h in handles):
        raise RuntimeError(f"{workflow}: not every kit run succeeded")
    return wall / n, cpu / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load_source(FLOWS)
    say(f"# bench.testkit: {' '.join(sys.argv)}")
    say(f"# {load_line()}")
    sizes = {"one_step": args.runs, "ten_steps": max(2, args.runs // 2)}
    samples: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-testkit-") as tmp:
        b = Bench(QUICK, Path(tmp))
        try:
            b.reset()
            idle_s = idle_cpu(b, "worker", b.marbles_worker(pool=True))
            kit_side("one_step", 5)  # imports and first-call costs, not counted
            for round_no in range(1, args.rounds + 1):
                for side in ("worker", "kit"):
                    for workflow, n in sizes.items():
                        wall, cpu = (worker_side(b, workflow, n, idle_s) if side == "worker"
                                     else kit_side(workflow, n))
                        samples.setdefault((side, workflow, "wall"), []).append(wall)
                        samples.setdefault((side, workflow, "cpu"), []).append(cpu)
                say(f"  round {round_no}: done")
        finally:
            strays = b.procs.cleanup()
            b.server.stop()
            if strays:
                say(f"  ! processes still alive after cleanup: {strays}")

    def per(side: str, what: str) -> tuple[float, float, float]:
        one = median(samples[(side, "one_step", what)]) * 1000
        ten = median(samples[(side, "ten_steps", what)]) * 1000
        return one, ten, (ten - one) / 9

    rows = []
    for what, label in (("wall", "wall ms"), ("cpu", "CPU ms")):
        w, k = per("worker", what), per("kit", what)
        rows.append([f"one_step run, {label}", f"{w[0]:.3f}", f"{k[0]:.3f}", ratio(k[0], w[0])])
        rows.append([f"ten_steps run, {label}", f"{w[1]:.3f}", f"{k[1]:.3f}",
                     ratio(k[1], w[1])])
        rows.append([f"per step, {label}", f"{w[2]:.3f}", f"{k[2]:.3f}", ratio(k[2], w[2])])
    say()
    say(f"medians of {args.rounds} rounds; {sizes['one_step']} one_step and "
        f"{sizes['ten_steps']} ten_steps runs per side per round")
    say(table(["", "worker (--pool 1)", "test kit", "kit / worker"], rows))


if __name__ == "__main__":
    main()
