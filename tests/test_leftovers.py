"""Findings left after issue 16's fixes, each with the test that failed before its fix:

A. a parent parked on a timer and woken by its child's settle after the due time passed
   the timer without recording it fired (the chaos checker's `timer_once`); and any replay
   that passes a due timer (a resume after a pause that outlasted it) records it fired once;
B. a run settled cancelled by start_attempt cancels its children too;
C. claim_effect refuses an execution whose lease expired.

Real processes (workers, controller) against a fresh durable redis-server where a process
boundary matters, as tests/test_waiting_flow.py; the store's scripts in this process where
only a script's fence is at stake, as tests/test_suspected.py.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import redis

from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.execute import execute
from marbles_rq.engine.execution import Execution
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import OutputEvent, RunStore, RunView
from marbles_rq.store import open_store
from marbles_rq.store.records import StepRecord
from tests import leftover_workflows as lw
from tests.procs import REPO_ROOT, Observer, Procs, wait_for

PROCS_SOURCES = (REPO_ROOT / "tests" / "leftover_workflows.py",)
PROCS_REPORT_LINES = 60


def _of(events: list[OutputEvent], type_: str) -> list[OutputEvent]:
    return [e for e in events if e.type == type_]


def _server_ms(url: str) -> int:
    secs, micros = redis.Redis.from_url(url).time()
    return int(secs) * 1000 + int(micros) // 1000


def _timer(view: RunView, key: str) -> tuple[str, dict[str, Any]]:
    entry = next(s for s in view.steps if s.key == key)
    assert entry.name == "|sleep", entry
    return entry.status, msgspec.json.decode(entry.result)


def _succeeded(obs: Observer, run_id: str) -> tuple[RunView, list[OutputEvent]]:
    obs.wait_final(run_id)
    view, events = obs.view(run_id), obs.events(run_id)
    assert view is not None and view.status == "succeeded", obs.dump(run_id)
    return view, events


def _fired_once(obs: Observer, run_id: str, key: str) -> tuple[RunView, list[OutputEvent]]:
    """The run succeeded, and its timer `key` is recorded fired once, never early: in the
    ledger (status fired) and in the output (one timer_fired naming it)."""
    view, events = _succeeded(obs, run_id)
    status, result = _timer(view, key)
    assert status == "fired", obs.dump(run_id)
    assert result["fired_ms"] >= result["due_ms"], result
    fired = _of(events, "timer_fired")
    assert [e.data["timer"] for e in fired] == [key], obs.dump(run_id)
    assert fired[0].data["due_ms"] == result["due_ms"]
    assert msgspec.json.decode(view.result or b"null")["after"] >= result["due_ms"]
    return view, events


# --------------------------------------------------------------------------------------------
# A. timers passed by a replay


def test_a_child_settling_after_its_parents_timer_came_due_leaves_the_timer_to_fire(
        procs: Procs) -> None:
    """cx_late_parent's finding: the parent starts a child, parks on a timer; the child
    settles after the due time. Its wake must not replay the parent (that replay passed the
    timer with nothing recorded): the parent waits for no child, so the timer wakes it."""
    (worker,) = procs.start(workers=1, controller=False)  # no controller: no timer fires yet
    obs, url, parent = procs.observer, procs.url, "late-parent"
    child = f"{parent}.g"
    procs.enqueue("lo_late_parent", {"seconds": 1.0}, parent)
    view = obs.wait_status(parent, "waiting")
    assert view.wait_reason == "timer", obs.dump(parent)
    _, timer = _timer(view, "lo_late_parent.|sleep#0")
    wait_for(lambda: _server_ms(url) > timer["due_ms"], timeout=10,
             what="the server clock to pass the timer's due time")
    redis.Redis.from_url(url).set(lw.GATE_KEY, 1)  # the child settles now, after the due time
    obs.wait_final(child)
    # Its execution (and its wake of the parent) is over once its work-horse is gone.
    wait_for(lambda: not worker.children(), timeout=20, what="the child's work-horse to exit")

    procs.controller()
    view, events = _fired_once(obs, parent, "lo_late_parent.|sleep#0")
    assert [e.data["cause"] for e in _of(events, "woken")] == ["timer"], obs.dump(parent)
    assert msgspec.json.decode(view.result or b"null")["child"] == 40
    assert (view.attempt, view.resumptions) == (1, 1), obs.dump(parent)


def test_a_resume_after_a_pause_that_outlasted_the_timer_records_it_fired(
        procs: Procs) -> None:
    """A replay that starts past a due timer it was not woken for (here: resumed after a
    pause that outlasted it) records the timer fired, once, as the timer's own wake does."""
    procs.start(workers=1, controller=False)
    obs, url, run_id = procs.observer, procs.url, "paused-sleeper"
    procs.enqueue("lo_sleeper", {"seconds": 1.0}, run_id)
    view = obs.wait_status(run_id, "waiting")
    _, timer = _timer(view, "lo_sleeper.|sleep#0")
    done = procs.cli("pause", run_id)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: _server_ms(url) > timer["due_ms"], timeout=10,
             what="the server clock to pass the timer's due time")
    done = procs.cli("resume", run_id)
    assert done.returncode == 0, done.stderr
    _, events = _fired_once(obs, run_id, "lo_sleeper.|sleep#0")
    assert [e.data["cause"] for e in _of(events, "woken")] == ["resume"], obs.dump(run_id)


def test_a_timer_that_wakes_its_run_is_recorded_fired_once(procs: Procs) -> None:
    """The timer's own path records the same: its wake (woken: timer), then the replay that
    passes it (fired, once)."""
    procs.start(workers=1)
    obs, run_id = procs.observer, "plain-sleeper"
    procs.enqueue("lo_sleeper", {"seconds": 0.5}, run_id)
    _, events = _fired_once(obs, run_id, "lo_sleeper.|sleep#0")
    assert [e.data["cause"] for e in _of(events, "woken")] == ["timer"], obs.dump(run_id)
    done = procs.cli("status", run_id, "--json")
    assert done.returncode == 0, done.stderr
    (timer,) = json.loads(done.stdout)["timers"]
    assert timer["fired_at"] is not None and timer["fired_at"] >= timer["due_at"], timer
    done = procs.cli("status", run_id)
    assert f"fired {timer['fired_at']}" in done.stdout, done.stdout


# --------------------------------------------------------------------------------------------
# B. a run that start_attempt settles cancelled takes its children with it

LEASE_MS = 60_000


@pytest.fixture
def runs(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> RunStore:
    monkeypatch.setenv("MARBLES_REDIS_URL", redis_url)
    return RunStore(open_store(redis_url))


def _record(runs: RunStore, name: str, inp: Any, run_id: str, parent: str = "") -> None:
    record = prepare(RunRequest(name, msgspec.json.encode(inp), run_id), REGISTRY)
    if parent:
        record = msgspec.structs.replace(record, parent=parent)
    assert runs.record(record).created


def _view(runs: RunStore, run_id: str) -> RunView:
    view = runs.get(run_id)
    assert view is not None
    return view


def _expire_lease(runs: RunStore, run_id: str) -> None:
    """The execution is frozen past its lease: its lease's expiry is in the past."""
    keys = runs.keys.run_keys(run_id)
    assert runs.client.zscore(keys.leases, run_id) is not None
    runs.client.zadd(keys.leases, {run_id: _server_ms(runs.store.url) - 1})


def _start_child(runs: RunStore, ex: Execution, child: str) -> None:
    """What mr.start_child writes: the parent's ledger names the child, the child is
    recorded (its parent named), the ledger entry is committed."""
    named = msgspec.Raw(msgspec.json.encode({"id": child, "workflow": "lo_gated_child"}))
    key = f"{ex.record.name}.|child#0"
    entry = StepRecord(version=1, key=key, name="|child", status="running", attempts=1,
                       result=named, seq=0)
    assert runs.note_child(ex, entry) == "ok"
    _record(runs, "lo_gated_child", {"i": 1}, child, parent=ex.run_id)
    assert runs.commit_step(ex, msgspec.structs.replace(entry, status="succeeded"),
                            "child_started", b"{}") == "ok"


def test_a_duplicate_delivery_that_settles_a_cancelled_run_cancels_its_children(
        runs: RunStore) -> None:
    """A parent's execution started a child and froze; cancel was asked (only flagged: it
    was running); its lease expired; a duplicate delivery of the same attempt comes before
    any reap. start_attempt settles the parent cancelled, and the engine cancels its child
    then. Before the fix the child stayed queued and ran its body for a cancelled parent."""
    _record(runs, "lo_late_parent", {"seconds": 1.0}, "b-parent")
    frozen = runs.start("b-parent", 1, ttl_ms=LEASE_MS, worker="frozen").execution
    assert frozen is not None
    _start_child(runs, frozen, "b-parent.g")
    assert runs.cancel("b-parent") == "requested"
    _expire_lease(runs, "b-parent")

    outcome = execute(runs, REGISTRY, "b-parent", 1, worker="dup", lease_ms=LEASE_MS,
                      hard_exit=False)
    assert outcome == "cancelled"
    assert _view(runs, "b-parent").status == "cancelled"
    child = _view(runs, "b-parent.g")
    assert child.status == "cancelled", child
    # Its delivery, already enqueued, starts nothing.
    assert execute(runs, REGISTRY, "b-parent.g", 1, worker="dup", lease_ms=LEASE_MS,
                   hard_exit=False) == "settled"
    assert _view(runs, "b-parent.g").steps == []


# --------------------------------------------------------------------------------------------
# C. an effect claim is fenced by the lease, as a commit is


def test_an_execution_frozen_past_its_lease_claims_no_effect(runs: RunStore) -> None:
    """An execution froze past its lease (no reap yet: its epoch is still the run's, and its
    concurrency slot may be another run's already). It thaws and claims an effect before any
    other write: refused, as its commit would be, and no receipt is written. Before the fix
    the claim won, so the effect could run beside the limit's holders."""
    _record(runs, "lo_sleeper", {"seconds": 1.0}, "c-frozen")
    ex = runs.start("c-frozen", 1, ttl_ms=LEASE_MS, worker="frozen").execution
    assert ex is not None
    assert runs.claim_effect(ex, "charge-1") == "ok"  # with a live lease: claimed
    _expire_lease(runs, "c-frozen")
    assert runs.claim_effect(ex, "charge-2") == "stale_epoch"
    assert runs.claim_effect(ex, "charge-1") == "stale_epoch"  # not even "exists"
    receipts = sorted(m.decode() for m in runs.client.smembers(ex.keys.effects))
    assert receipts == [runs.keys.effect("c-frozen", "charge-1")]
    assert not runs.client.exists(runs.keys.effect("c-frozen", "charge-2"))
    # Its commit is refused the same way, and the reaper redelivers the run.
    entry = StepRecord(version=1, key="lo_sleeper.lo_now#0", name="lo_now",
                       status="succeeded", attempts=1, result=msgspec.Raw(b"1"), seq=0)
    assert runs.commit_step(ex, entry, "step_succeeded", b"{}") == "stale"


def test_a_store_scope_without_a_lease_still_claims(runs: RunStore) -> None:
    """The store's own claim_effect (a scope that is not a run) passes no lease: unchanged."""
    from marbles_rq.store.records import EffectReceipt

    store = runs.store
    assert store.claim_effect(EffectReceipt(version=1, scope="s-1", key="k"), epoch=0).won
    assert not store.claim_effect(EffectReceipt(version=1, scope="s-1", key="k"), epoch=0).won
