"""ops/demo helper: wait until RUN_ID is executing step position >= 2, then print the pid of
the worker running it. Polls the store in-process (no process spawned per poll)."""

from __future__ import annotations

import sys
import time

from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store


def main(run_id: str, timeout_s: float = 60.0) -> None:
    runs = RunStore(open_store())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = runs.get(run_id)
        if view is not None and view.status == "running" and view.worker and any(
                s.status == "running" and int(s.key.rsplit("#", 1)[1]) >= 2 for s in view.steps):
            print(view.worker.rsplit(".", 1)[1])
            return
        time.sleep(0.02)
    sys.exit(f"run {run_id} did not reach its third step in {timeout_s:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
