"""Benchmark (not a test): how long `marbles-rq --version` and `marbles-rq status RUN`
take to start, and what they import.

Run from the repo root::

    .venv/bin/python -m bench.cli_startup [--runs 10] [--tree DIR]

It starts a redis-server (ops/redis.conf) in a temporary directory, records one run, then
starts each command `--runs` times with stdout piped, the bytecode compiled beforehand (as
an installed package has it; PYTHONDONTWRITEBYTECODE is cleared), and prints per command
the median and lowest wall time, the median CPU time (user + sys of the child: less
sensitive to a loaded machine than wall time) and how many modules it imported.
`--tree DIR` times the marbles_rq package found in DIR instead (e.g. an older checkout
made with `git archive main marbles_rq lua | tar -x -C DIR`), for a before/after figure.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.redis_procs import RedisServer

REPO_ROOT = Path(__file__).resolve().parent.parent


def _timed(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   stdin=subprocess.DEVNULL, check=False, cwd=cwd)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--tree", type=Path, default=REPO_ROOT)
    args = parser.parse_args()
    tree = args.tree.resolve()
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONDONTWRITEBYTECODE" and not k.startswith("MARBLES_")}
    env["PYTHONPATH"] = str(tree)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "marbles_rq")],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    entry = [sys.executable, "-c", "from marbles_rq.cli import main; main()"]
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer.start(dir=Path(tmp))
        try:
            subprocess.run([*entry, "--redis-url", server.url, "--source",
                            str(REPO_ROOT / "tests" / "cli_workflows.py"), "enqueue", "greet",
                            "--id", "bench-1"], env=env, check=True, stdout=subprocess.DEVNULL,
                           cwd=tmp)
            print(f"tree {tree}, {args.runs} runs each, load average "
                  f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
            for command in (["--version"], ["status", "bench-1", "--redis-url", server.url]):
                # cwd: not the repo, whose marbles_rq `python -c` would import first.
                samples = [_timed([*entry, *command], env, tmp) for _ in range(args.runs)]
                walls = [w for w, _ in samples]
                cpus = [c for _, c in samples]
                probe = ("import sys\nfrom marbles_rq.cli import main\ntry:\n    main("
                         f"{command!r})\nexcept SystemExit:\n    pass\n"
                         "print(len(sys.modules), file=sys.stderr)")
                counted = subprocess.run([sys.executable, "-c", probe], env=env, text=True,
                                         capture_output=True, cwd=tmp)
                modules = counted.stderr.strip().splitlines()[-1]
                print(f"  marbles-rq {' '.join(command[:2]):<18} wall median "
                      f"{statistics.median(walls):.3f} s, min {min(walls):.3f} s; cpu median "
                      f"{statistics.median(cpus):.3f} s; {modules} modules")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
