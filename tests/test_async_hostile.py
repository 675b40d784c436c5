"""Async workflows and `worker --concurrency`, used the way a careless or hostile user may:
each test names what a user relies on. Real redis-server, real `marbles-rq worker` /
`controller` processes; the workflows are in tests/async_hostile.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from tests.async_hostile import EXEC_PREFIX, GATE_PREFIX, MARK_PREFIX, RUNNING_KEY
from tests.procs import REPO_ROOT, Observer, Procs, wait_for
from tests.redis_procs import RedisServer
from tests.test_waiting_questions import final, ok, wait_parked

PROCS_SOURCES = (REPO_ROOT / "tests" / "async_hostile.py",)


def executions(obs: Observer, run_id: str) -> dict[str, int]:
    return {str(k): int(v) for k, v in obs.client.hgetall(EXEC_PREFIX + run_id).items()}


def test_gathered_helpers_get_their_own_results_after_a_replay(procs: Procs) -> None:
    """Two gathered helper coroutines each await two steps; they reach their second step in
    the other order than their first. After the durable sleep the body is replayed from the
    top: each helper must get its own recorded results back, not its sibling's."""
    procs.start(workers=1)
    obs = procs.observer
    procs.enqueue("ah_helpers", None, "help")
    data: dict[str, Any] = final(obs, "help")
    assert data["result"] == ["item-0", "item-1"], obs.dump("help")
    assert executions(obs, "help") == {"fetch0": 1, "fetch1": 1, "label0": 1, "label1": 1}
    view = obs.view("help")
    assert view is not None
    # Each helper's calls are recorded in the frame of its task (in order of creation).
    assert {s.key for s in view.steps if not s.name.startswith("|")} == {
        "ah_helpers.|task#0.ah_fetch#0", "ah_helpers.|task#0.ah_label#0",
        "ah_helpers.|task#1.ah_fetch#0", "ah_helpers.|task#1.ah_label#0"}
    # What the helpers wrote between their steps is written once, not again on the replay.
    events = obs.events("help")
    assert sorted(e.data["text"] for e in events if e.type == "output") == [
        "helper 0 fetched in help\n", "helper 1 fetched in help\n"]
    assert sorted(e.data["message"] for e in events if e.type == "log") == [
        "helper 0 labels", "helper 1 labels"]


def running(obs: Observer, n: int, *, timeout: float = 60.0) -> set[str]:
    """Wait until `n` runs are inside their gated step at the same time (ah_gated)."""
    def check() -> set[str] | None:
        found = {str(m) for m in obs.client.smembers(RUNNING_KEY)}
        return found if len(found) >= n else None

    return wait_for(check, timeout=timeout, what=f"{n} runs inside their gated step")


def enqueue_batch(procs: Procs, workflow: str, ids: list[str], input: Any = None) -> None:
    batch = procs.dir / f"batch-{ids[0]}.jsonl"
    batch.write_text("".join(json.dumps({"id": i, "input": input}) + "\n" for i in ids))
    ok(procs.cli("enqueue", workflow, "--batch", str(batch)))


def settled(obs: Observer, run_id: str, status: str = "succeeded") -> dict[str, Any]:
    obs.wait_final(run_id, timeout=120)
    return final(obs, run_id, status)


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_redis_killed_under_eight_concurrent_runs(procs: Procs,
                                                  redis_server: RedisServer) -> None:
    """Redis is killed -9 while eight runs execute steps in one `--concurrency 8` process
    and stays down past their lease; once it is back all eight finish, each step ran once
    (or twice: the one whose commit the outage refused), the worker process is the same,
    and it does not keep the old executor threads beside new ones."""
    procs.start(workers=0)
    worker = procs.worker(lease_ms=3000, extra=["--concurrency", "8"])
    obs = procs.observer
    ids = [f"r{i}" for i in range(8)]
    enqueue_batch(procs, "ah_naps", ids, 120)
    assert running(obs, 8) == set(ids)
    before = threads(worker.pid)
    redis_server.kill9()
    # The executions see the outage at their next store call: the watchdog's renewal, or a
    # step's commit when one comes first (a nap is short); either way they stop unsettled.
    wait_for(lambda: any(s in worker.text() for s in ("cannot renew its lease",
                                                      "the store is unavailable")),
             timeout=30, what="the worker's executions to see the outage",
             context=worker.tail)
    time.sleep(4)  # the outage itself, past the lease: what the worker must ride out
    redis_server.restart()
    for run_id in ids:
        assert settled(obs, run_id)["result"] == sum(range(120)), obs.dump(run_id)
        counts = executions(obs, run_id)
        assert sorted(counts) == sorted(f"nap{i}" for i in range(120))
        assert sum(c - 1 for c in counts.values()) <= 1, (run_id, counts)
    assert worker.alive()
    # More runs after the outage: the process executes them on as many threads as before.
    obs.client.delete(RUNNING_KEY)
    more = [f"m{i}" for i in range(8)]
    enqueue_batch(procs, "ah_naps", more, 60)
    assert running(obs, 8) == set(more)
    assert threads(worker.pid) <= before + 2, (before, threads(worker.pid))
    for run_id in more:
        assert settled(obs, run_id)["result"] == sum(range(60))


def test_a_forgotten_await_on_a_waiting_word_still_waits(procs: Procs) -> None:
    """`ctx.sleep(s)` and `ctx.wait_for_signal(name)` without `await` must not be skipped:
    they park the run as `mr.sleep` / `mr.wait_for_signal` do (a durable wait silently
    skipped would act before its time)."""
    procs.start(workers=1)
    obs = procs.observer
    procs.enqueue("ah_forgot_await", None, "forgot")
    wait_parked(obs, "forgot", "signal", timeout=60)
    assert [e.type for e in obs.events("forgot")].count("timer_fired") == 1, obs.dump("forgot")
    ok(procs.cli("signal", "forgot", "go"))
    assert final(obs, "forgot")["result"] == "done"


def test_a_task_parks_while_its_sibling_is_inside_a_sync_step(procs: Procs) -> None:
    """A gathered task waits for a signal while its sibling is inside a sync step (in the
    thread pool). The step finishes and is recorded before the run parks: once resumed,
    it is replayed, not run a second time."""
    procs.start(workers=0)
    procs.worker(extra=["--concurrency", "2"])
    obs = procs.observer
    procs.enqueue("ah_park_mid_step", None, "pm")
    wait_for(lambda: obs.client.exists(MARK_PREFIX + "pm:waiting") or None, timeout=60,
             what="the waiting task to ask for its signal", context=lambda: obs.dump("pm"))
    obs.client.set(GATE_PREFIX + "pm", 1)
    wait_parked(obs, "pm", "signal", timeout=60)
    ok(procs.cli("signal", "pm", "go", "--payload", '"yes"'))
    assert final(obs, "pm")["result"] == ["yes", 40]
    assert executions(obs, "pm") == {"slow": 1}, obs.dump("pm")


def test_a_step_called_without_await_fails_the_run_clearly(procs: Procs) -> None:
    """A step (or `ctx.parallel`) called without `await` would never run; the run fails,
    naming it and the missing await, instead of succeeding without it."""
    procs.start(workers=1, controller=False)
    obs = procs.observer
    procs.enqueue("ah_forgot_step", None, "nostep")
    procs.enqueue("ah_forgot_parallel", None, "nopar")
    error = final(obs, "nostep", "failed")["error"]
    assert "ah_forgot_step.ah_label#0" in error["message"], error
    assert "never awaited" in error["message"], error
    error = final(obs, "nopar", "failed")["error"]
    assert "ctx.parallel(...) was called but never awaited" in error["message"], error
    assert executions(obs, "nostep") == {} and executions(obs, "nopar") == {}


def test_a_second_sigterm_ends_the_runs_in_flight_with_the_process(procs: Procs) -> None:
    """SIGTERM asks a `--concurrency` worker to finish what it executes; a second one (RQ
    ignores one within a second of the first) is a cold shutdown: the process ends now,
    not when its runs' steps return (here: never, until the test opens their gate), and
    the runs are redelivered to another worker."""
    procs.start(workers=0)
    first = procs.worker(lease_ms=3000, extra=["--concurrency", "2"])
    obs = procs.observer
    ids = ["s0", "s1"]
    enqueue_batch(procs, "ah_sync_gated", ids)
    for run_id in ids:
        wait_for(lambda r=run_id: obs.client.exists(MARK_PREFIX + r + ":started") or None,
                 timeout=60, what=f"run {run_id} inside its sync step")
    first.signal(signal.SIGTERM)
    first.wait_log("warm shut down requested")
    time.sleep(1.2)  # RQ takes a second signal within a second of the first for a duplicate
    first.signal(signal.SIGTERM)
    first.wait_log("cold shut down")
    first.wait_exit(timeout=15)
    procs.worker(lease_ms=3000, extra=["--concurrency", "2"])
    for run_id in ids:
        obs.client.set(GATE_PREFIX + run_id, 1)
    for run_id in ids:
        data = settled(obs, run_id)
        assert data["result"] == 20 and data["attempt"] == 2, obs.dump(run_id)
        assert executions(obs, run_id) == {"first": 1, "slow": 2}, obs.dump(run_id)
