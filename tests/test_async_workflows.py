"""Async workflows and the concurrent executor, from the user's side: `async def` workflows
and steps (mixed with sync ones) keep stable ledger positions under `asyncio.gather`, park
and resume like sync ones, retry, and are cancelled at their next await; `worker
--concurrency N` executes N runs at once in one process, and a kill -9 of that process
redelivers all of them, re-running no finished step. Real redis-server, real `marbles-rq
worker` / `controller` processes; the workflows are in tests/async_workflows.py.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from tests.async_workflows import EXEC_PREFIX, GATE_PREFIX, RUNNING_KEY, STARTED_PREFIX
from tests.procs import REPO_ROOT, Observer, Procs, wait_for
from tests.test_waiting_questions import final, kill9_groups, ok, wait_parked

PROCS_SOURCES = (REPO_ROOT / "tests" / "async_workflows.py",)
LEASE_MS = 3000


def executions(obs: Observer, run_id: str) -> dict[str, int]:
    return {str(k): int(v) for k, v in obs.client.hgetall(EXEC_PREFIX + run_id).items()}


def ledger(obs: Observer, run_id: str) -> dict[str, dict[str, Any]]:
    """The run's recorded steps by ledger key: status, attempts, result."""
    view = obs.view(run_id)
    assert view is not None
    return {s.key: {"status": s.status, "attempts": s.attempts,
                    "result": msgspec.json.decode(s.result) if s.result else None}
            for s in view.steps if not s.name.startswith("|")}


def running(obs: Observer, n: int, *, timeout: float = 60.0) -> set[str]:
    """Wait until `n` runs are inside their gated step at the same time (aw_gated)."""
    def check() -> set[str] | None:
        found = {str(m) for m in obs.client.smembers(RUNNING_KEY)}
        return found if len(found) >= n else None

    return wait_for(check, timeout=timeout, what=f"{n} runs inside their gated step")


def test_async_steps_keep_their_positions_park_and_resume(procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    procs.enqueue("aw_fanout", None, "fan")
    wait_parked(obs, "fan", "signal", timeout=60)
    ok(procs.cli("signal", "fan", "go", "--payload", '"yes"'))
    data = final(obs, "fan")
    # Each gathered step is recorded at the position of its call, though they finished in
    # the reverse order; each ran once, across the timer's and the signal's resumptions.
    assert data["result"] == {"doubled": [0, 2, 4], "ctx": 11, "sync": 21, "payload": "yes"}
    steps = ledger(obs, "fan")
    assert {k: steps[k]["result"] for k in steps if "aw_double" in k} == {
        "aw_fanout.aw_double#0": 0, "aw_fanout.aw_double#1": 2, "aw_fanout.aw_double#2": 4}
    assert executions(obs, "fan") == {"double0": 1, "double1": 1, "double2": 1, "add10": 1,
                                      "add20": 1}
    assert data["resumptions"] == 2


def test_sync_and_async_steps_mix_both_ways(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    procs.enqueue("aw_mixed", 4, "mixed")
    data = final(obs, "mixed")
    assert data["result"] == [50, 5]
    assert set(ledger(obs, "mixed")) == {"aw_mixed.aw_outer#0", "aw_mixed.aw_outer#0.aw_add#0",
                                         "aw_mixed.aw_add#0"}


def test_an_async_step_retries_then_succeeds(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    procs.enqueue("aw_retry", None, "retry")
    data = final(obs, "retry")
    assert data["result"] == 3
    assert ledger(obs, "retry")["aw_retry.aw_flaky#0"]["attempts"] == 3


def test_async_parallel_branches_park_together_and_resume(procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    procs.enqueue("aw_parallel", None, "par")
    view = wait_parked(obs, "par", "signal")
    assert sorted(view.wait_for["signals"]) == ["left", "right"], obs.dump("par")
    ok(procs.cli("signal", "par", "right", "--payload", "2"))
    ok(procs.cli("signal", "par", "left", "--payload", "1"))
    assert final(obs, "par")["result"] == ["left:1", "right:2"]
    assert executions(obs, "par") == {"branch_left": 1, "branch_right": 1}


def test_cancel_stops_an_async_run_at_its_next_await_and_frees_the_slot(
        procs: Procs) -> None:
    procs.start(workers=0)
    procs.worker(lease_ms=LEASE_MS, extra=["--concurrency", "1"])
    obs = procs.observer
    procs.enqueue("aw_forever", None, "stuck")
    wait_for(lambda: obs.client.exists(STARTED_PREFIX + "stuck") or None, timeout=30,
             what="the long step to start")
    ok(procs.cli("cancel", "stuck"))
    final(obs, "stuck", "cancelled")
    # Its only executor thread is free again: the next run executes.
    procs.enqueue("aw_mixed", 1, "next")
    assert final(obs, "next")["result"] == [20, 2]
    assert executions(obs, "stuck") == {"long": 1}  # stopped inside its await


def test_concurrent_worker_executes_n_runs_at_once_and_kill9_redelivers_all(
        procs: Procs) -> None:
    """Eight runs are inside their gated step at once in one `--concurrency 8` process; it
    is killed -9; a new worker finishes all eight, re-running no step that had finished
    (their first step) and re-entering the gated one once."""
    procs.start(workers=0)
    first = procs.worker(lease_ms=LEASE_MS, extra=["--concurrency", "8"])
    obs = procs.observer
    ids = [f"c{i}" for i in range(8)]
    lines = "\n".join(json.dumps({"id": i, "input": None}) for i in ids)
    batch = procs.dir / "batch.jsonl"
    batch.write_text(lines + "\n")
    ok(procs.cli("enqueue", "aw_gated", "--batch", str(batch)))
    assert running(obs, 8) == set(ids)
    workers = {obs.view(i).worker for i in ids}  # type: ignore[union-attr]
    assert len(workers) == 1, workers  # one process executes all eight
    kill9_groups([first])
    obs.client.delete(RUNNING_KEY)
    for run_id in ids:
        obs.client.set(GATE_PREFIX + run_id, 1)
    procs.worker(lease_ms=LEASE_MS, extra=["--concurrency", "4"])
    for run_id in ids:
        data = final(obs, run_id)
        assert data["result"] == "2 opened!", obs.dump(run_id)
        assert data["attempt"] == 2, obs.dump(run_id)
        assert executions(obs, run_id) == {"add1": 1, "gate": 2, "after": 1}, obs.dump(run_id)
