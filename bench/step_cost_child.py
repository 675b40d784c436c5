"""The child of bench/step_cost.py: one side's engine, in-process. Run by path with
PYTHONPATH set to that side's checkout (cwd: the checkout)::

    python bench/step_cost_child.py URL WORKFLOW N

Records N runs, prints READY, waits for a line on stdin, executes them, prints JSON.
MARBLES_BENCH_METRICS=1 turns metrics on (multiprocess mode, as a worker with
--metrics-port) in a checkout that has them."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

FLOWS = "bench/runs_flows.py"


def child(url: str, workflow: str, n: int) -> None:
    from marbles_rq.engine import ops
    from marbles_rq.engine.authoring import REGISTRY, load_source
    from marbles_rq.engine.execute import execute
    from marbles_rq.engine.runs import RunStore
    from marbles_rq.store import open_store

    load_source(FLOWS)
    if os.environ.get("MARBLES_BENCH_METRICS") == "1":
        # Metrics on, as in a worker with --metrics-port: values in multiprocess files.
        try:
            from marbles_rq import metrics
        except ImportError:  # a baseline checkout without metrics
            pass
        else:
            metrics.enable(multiprocess_dir=Path(tempfile.mkdtemp(prefix="marbles-bench-m-")))
    runs = RunStore(open_store(url))
    ids = [runs.record(ops.prepare(ops.RunRequest(workflow))).record.id for _ in range(n)]
    calls: Counter[str] = Counter()
    call = runs.scripts.call

    def counted(name: str, keys: list[str], args: list[Any]) -> list[Any]:
        calls[name] += 1
        return call(name, keys, args)

    runs.scripts.call = counted  # type: ignore[method-assign]
    both = getattr(runs.scripts, "commit_step_and_settle", None)
    if both is not None:  # a checkout where the last commit rides with the settle

        def pipelined(commit: dict[str, Any], settle: dict[str, Any]) -> Any:
            calls["commit_step"] += 1  # two scripts in one pipeline: counted as two
            calls["settle_run"] += 1
            return both(commit, settle)

        runs.scripts.commit_step_and_settle = pipelined
    print("READY", flush=True)
    sys.stdin.readline()
    outcomes: Counter[str] = Counter()
    t0 = time.perf_counter()
    for rid in ids:
        outcomes[execute(runs, REGISTRY, rid, 1, worker="bench-step-cost", lease_ms=10_000,
                         hard_exit=False)] += 1
    elapsed = time.perf_counter() - t0
    print(json.dumps({"seconds": elapsed, "outcomes": outcomes, "calls": calls}), flush=True)



if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
