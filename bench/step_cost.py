"""Benchmark (not a test): what a step costs in Redis round trips and fsyncs.

Run from the repo root::

    python -m bench.step_cost [--runs 200] [--rounds 3] [--baseline /path/to/another/checkout]

One durable ``redis-server`` (``ops/redis.conf``: appendfsync always). For each side (this
checkout, and with ``--baseline`` another one, e.g. the main branch before a change) a child
process imports that side's ``marbles_rq`` (``PYTHONPATH`` = the checkout), records
``--runs`` runs of ``one_step`` and of ``ten_steps`` (``bench/runs_flows.py``: trivial
steps with no retries), then executes them in-process (``execute()``, no RQ, no fork).
Sides alternate within each round, so both see the same load.

Counted over the executions only (recording excluded):
- script calls per run, by name (the child wraps ``Scripts.call``);
- round trips per run: INFO ``total_reads_processed`` delta (one per request the server
  reads; a pipeline counts once);
- fsyncs per run: ``fdatasync`` calls of redis-server counted with ``strace -c`` (a
  separate pass, since strace slows them), if strace is installed and may attach;
- runs/s of the in-process execution (the pass without strace).
Per step = (ten_steps - one_step) / 9: what one more step adds. Its wall time is compared
with the floor of one fsync'd write measured on the same server in the same rounds: the
median of sequential ``SET``s (appendfsync always: one fsync each); the aim is <= 1.5x.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from tests.redis_procs import DEFAULT_CONF, RedisServer

from .runs_util import load_line, median, server_stats, table

REPO_ROOT = Path(__file__).resolve().parent.parent
FLOWS = "bench/runs_flows.py"
WORKFLOWS = ("one_step", "ten_steps")


def say(text: str = "") -> None:
    print(text, flush=True)


# -- the driver ------------------------------------------------------------------------------

def strace_ok() -> bool:
    return shutil.which("strace") is not None


def measure(tree: Path, server: RedisServer, r: redis.Redis, workflow: str, n: int,
            trace: bool) -> dict[str, Any]:
    r.flushall()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
    env.update(PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    # run by path, so it imports that side's marbles_rq and nothing of this checkout's
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("step_cost_child.py")),
                             server.url, workflow, str(n)], cwd=tree, env=env,
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    if proc.stdout.readline().strip() != "READY":
        raise RuntimeError(f"child for {tree} did not start")
    tracer = None
    if trace:
        tracer = subprocess.Popen(["strace", "-c", "-f", "-e", "trace=fdatasync,fsync",
                                   "-p", str(server.pid)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)  # attached
    s0 = server_stats(r)
    proc.stdin.write("GO\n")
    proc.stdin.flush()
    out = json.loads(proc.stdout.readline())
    delta = server_stats(r).minus(s0)
    proc.wait(timeout=60)
    fsyncs = None
    if tracer is not None:
        tracer.send_signal(signal.SIGINT)
        _, err = tracer.communicate(timeout=30)
        fsyncs = sum(int(line.split()[3]) for line in err.splitlines()
                     if line.strip().endswith(("fdatasync", "fsync")) and len(line.split()) >= 5)
    if out["outcomes"] != {"succeeded": n}:
        raise RuntimeError(f"{tree}: {workflow}: {out['outcomes']}")
    return {"rate": n / out["seconds"], "calls": {k: v / n for k, v in out["calls"].items()},
            "reads": (delta.reads - 2) / n,  # the two INFO reads of server_stats
            "fsyncs": None if fsyncs is None else fsyncs / n}


def fsync_floor_ms(r: redis.Redis, n: int = 300) -> float:
    """The median wall time of one fsync'd write round trip (a SET) on this server."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        r.set(f"bench:floor:{i % 8}", i)
        times.append(time.perf_counter() - t0)
    return median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=None)
    args = parser.parse_args(argv)
    sides = [("this", REPO_ROOT)]
    if args.baseline is not None:
        sides.append(("baseline", args.baseline.resolve()))
    for label, tree in sides:
        head = subprocess.run(["git", "-C", str(tree), "log", "--oneline", "-1"],
                              capture_output=True, text=True).stdout.strip()
        say(f"{label}: {tree} ({head})")
    say(f"machine: {os.cpu_count()} CPUs; host load at start: {load_line()}")
    tmp = Path(tempfile.mkdtemp(prefix="marbles-bench-step-cost-"))
    server = RedisServer.start(dir=tmp / "redis", conf=DEFAULT_CONF)
    r = redis.Redis.from_url(server.url)
    say(f"redis-server {r.info('server')['redis_version']}, appendfsync "
        f"{r.config_get('appendfsync')['appendfsync']}; {args.runs} runs per cell, "
        f"{args.rounds} rounds, sides alternated; strace: {'yes' if strace_ok() else 'no'}")
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    floors: list[float] = []
    try:
        for rnd in range(args.rounds):
            floors.append(fsync_floor_ms(r))
            say(f"  round {rnd + 1} fsync floor: {floors[-1]:.3f} ms per SET")
            for workflow in WORKFLOWS:
                for trace in ([False, True] if strace_ok() and rnd == 0 else [False]):
                    for label, tree in (sides if rnd % 2 == 0 else sides[::-1]):
                        m = measure(tree, server, r, workflow, args.runs, trace)
                        results.setdefault((label, workflow), []).append(m)
                        say(f"  round {rnd + 1} {label:8} {workflow:9} "
                            f"{'strace' if trace else 'timed '}: {m['rate']:.0f} runs/s, "
                            f"{m['reads']:.2f} round trips/run, scripts/run "
                            f"{dict(sorted(m['calls'].items()))}"
                            + (f", fdatasync/run {m['fsyncs']:.2f}" if trace else ""))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def agg(label: str, workflow: str) -> dict[str, Any]:
        ms = results[(label, workflow)]
        timed = [m for m in ms if m["fsyncs"] is None]
        traced = [m for m in ms if m["fsyncs"] is not None]
        return {"rate": median([m["rate"] for m in timed]),
                "reads": median([m["reads"] for m in timed]),
                "scripts": sum(timed[0]["calls"].values()),
                "fsyncs": traced[0]["fsyncs"] if traced else None}

    rows = []
    for label, _ in sides:
        one, ten = agg(label, "one_step"), agg(label, "ten_steps")

        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        per_step = {k: (None if one[k] is None or ten[k] is None else (ten[k] - one[k]) / 9)
                    for k in ("reads", "scripts", "fsyncs")}
        step_ms = (1 / ten["rate"] - 1 / one["rate"]) / 9 * 1000
        rows.append([label, f"{one['rate']:.0f}", f"{ten['rate']:.0f}",
                     f(one["scripts"]), f(one["reads"]), f(one["fsyncs"]),
                     f(per_step["scripts"]), f(per_step["reads"]), f(per_step["fsyncs"]),
                     f"{step_ms:.3f}", f"{step_ms / median(floors):.2f}x"])
    say()
    say(table(["side", "one_step runs/s", "ten_steps runs/s", "scripts/run (1 step)",
               "round trips/run", "fdatasync/run", "scripts/step", "round trips/step",
               "fdatasync/step", "ms/step", "vs floor"], rows))
    say(f"  fsync floor (median SET, sequential): {median(floors):.3f} ms; aim: a step <= 1.5x "
        f"the floor")
    say("  (runs/s: median over rounds of in-process execute(), no RQ; round trips: INFO "
        "total_reads_processed; fdatasync: strace -c of redis-server, round 1)")
    say(f"host load at end: {load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
