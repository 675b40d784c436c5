"""Benchmark (not a test): what compensation costs a run, in script calls, Redis round
trips, wall time and CPU, against the same run without it, measured in the same rounds.

Run from the repo root::

    python -m bench.compensation [--runs 200] [--rounds 3]

One durable ``redis-server`` (``ops/redis.conf``: appendfsync always). Each cell is a child
process that records ``--runs`` runs of one workflow of ``bench/compensation_flows.py`` and
executes them in-process (``execute()``, no RQ, no fork). The cells of a round run in an
order rotated from round to round (interleaved), so every workflow sees the same load.

Counted over the executions only: script calls per run (the child wraps ``Scripts.call``),
round trips per run (INFO ``total_reads_processed``), runs/s and the child's CPU per run.
Ratios: each succeeding workflow against ``cb_plain``, ``cb_fail_comp`` against
``cb_fail`` (the same failure with nothing to undo).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from tests.redis_procs import DEFAULT_CONF, RedisServer

from .runs_util import load_line, median, server_stats, table

REPO_ROOT = Path(__file__).resolve().parent.parent
FLOWS = "bench/compensation_flows.py"
WORKFLOWS = ("cb_plain", "cb_declared", "cb_explicit", "cb_fail", "cb_fail_comp")
BASELINE = {"cb_declared": "cb_plain", "cb_explicit": "cb_plain", "cb_fail_comp": "cb_fail"}


def child(url: str, workflow: str, n: int) -> None:
    from marbles_rq.engine import ops
    from marbles_rq.engine.authoring import REGISTRY, load_source
    from marbles_rq.engine.execute import execute
    from marbles_rq.engine.runs import RunStore
    from marbles_rq.store import open_store

    load_source(FLOWS)
    runs = RunStore(open_store(url))
    ids = [runs.record(ops.prepare(ops.RunRequest(workflow))).record.id for _ in range(n)]
    calls: Counter[str] = Counter()
    call = runs.scripts.call

    def counted(name: str, keys: list[str], args: list[Any]) -> list[Any]:
        calls[name] += 1
        return call(name, keys, args)

    runs.scripts.call = counted  # type: ignore[method-assign]
    both = runs.scripts.commit_step_and_settle

    def pipelined(commit: dict[str, Any], settle: dict[str, Any]) -> Any:
        calls["commit_step"] += 1  # two scripts in one pipeline: counted as two
        calls["settle_run"] += 1
        return both(commit, settle)

    runs.scripts.commit_step_and_settle = pipelined  # type: ignore[method-assign]
    print("READY", flush=True)
    sys.stdin.readline()
    outcomes: Counter[str] = Counter()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for rid in ids:
        outcomes[execute(runs, REGISTRY, rid, 1, worker="bench-compensation",
                         lease_ms=10_000, hard_exit=False)] += 1
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    print(json.dumps({"seconds": elapsed, "cpu": cpu, "outcomes": outcomes, "calls": calls}),
          flush=True)


def measure(server: RedisServer, r: redis.Redis, workflow: str, n: int) -> dict[str, Any]:
    r.flushall()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
    env.update(PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "bench.compensation", "--child",
                             server.url, workflow, str(n)], cwd=REPO_ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    if proc.stdout.readline().strip() != "READY":
        raise RuntimeError(f"child for {workflow} did not start")
    s0 = server_stats(r)
    proc.stdin.write("GO\n")
    proc.stdin.flush()
    out = json.loads(proc.stdout.readline())
    delta = server_stats(r).minus(s0)
    proc.wait(timeout=60)
    want = "failed" if workflow.startswith("cb_fail") else "succeeded"
    if out["outcomes"] != {want: n}:
        raise RuntimeError(f"{workflow}: {out['outcomes']}")
    return {"rate": n / out["seconds"], "cpu_ms": out["cpu"] / n * 1000,
            "scripts": sum(out["calls"].values()) / n,
            "reads": (delta.reads - 2) / n}  # the two INFO reads of server_stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=3, metavar=("URL", "WORKFLOW", "N"), default=None,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "log", "--oneline", "-1"],
                          capture_output=True, text=True).stdout.strip()
    print(f"checkout: {head}; machine: {os.cpu_count()} CPUs; host load at start: "
          f"{load_line()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="marbles-bench-compensation-"))
    server = RedisServer.start(dir=tmp / "redis", conf=DEFAULT_CONF)
    r = redis.Redis.from_url(server.url)
    print(f"redis-server {r.info('server')['redis_version']}, appendfsync "
          f"{r.config_get('appendfsync')['appendfsync']}; {args.runs} runs per cell, "
          f"{args.rounds} rounds, interleaved", flush=True)
    results: dict[str, list[dict[str, Any]]] = {w: [] for w in WORKFLOWS}
    try:
        for rnd in range(args.rounds):
            order = WORKFLOWS[rnd % len(WORKFLOWS):] + WORKFLOWS[:rnd % len(WORKFLOWS)]
            for workflow in order:
                m = measure(server, r, workflow, args.runs)
                results[workflow].append(m)
                print(f"  round {rnd + 1} {workflow:13} {m['rate']:.0f} runs/s, "
                      f"{m['scripts']:.2f} scripts/run, {m['reads']:.2f} round trips/run, "
                      f"{m['cpu_ms']:.3f} ms CPU/run", flush=True)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    agg = {w: {k: median([m[k] for m in ms]) for k in ("rate", "scripts", "reads", "cpu_ms")}
           for w, ms in results.items()}
    rows = []
    for w in WORKFLOWS:
        a = agg[w]
        base = BASELINE.get(w)
        b = agg[base] if base else None
        rows.append([w, f"{a['rate']:.0f}", f"{a['scripts']:.2f}", f"{a['reads']:.2f}",
                     f"{a['cpu_ms']:.3f}",
                     "-" if b is None else f"{base}",
                     "-" if b is None else f"{a['reads'] - b['reads']:+.2f}",
                     "-" if b is None else f"{b['rate'] / a['rate']:.2f}x",
                     "-" if b is None else f"{a['cpu_ms'] / b['cpu_ms']:.2f}x"])
    print()
    print(table(["workflow", "runs/s", "scripts/run", "round trips/run", "CPU ms/run",
                 "against", "round trips +", "wall x", "CPU x"], rows))
    print("  (medians over rounds of in-process execute(), no RQ; round trips: INFO "
          "total_reads_processed; CPU: the executing child's process time)")
    print(f"host load at end: {load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
