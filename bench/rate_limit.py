"""What a rate limit costs a run, and how exact it is:

    .venv/bin/python -m bench.rate_limit [--quick] [--rounds 3] [--paced 400]

1. **Cost per admitted run**: Redis commands, round trips and fsyncs per one-step run, end to
   end (enqueue one at a time, then one ``--burst`` worker, ``--pool 1``, runs them all), as
   ``bench.flowctl`` measures them (the difference between a large and a small batch, so
   fixed costs cancel): no limit (the baseline), ``rate_limit="1000000/s"`` (never binds),
   and ``mr.rate_limit(...)`` inside the body (never binds).
2. **Throughput, limited vs unlimited, same run**: interleaved rounds of N runs each, one
   ``--burst --pool 1`` worker per round; runs/s and the worker's CPU per run (its children's
   rusage), and the ratio to the baseline of the same round.
3. **Accuracy**: ``rate_limit="20/s"`` over ``--paced`` runs enqueued at once, a controller
   and a ``--pool 2`` worker: the most step starts (recorded server-side) in any one-second
   window (half-open), the achieved rate, and deliveries per admitted run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import transport as tb
from marbles_rq.engine import ops
from marbles_rq.engine.authoring import load_source

FLOWS = "bench/rate_limit_flows.py"


def _burst(b: tb.Bench, pool: int = 1) -> Callable[[], None]:
    def go() -> None:
        child = b.procs.start("rate", b.marbles_worker(pool))
        try:
            child.proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            b.procs.kill(child)
            raise tb.BenchError(f"worker hung\n{child.tail()}") from None
    return go


def _fill(b: tb.Bench, name: str, n: int) -> None:
    for start in range(0, n, 500):
        ops.enqueue_many(b.runs, b.rq, [ops.RunRequest(name) for _ in range(min(500,
                                                                               n - start))])


def section_cost(b: tb.Bench, tmp: Path) -> None:
    sizes = b.sizes
    d = sizes.large - sizes.small
    rows = []
    for label, name in [("no rate limit", "rl_plain"),
                        ("rate_limit=1000000/s (never binds)", "rl_loose"),
                        ("mr.rate_limit in the body (never binds)", "rl_inner_loose")]:
        def enqueue(name: str = name) -> None:
            ops.enqueue(b.runs, b.rq, ops.RunRequest(name))

        (small, top0, _, fs0), (large, top1, _, fs1) = [
            tb.measure(b, tmp, n, enqueue, _burst(b)) for n in (sizes.small, sizes.large)]
        top = {k: (v - top0.get(k, 0)) / d for k, v in top1.items()}
        commands = (sum(large.calls.values()) - sum(small.calls.values())) / d
        fsyncs = None if fs0 is None or fs1 is None else (fs1 - fs0) / d
        rows.append([label, f"{commands:.1f}", f"{sum(top.values()):.1f}",
                     f"{(large.reads - small.reads) / d:.1f}",
                     "n/a" if fsyncs is None else f"{fsyncs:.1f}",
                     ", ".join(f"{k} {v:.1f}" for k, v in
                               sorted(top.items(), key=lambda kv: -kv[1]) if v >= 0.05)])
    tb.say(f"== 1. per one-step run, --pool 1 burst worker ({sizes.large} - {sizes.small} runs)")
    tb.say(tb.table(["case", "commands", "client commands", "round trips", "fsyncs",
                     "client commands by name"], rows))


def section_throughput(b: tb.Bench, n: int, rounds: int) -> None:
    tb.say(f"== 2. throughput: {n} runs per round, one --burst --pool 1 worker, "
           f"{rounds} interleaved rounds")
    results: dict[str, list[tuple[float, float]]] = {"rl_plain": [], "rl_loose": []}
    for _ in range(rounds):
        for name in results:
            b.reset()
            _fill(b, name, n)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            _burst(b)()
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
            results[name].append((n / wall, cpu / n * 1000))
    rows = []
    base = results["rl_plain"]
    for name, got in results.items():
        rates = sorted(r for r, _ in got)
        cpus = sorted(c for _, c in got)
        ratio = sorted(g[0] / p[0] for g, p in zip(got, base, strict=True))
        rows.append([name, f"{rates[len(rates) // 2]:.0f}", f"{cpus[len(cpus) // 2]:.2f}",
                     f"{ratio[len(ratio) // 2]:.2f}x"])
    tb.say(tb.table(["workflow", "runs/s (median)", "worker CPU ms/run", "vs no limit "
                     "(median of rounds)"], rows))


def section_accuracy(b: tb.Bench, n: int) -> None:
    tb.say(f"== 3. accuracy: rate_limit=20/s, {n} runs enqueued at once, a controller and "
           f"one --pool 2 worker")
    b.reset()
    ctl = b.procs.start("controller", [str(tb.VENV_BIN / "marbles-rq"), "--redis-url", b.url,
                                       "--source", FLOWS, "controller", "--interval", "0.2",
                                       "--log-level", "WARNING"])
    worker = b.procs.start("worker", [str(tb.VENV_BIN / "marbles-rq"), "--redis-url", b.url,
                                      "--source", FLOWS, "worker", "--pool", "2",
                                      "--log-level", "WARNING"])
    try:
        time.sleep(3)  # both import and start listening
        ids = [f"acc-{i}" for i in range(n)]
        ops.enqueue_many(b.runs, b.rq, [ops.RunRequest("rl_paced", run_id=rid) for rid in ids])
        deadline = time.monotonic() + n / 20 * 6 + 60
        while time.monotonic() < deadline:
            pipe = b.r.pipeline(transaction=False)
            for rid in ids:
                pipe.hget(b.runs.keys.run(rid), "status")
            if all(s == b"succeeded" for s in pipe.execute()):
                break
            time.sleep(0.5)
        else:
            raise tb.BenchError("the paced runs did not finish in time")
        starts = []
        deliveries = 0
        for rid in ids:
            for ev in b.runs.output(rid):
                if ev.type == "step_started":
                    starts.append(int(ev.data.get("started_ms") or ev.at_ms))
                    break
            deliveries += int(b.r.hget(b.runs.keys.run(rid), "attempt") or 0)
        starts.sort()
        most, lo = 0, 0
        for hi, t in enumerate(starts):
            while starts[lo] <= t - 1000:
                lo += 1
            most = max(most, hi - lo + 1)
        span = (starts[-1] - starts[0]) / 1000
        tb.say(tb.table(["runs", "rate", "most starts in a 1 s window", "achieved /s",
                         "deliveries per admitted run"],
                        [[str(n), "20/s", str(most), f"{(n - 1) / span:.1f}",
                          f"{deliveries / n:.2f}"]]))
    finally:
        b.procs.kill(worker)
        b.procs.kill(ctl)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paced", type=int, default=400, help="runs of the accuracy section")
    args = parser.parse_args(argv)
    os.chdir(tb.REPO_ROOT)
    tb.FLOWS = FLOWS  # the workers load these workflows
    load_source(FLOWS)
    sizes = tb.QUICK if args.quick else tb.FULL
    tmp = Path(tempfile.mkdtemp(prefix="marbles-bench-rate-"))
    b = tb.Bench(sizes, 1, 1, tmp)
    try:
        section_cost(b, tmp)
        section_throughput(b, 150 if args.quick else 500, args.rounds)
        section_accuracy(b, args.paced)
    except tb.BenchError as exc:
        tb.say(f"BENCHMARK FAILED: {exc}")
        return 1
    finally:
        strays = b.procs.cleanup()
        b.server.stop()
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        tb.say(f"stray processes left: {strays or 'none'}; host load: {tb.load_line()}")
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"total {time.monotonic() - started:.0f} s")
    sys.exit(code)
