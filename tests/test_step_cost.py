"""One fsync'd round trip per step: a step with no retries has its start written by its
commit (one script), and `status` and `watch` still show what they showed: a step running
longer than START_DELAY_S is written as running while it runs, its start event comes before
anything the step writes, and cancel, pause and the deadline still stop a run at a step
boundary. Executed in this process against a real Redis."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.execute import FRESH_FLAGS_S, START_DELAY_S, execute
from marbles_rq.engine.execution import StepStart
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import OutputEvent, RunStore
from marbles_rq.engine.waits import WaitStore
from marbles_rq.store import open_store
from marbles_rq.store.records import StepRecord, encode
from tests.procs import wait_for

CALLS: Counter[str] = Counter()
GATE = threading.Event()
HOOK: dict[str, Any] = {}


@mr.step
def sc_tick(i: int) -> int:
    CALLS[f"tick{i}"] += 1
    hook = HOOK.get(f"tick{i}")
    if hook is not None:
        hook()
    return i


@mr.step(retries=1, delay_s=0.01, jitter=False)
def sc_retrying(i: int) -> int:
    CALLS[f"retrying{i}"] += 1
    return i


@mr.step
def sc_wait() -> str:
    CALLS["wait"] += 1
    assert GATE.wait(10)
    return "released"


@mr.step
def sc_parent() -> int:
    mr.current().stream.write("inside the parent")
    return sc_tick(7) + 1


@mr.workflow("sc_steps", max_deliveries=5)
def sc_steps(ctx: mr.RunContext, n: int) -> int:
    return sum(sc_tick(i) for i in range(n))


@mr.workflow("sc_retries")
def sc_retries(ctx: mr.RunContext) -> int:
    return sc_retrying(0)


@mr.workflow("sc_long")
def sc_long(ctx: mr.RunContext) -> str:
    return sc_wait()


@mr.workflow("sc_nested")
def sc_nested(ctx: mr.RunContext) -> int:
    return sc_parent()


@mr.workflow("sc_gap")
def sc_gap(ctx: mr.RunContext, gap_s: float) -> int:
    """Step 0, then the hook (e.g. a cancel from elsewhere), then `gap_s` of work that is
    not a step, then steps 1 and 2."""
    sc_tick(0)
    HOOK["between"]()
    time.sleep(gap_s)
    return sc_tick(1) + sc_tick(2)


@mr.workflow("sc_hold")
def sc_hold(ctx: mr.RunContext) -> int:
    """A step, then work that is no step (it waits for the test's GATE)."""
    done = sc_tick(0)
    assert GATE.wait(10)
    return done


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    CALLS.clear()
    HOOK.clear()
    GATE.clear()
    yield
    GATE.set()


def _runs(url: str) -> RunStore:
    return RunStore(open_store(url))


def _record(runs: RunStore, name: str, input: bytes, run_id: str) -> None:
    runs.record(prepare(RunRequest(name, input, run_id)))


def _run(runs: RunStore, run_id: str, attempt: int = 1) -> str:
    return execute(runs, REGISTRY, run_id, attempt, worker="w-test", lease_ms=10_000,
                   hard_exit=False)


def _counting(runs: RunStore) -> Counter[str]:
    calls: Counter[str] = Counter()
    call = runs.scripts.call

    def counted(name: str, keys: list[str], args: list[Any]) -> list[Any]:
        calls[name] += 1
        return call(name, keys, args)

    runs.scripts.call = counted  # type: ignore[method-assign]
    both = runs.scripts.commit_step_and_settle

    def pipelined(commit: dict[str, Any], settle: dict[str, Any]) -> Any:
        calls["commit_step_and_settle"] += 1  # one round trip
        return both(commit, settle)

    runs.scripts.commit_step_and_settle = pipelined  # type: ignore[method-assign]
    return calls


def _steps(events: list[OutputEvent]) -> list[tuple[str, str]]:
    return [(e.type, e.data.get("step") or e.data.get("text", "")) for e in events
            if e.type.startswith("step_") or e.type == "output"]


def test_a_step_with_no_retries_costs_one_script(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "sc_steps", b"10", "cost-10")
    calls = _counting(runs)
    before = int(time.time() * 1000)
    assert _run(runs, "cost-10") == "succeeded"
    # The last step's success goes with the settle, in one round trip.
    assert calls == Counter(start_attempt=1, commit_step=9, commit_step_and_settle=1)
    events = runs.output("cost-10")
    assert _steps(events) == [(kind, f"sc_steps.sc_tick#{i}") for i in range(10)
                              for kind in ("step_started", "step_succeeded")]
    for e in events:
        if e.type == "step_started":  # written with the commit, it says when it started
            assert before - 1000 <= e.data["started_ms"] <= e.at_ms + 1000, e
            assert e.data["attempt"] == 1
    view = runs.get("cost-10")
    assert view is not None and [s.status for s in view.steps] == ["succeeded"] * 10
    assert [s.attempts for s in view.steps] == [1] * 10


def test_a_step_with_retries_is_started_up_front(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "sc_retries", b"null", "cost-retries")
    calls = _counting(runs)
    assert _run(runs, "cost-retries") == "succeeded"
    assert calls == Counter(start_attempt=1, start_step=1, commit_step_and_settle=1)
    key = "sc_retries.sc_retrying#0"
    assert _steps(runs.output("cost-retries")) == [("step_started", key),
                                                   ("step_succeeded", key)]


def test_a_long_step_shows_as_running_while_it_runs(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "sc_long", b"null", "long-1")
    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.append(_run(runs, "long-1")))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while True:  # written by the watchdog once the step has run START_DELAY_S
            view = runs.get("long-1")
            if view is not None and [s.status for s in view.steps] == ["running"]:
                break
            assert time.monotonic() < deadline, view
            time.sleep(0.02)
        started = [e for e in runs.output("long-1") if e.type == "step_started"]
        assert len(started) == 1 and started[0].data["step"] == "sc_long.sc_wait#0"
        # its event says when the step started, not when the watchdog wrote it
        assert started[0].at_ms - started[0].data["started_ms"] >= START_DELAY_S * 1000 - 50
        assert view.to_json()["status"] == "running"
    finally:
        GATE.set()
        thread.join(15)
    assert outcome == ["succeeded"] and CALLS["wait"] == 1
    assert _steps(runs.output("long-1")) == [("step_started", "sc_long.sc_wait#0"),
                                             ("step_succeeded", "sc_long.sc_wait#0")]


def test_what_a_step_writes_comes_after_its_start(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "sc_nested", b"null", "nested-1")
    assert _run(runs, "nested-1") == "succeeded"
    assert _steps(runs.output("nested-1")) == [
        ("step_started", "sc_nested.sc_parent#0"), ("output", "inside the parent"),
        ("step_started", "sc_nested.sc_parent#0.sc_tick#0"),
        ("step_succeeded", "sc_nested.sc_parent#0.sc_tick#0"),
        ("step_succeeded", "sc_nested.sc_parent#0")]


def test_a_cancel_during_a_fast_step_stops_the_run_after_it(redis_url: str) -> None:
    """The step's start was not written, so nothing refused it: its commit records its
    result (it ran) and says cancelled; the next step never starts."""
    runs = _runs(redis_url)
    _record(runs, "sc_steps", b"3", "cancel-during")
    HOOK["tick1"] = lambda: runs.cancel("cancel-during")
    assert _run(runs, "cancel-during") == "cancelled"
    assert dict(CALLS) == {"tick0": 1, "tick1": 1}
    view = runs.get("cancel-during")
    assert view is not None and view.status == "cancelled"
    assert [(s.key, s.status) for s in view.steps] == [
        ("sc_steps.sc_tick#0", "succeeded"), ("sc_steps.sc_tick#1", "succeeded")]
    assert "sc_steps.sc_tick#2" not in {d for _, d in _steps(runs.output("cancel-during"))}


def test_a_step_started_after_a_pause_in_the_body_asks_redis_first(redis_url: str) -> None:
    """The body's last look at the cancel flag is older than FRESH_FLAGS_S: the next step
    asks Redis before it runs, and does not start."""
    runs = _runs(redis_url)
    _record(runs, "sc_gap", msgspec.json.encode(FRESH_FLAGS_S + 0.1), "cancel-gap")
    HOOK["between"] = lambda: runs.cancel("cancel-gap")
    calls = _counting(runs)
    assert _run(runs, "cancel-gap") == "cancelled"
    assert dict(CALLS) == {"tick0": 1}
    assert calls["start_step"] == 1  # asked, and refused
    view = runs.get("cancel-gap")
    assert view is not None and view.status == "cancelled"
    assert [s.key for s in view.steps] == ["sc_gap.sc_tick#0"]


def test_a_cancel_right_after_a_step_is_seen_before_the_next_one_starts(
        redis_url: str) -> None:
    """A step's success is held for the execution's next write: a cancel that lands right
    after it is answered by that commit, written as the next step begins (its result
    recorded), and the next step never starts."""
    runs = _runs(redis_url)
    _record(runs, "sc_gap", b"0", "cancel-fresh")
    HOOK["between"] = lambda: runs.cancel("cancel-fresh")
    assert _run(runs, "cancel-fresh") == "cancelled"
    assert dict(CALLS) == {"tick0": 1}
    view = runs.get("cancel-fresh")
    assert view is not None and view.status == "cancelled"
    assert [(s.key, s.status) for s in view.steps] == [("sc_gap.sc_tick#0", "succeeded")]


def test_a_pause_during_a_fast_step_parks_after_it_and_it_is_not_run_again(
        redis_url: str) -> None:
    runs = _runs(redis_url)
    waits = WaitStore(runs)
    _record(runs, "sc_steps", b"3", "pause-during")
    HOOK["tick1"] = lambda: waits.pause("pause-during")
    assert _run(runs, "pause-during") == "parked"
    view = runs.get("pause-during")
    assert view is not None and view.status == "waiting" and view.wait_reason == "paused"
    assert [s.status for s in view.steps] == ["succeeded", "succeeded"]
    HOOK.clear()
    status, attempt, _ = waits.resume("pause-during")
    assert status == "woken"
    assert _run(runs, "pause-during", attempt) == "succeeded"
    assert dict(CALLS) == {"tick0": 1, "tick1": 1, "tick2": 1}  # replayed, not run again


def test_deferred_starts_are_fenced_and_written_once(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "sc_steps", b"1", "fence-starts")
    started = runs.start("fence-starts", 1, ttl_ms=60_000, worker="w1")
    ex = started.execution
    assert ex is not None
    running = StepRecord(version=1, key="sc_steps.sc_tick#0", name="sc_tick", status="running",
                         attempts=1)
    done = StepRecord(version=1, key=running.key, name="sc_tick", status="succeeded",
                      attempts=1, result=msgspec.Raw(b"0"))
    start = StepStart(running.key, running, b'{"step":"sc_steps.sc_tick#0"}', 0.0)
    # A commit carrying its deferred start, sent twice (a resend after a lost reply).
    for _ in range(2):
        reply = runs.scripts.commit_step(
            keys=ex.keys, epoch=ex.epoch, step_key=done.key, record=encode(done),
            event_type="step_succeeded", event=b"{}", run_id=ex.run_id, ttl_ms=60_000,
            seq=1, starts=[start.triple(ex, runs.store)])
        assert reply.status == "ok"
    types = [e.type for e in runs.output("fence-starts")]
    assert types.count("step_started") == 1 and types.count("step_succeeded") == 1
    # A newer execution fences the old one's late starts and commits.
    runs.client.hincrby(ex.keys.run, "epoch", 1)
    runs.defer_start(ex, start)
    assert runs.write_due_starts(ex, time.monotonic()) == "stale"
    runs.defer_start(ex, start)
    assert runs.commit_step(ex, done, "step_succeeded", b"{}") == "stale"
    assert [e.type for e in runs.output("fence-starts")].count("step_started") == 1


def test_a_held_success_is_written_soon_though_the_body_goes_on_without_writing(
        redis_url: str) -> None:
    """The last step's success waits for the next write (the settle, usually), but not for
    long: while the body works on after it, the watchdog writes it within HOLD_COMMIT_S, so
    a crash during that work does not run the step again."""
    runs = _runs(redis_url)
    _record(runs, "sc_hold", b"null", "held")
    calls = _counting(runs)
    outcome: list[str] = []
    body = threading.Thread(target=lambda: outcome.append(_run(runs, "held")))
    body.start()
    try:
        wait_for(lambda: ((v := runs.get("held")) is not None and [
            (s.key, s.status) for s in v.steps] == [("sc_hold.sc_tick#0", "succeeded")])
            or None, timeout=10, what="the held success to be written")
        assert body.is_alive()  # written while the body still works
    finally:
        GATE.set()
        body.join(10)
    assert outcome == ["succeeded"]
    assert calls == Counter(start_attempt=1, commit_step=1, settle_run=1)


def test_the_leases_of_many_executions_in_one_process_are_renewed_together(
        redis_url: str) -> None:
    """Forty runs execute at once in this process (as `worker --concurrency 40` does): the
    process's one watchdog thread renews their leases in batches, not a round trip each,
    so many runs (or a slow disk) do not outlast their leases."""
    runs = _runs(redis_url)
    ids = [f"many-{i}" for i in range(40)]
    for run_id in ids:
        _record(runs, "sc_long", b"null", run_id)
    batches: list[int] = []
    singles = _counting(runs)
    renew_attempts = runs.scripts.renew_attempts

    def counted(items: Any) -> Any:
        batches.append(len(items))
        return renew_attempts(items)

    runs.scripts.renew_attempts = counted  # type: ignore[method-assign]
    outcomes: list[str] = []
    lock = threading.Lock()

    def execute_one(run_id: str) -> None:
        outcome = execute(runs, REGISTRY, run_id, 1, worker="w-many", lease_ms=1500,
                          hard_exit=False)
        with lock:
            outcomes.append(outcome)

    bodies = [threading.Thread(target=execute_one, args=(run_id,)) for run_id in ids]
    for body in bodies:
        body.start()
    try:
        wait_for(lambda: sum(batches) >= 3 * len(ids) or None, timeout=30,
                 what="three renewals of every lease")
    finally:
        GATE.set()
        for body in bodies:
            body.join(10)
    assert sorted(outcomes) == ["succeeded"] * len(ids)
    assert singles["renew_attempt"] == 0
    assert max(batches) > 1 and len(batches) < sum(batches) / 4, batches
