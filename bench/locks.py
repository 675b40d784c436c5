"""What a durable mutex (flow/locks.py) costs, on a local durable redis-server
(``appendfsync always``):

    .venv/bin/python -m bench.locks [--quick] [--ops 2000] [--runs 300] [--contend 40]

1. **Scripts, uncontended**: the latency of one acquire_lock, renew_lock and release_lock
   call from this process (p50, p99), against a plain Redis lock (``SET NX PX`` then a
   ``DEL``) as the baseline: what one take plus one give-back costs over it.
2. **A run with a lock, uncontended**: one-step runs with the step inside ``mr.lock`` vs
   the same without, one ``--burst --pool 1`` worker each, interleaved rounds; runs/s and
   the ratio.
3. **Hand-over**: ``--contend`` runs enqueued at once contend for one lock on a controller
   and a ``--pool 2`` worker; each critical section stamps its entry and exit (wall clock,
   one machine). Hand-over = from one section's exit to the next one's entry: the release,
   the waiter's wake (wake_run), its delivery through RQ, its start, its replay to the
   ``with`` and its acquire. Also deliveries per run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import transport as tb
from marbles_rq.engine import ops
from marbles_rq.engine.authoring import load_source

FLOWS = "bench/locks_flows.py"
STAMPS = "bench:lock:stamps"


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def section_scripts(b: tb.Bench, n: int) -> None:
    b.reset()
    locks = b.runs.locks()
    timed: dict[str, list[float]] = {"acquire_lock": [], "renew_lock": [],
                                     "release_lock": [], "SET NX PX": [], "DEL": []}
    for i in range(n + 50):
        keep = i >= 50  # the first calls load the scripts and warm up the connection
        t0 = time.perf_counter()
        asked = locks.acquire("bench", "run-a", 1, 30_000)
        t1 = time.perf_counter()
        locks.renew("bench", "run-a", 1, 30_000)
        t2 = time.perf_counter()
        released = locks.release("bench", "run-a", "1")
        t3 = time.perf_counter()
        b.r.set("bench:plain", "run-a", nx=True, px=30_000)
        t4 = time.perf_counter()
        b.r.delete("bench:plain")
        t5 = time.perf_counter()
        if asked.status != "ok" or released[0] != "ok":
            raise tb.BenchError(f"lock not taken/released: {asked} {released}")
        if keep:
            for name, dt in zip(timed, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4),
                                strict=True):
                timed[name].append(dt * 1e6)
    rows = [[name, f"{_pct(v, 0.5):.0f}", f"{_pct(v, 0.99):.0f}"] for name, v in timed.items()]
    lock_pair = statistics.median(a + r for a, r in zip(timed["acquire_lock"],
                                                        timed["release_lock"], strict=True))
    plain_pair = statistics.median(a + r for a, r in zip(timed["SET NX PX"], timed["DEL"],
                                                         strict=True))
    tb.say(f"== 1. scripts, uncontended, {n} calls each, one client (µs)")
    tb.say(tb.table(["call", "p50 µs", "p99 µs"], rows))
    tb.say(f"take + give back: {lock_pair:.0f} µs (median) vs SET NX PX + DEL "
           f"{plain_pair:.0f} µs: {lock_pair / plain_pair:.2f}x")


def _burst(b: tb.Bench) -> None:
    child = b.procs.start("worker", b.marbles_worker(1))
    try:
        child.proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        b.procs.kill(child)
        raise tb.BenchError(f"worker hung\n{child.tail()}") from None


def section_runs(b: tb.Bench, n: int, rounds: int) -> None:
    tb.say(f"== 2. one-step runs, uncontended: {n} runs per round, one --burst --pool 1 "
           f"worker, {rounds} interleaved rounds")
    got: dict[str, list[float]] = {"lb_plain": [], "lb_locked": []}
    for _ in range(rounds):
        for name in got:
            b.reset()
            b.fill_marbles(name, n)
            t0 = time.perf_counter()
            _burst(b)
            got[name].append(n / (time.perf_counter() - t0))
    ratios = [lk / pl for lk, pl in zip(got["lb_locked"], got["lb_plain"], strict=True)]
    tb.say(tb.table(["workflow", "runs/s (median)", "vs no lock (median of rounds)"],
                    [["lb_plain", f"{statistics.median(got['lb_plain']):.0f}", "1.00x"],
                     ["lb_locked", f"{statistics.median(got['lb_locked']):.0f}",
                      f"{statistics.median(ratios):.2f}x"]]))


def section_handover(b: tb.Bench, n: int) -> None:
    tb.say(f"== 3. hand-over: {n} runs contend for one lock, a controller and one --pool 2 "
           f"worker")
    b.reset()
    base = [str(tb.VENV_BIN / "marbles-rq"), "--redis-url", b.url, "--source", FLOWS]
    ctl = b.procs.start("controller", [*base, "controller", "--interval", "0.2",
                                       "--log-level", "WARNING"])
    worker = b.procs.start("worker", [*base, "worker", "--pool", "2", "--log-level",
                                      "WARNING"])
    try:
        time.sleep(3)  # both import and start listening
        ids = [f"ho-{i}" for i in range(n)]
        ops.enqueue_many(b.runs, b.rq, [ops.RunRequest("lb_contend", run_id=rid)
                                        for rid in ids])
        deadline = time.monotonic() + 30 + n * 2
        while time.monotonic() < deadline:
            if b.statuses(ids).get("succeeded", 0) == n:
                break
            time.sleep(0.2)
        else:
            raise tb.BenchError(f"the runs did not finish: {b.statuses(ids)}")
        stamps = [s.decode().split() for s in b.r.lrange(STAMPS, 0, -1)]
        inside = None
        for ev, rid, _ in stamps:
            if ev == "enter":
                if inside is not None:
                    raise tb.BenchError(f"{rid} entered while {inside} was inside")
                inside = rid
            else:
                inside = None
        exits = [float(at) for ev, _, at in stamps if ev == "exit"]
        enters = [float(at) for ev, _, at in stamps if ev == "enter"]
        gaps = [(e - x) * 1000 for x, e in zip(exits, enters[1:], strict=False)]
        attempts = sum(int(b.r.hget(b.runs.keys.run(rid), "attempt") or 0) for rid in ids)
        tb.say(tb.table(["runs", "hand-overs", "p50 ms", "p90 ms", "max ms",
                         "deliveries per run"],
                        [[str(n), str(len(gaps)), f"{_pct(gaps, 0.5):.1f}",
                          f"{_pct(gaps, 0.9):.1f}", f"{max(gaps):.1f}",
                          f"{attempts / n:.2f}"]]))
    finally:
        b.procs.kill(worker)
        b.procs.kill(ctl)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contend", type=int, default=40)
    args = parser.parse_args(argv)
    os.chdir(tb.REPO_ROOT)
    tb.FLOWS = FLOWS  # the workers load these workflows
    load_source(FLOWS)
    tmp = Path(tempfile.mkdtemp(prefix="marbles-bench-locks-"))
    b = tb.Bench(tb.QUICK if args.quick else tb.FULL, 1, 1, tmp)
    try:
        section_scripts(b, 300 if args.quick else args.ops)
        section_runs(b, 100 if args.quick else args.runs, 1 if args.quick else args.rounds)
        section_handover(b, 15 if args.quick else args.contend)
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
