"""What flow control costs a run: Redis commands, round trips and fsyncs per one-step run,
end to end (enqueue one at a time, then one ``--burst`` worker, ``--pool 1``, runs them all),
measured as ``bench.transport``'s anatomy section measures them (the difference between a
large and a small batch, so fixed costs cancel):

    .venv/bin/python -m bench.flowctl [--quick]

* ``one_step``: no flow control (the baseline);
* ``one_step`` with ``priority=5``: its own band (RQ queue ``mrq.default~5``);
* ``one_step_limited``: ``concurrency=1000``, never full;
* ``one_step_keyed``: ``concurrency=1000, concurrency_key="customer"``, never full.
"""

from __future__ import annotations

import argparse
import contextlib
import os
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

FLOWS = "bench/flowctl_flows.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    os.chdir(tb.REPO_ROOT)
    tb.FLOWS = FLOWS  # the workers load these workflows
    load_source(FLOWS)
    sizes = tb.QUICK if args.quick else tb.FULL
    tmp = Path(tempfile.mkdtemp(prefix="marbles-bench-flowctl-"))
    b = tb.Bench(sizes, 1, 1, tmp)
    try:
        def enqueue(request: ops.RunRequest) -> Callable[[], None]:
            return lambda: ops.enqueue(b.runs, b.rq, request)

        def burst() -> None:
            child = b.procs.start("flowctl", b.marbles_worker(1))
            try:
                child.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                b.procs.kill(child)
                raise tb.BenchError(f"worker hung\n{child.tail()}") from None

        cases = [
            ("no flow control", ops.RunRequest("one_step")),
            ("priority 5 (a band)", ops.RunRequest("one_step", priority=5)),
            ("concurrency=1000", ops.RunRequest("one_step_limited")),
            ("concurrency=1000 per key", ops.RunRequest("one_step_keyed",
                                                         b'{"customer": "acme"}')),
        ]
        rows = []
        d = sizes.large - sizes.small
        for label, request in cases:
            got = [tb.measure(b, tmp, n, enqueue(request), burst)
                   for n in (sizes.small, sizes.large)]
            (small, top0, _, fs0), (large, top1, _, fs1) = got
            top = {k: (v - top0.get(k, 0)) / d for k, v in top1.items()}
            commands = (sum(large.calls.values()) - sum(small.calls.values())) / d
            fsyncs = None if fs0 is None or fs1 is None else (fs1 - fs0) / d
            rows.append([label, f"{commands:.1f}", f"{sum(top.values()):.1f}",
                         f"{(large.reads - small.reads) / d:.1f}",
                         "n/a" if fsyncs is None else f"{fsyncs:.1f}",
                         ", ".join(f"{k} {v:.1f}" for k, v in
                                   sorted(top.items(), key=lambda kv: -kv[1]) if v >= 0.05)])
        tb.say(f"per one-step run, --pool 1 burst worker ({sizes.large} - {sizes.small} runs)")
        tb.say(tb.table(["case", "commands", "client commands", "round trips", "fsyncs",
                         "client commands by name"], rows))
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
