"""Fences that must hold when features meet (issue 16, items 1, 3 and 5): a resume that lands
between a "paused" reply and the park, an execution that thaws after its run was purged, and
a parent cancelled while its body is starting a child. Executed in this process against a
real Redis; where an interleaving must be forced, the other party's real call is made at
that point (a resume, a cancel), never a stand-in for the store."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.execute import execute
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import RunStore
from marbles_rq.engine.waits import WaitStore
from marbles_rq.store import open_store

# The test's Redis, for the calls a step makes as "someone else" (an operator's pause).
URL: dict[str, str] = {}
EXECUTED: Counter[str] = Counter()


def _other() -> RunStore:
    """A second client, as another process would have."""
    return RunStore(open_store(URL["url"]))


def fx_first(run_id: str) -> str:
    EXECUTED[f"{run_id}:first"] += 1
    # An operator pauses the run while this step runs: its commit answers "paused".
    WaitStore(_other()).pause(run_id)
    return "a"


def fx_second(run_id: str) -> str:
    EXECUTED[f"{run_id}:second"] += 1
    return "b"


@mr.workflow("fx_pause_between")
def fx_pause_between(ctx: mr.RunContext) -> list[str]:
    return [ctx.step(fx_first, ctx.run_id), ctx.step(fx_second, ctx.run_id)]


@pytest.fixture
def runs(redis_url: str) -> RunStore:
    URL["url"] = redis_url
    EXECUTED.clear()
    return RunStore(open_store(redis_url))


def _record(runs: RunStore, name: str, inp: Any, run_id: str, **changes: Any) -> None:
    record = prepare(RunRequest(name, msgspec.json.encode(inp), run_id))
    if changes:
        record = msgspec.structs.replace(record, **changes)
    assert runs.record(record).created


def _run(runs: RunStore, run_id: str, attempt: int | None = None) -> str:
    view = runs.get(run_id)
    assert view is not None
    return execute(runs, REGISTRY, run_id, attempt or view.delivery, worker="w",
                   lease_ms=60_000, hard_exit=False)


def _events(runs: RunStore, run_id: str, type: str) -> list[dict[str, Any]]:
    return [e.data for e in runs.output(run_id, count=1000)
            if e.type == type]


# --------------------------------------------------------------------------------------------
# 1. a resume between the "paused" reply and the park


class ResumeBeforePark(RunStore):
    """A RunStore whose executions' park is preceded by a real resume of the run from
    another client: the resume lands after the commit answered "paused", before the park."""

    def waits(self) -> WaitStore:
        waits = super().waits()
        park = waits.park

        def resumed_first(ex: Any, **kwargs: Any) -> tuple[str, int, str]:
            assert WaitStore(_other()).resume(ex.run_id)[0] == "resumed"
            return park(ex, **kwargs)

        waits.park = resumed_first  # type: ignore[method-assign]
        return waits


def test_a_resume_that_lands_before_the_park_of_a_pause_requeues_the_run(
        runs: RunStore, redis_url: str) -> None:
    _record(runs, "fx_pause_between", None, "fx-pr")
    racing = ResumeBeforePark(open_store(redis_url))
    # The park sees that the pause it parks for was lifted: queued again at once, not
    # parked "paused" with nothing that would ever wake it.
    assert _run(racing, "fx-pr") == "requeued"
    view = runs.get("fx-pr")
    assert view is not None and (view.status, view.delivery) == ("queued", 2), view
    assert _events(runs, "fx-pr", "woken")[-1] == {"cause": "resume"}
    assert _run(runs, "fx-pr") == "succeeded"
    done = runs.get("fx-pr")
    assert done is not None and msgspec.json.decode(done.result) == ["a", "b"]  # type: ignore[arg-type]
    assert (EXECUTED["fx-pr:first"], EXECUTED["fx-pr:second"]) == (1, 1)


def test_a_pause_asked_again_after_the_resume_still_parks_the_run(
        runs: RunStore, redis_url: str) -> None:
    """pause, resume, pause again, all before the park: the run is paused, not requeued."""

    class PauseAgain(RunStore):
        def waits(self) -> WaitStore:
            waits = super().waits()
            park = waits.park

            def flapped(ex: Any, **kwargs: Any) -> tuple[str, int, str]:
                other = WaitStore(_other())
                assert other.resume(ex.run_id)[0] == "resumed"
                assert other.pause(ex.run_id) == "requested"
                return park(ex, **kwargs)

            waits.park = flapped  # type: ignore[method-assign]
            return waits

    _record(runs, "fx_pause_between", None, "fx-pp")
    assert _run(PauseAgain(open_store(redis_url)), "fx-pp") == "parked"
    view = runs.get("fx-pp")
    assert view is not None and (view.status, view.wait_reason) == ("waiting", "paused")
    assert WaitStore(runs).resume("fx-pp")[0] == "woken"
    assert _run(runs, "fx-pp") == "succeeded"


# --------------------------------------------------------------------------------------------
# 3. an effect claimed by an execution that thaws after its run was purged


@mr.workflow("fx_plain")
def fx_plain(ctx: mr.RunContext) -> int:
    return 1


def test_an_effect_claim_after_its_run_was_purged_is_refused_and_writes_nothing(
        runs: RunStore) -> None:
    _record(runs, "fx_plain", None, "fx-purged", retention_s=0.0)
    frozen = runs.start("fx-purged", 1, ttl_ms=60_000, worker="w").execution
    assert frozen is not None
    assert runs.claim_effect(frozen, "charge") == "ok"  # the effect, once
    # The run finishes (here by the same epoch; a redelivery's would do as well) ...
    assert runs.settle(frozen, "succeeded", result=b"1") == "ok"
    assert runs.claim_effect(frozen, "charge-2") == "stale_epoch"
    # ... and is purged once its retention (0 s) has passed.
    receipts = sorted(m.decode() for m in runs.client.smembers(frozen.keys.effects))
    purged = runs.scripts.purge_run(keys=frozen.keys, run_id="fx-purged", receipts=receipts)
    assert purged.status == "ok", purged
    assert runs.get("fx-purged") is None
    # The frozen execution thaws and claims its effects: refused, and nothing comes back.
    assert runs.claim_effect(frozen, "charge") == "stale_epoch"
    assert runs.claim_effect(frozen, "charge-3") == "stale_epoch"
    left = [k.decode() for k in runs.client.scan_iter(match="*fx-purged*")]
    assert left == [], left


# --------------------------------------------------------------------------------------------
# 5. a parent cancelled while its body starts a child


def _status(run_id: str) -> str | None:
    view = _other().get(run_id)
    return None if view is None else view.status


def _until(predicate: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@mr.workflow("fx_kid")
def fx_kid(ctx: mr.RunContext) -> str:
    EXECUTED[f"{ctx.run_id}:body"] += 1
    return "kid"


@mr.workflow("fx_parent_after_cancel")
def fx_parent_after_cancel(ctx: mr.RunContext) -> str:
    # Busy outside any step boundary (a long computation, or a sibling branch in a step)
    # while the parent is cancelled and its watchdog settles it and walks its children.
    _until(lambda: _status(ctx.run_id) == "cancelled", "the parent settled cancelled")
    return mr.start_child("fx_kid", None, key="late").id


@mr.workflow("fx_parent")
def fx_parent(ctx: mr.RunContext) -> Any:
    return mr.start_child("fx_kid", None, key="racing").result()


class CancelBeforeChildRecord(RunStore):
    """A RunStore whose child records are preceded by a real cancel of the parent, and wait
    until the parent's own watchdog (another thread) has settled it cancelled and walked
    its children: the cancel's walk lands between start_child's first write and the child's
    record."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.walked = threading.Event()

    def waits(self) -> WaitStore:
        # The settle walks the children right after it lands: the record must wait for the
        # walk itself, not only for the status, or the walk may find the child after all.
        store = super().waits()
        walk = store.cancel_children

        def walk_then_tell(run_id: str) -> list[str]:
            try:
                return walk(run_id)
            finally:
                self.walked.set()

        store.cancel_children = walk_then_tell  # type: ignore[method-assign]
        return store

    def record(self, record: Any, push: Any = None) -> Any:
        if record.parent:
            assert _other().cancel(record.parent) == "requested"
            _until(lambda: _status(record.parent) == "cancelled", "the parent's settle")
            assert self.walked.wait(30), "the parent's walk of its children"
        return super().record(record, push)


def _execute_short_lease(runs: RunStore, run_id: str) -> str:
    # A short lease: the watchdog renews every 0.3 s and learns of the cancel from it.
    return execute(runs, REGISTRY, run_id, 1, worker="w", lease_ms=900, hard_exit=False)


def test_a_parent_settled_cancelled_before_its_body_starts_a_child_records_no_child(
        runs: RunStore) -> None:
    _record(runs, "fx_parent_after_cancel", None, "fx-pac")
    done: list[str] = []
    body = threading.Thread(target=lambda: done.append(_execute_short_lease(runs, "fx-pac")))
    body.start()
    _until(lambda: _status("fx-pac") == "running", "the parent's start")
    assert runs.cancel("fx-pac") == "requested"
    body.join(30)
    assert not body.is_alive() and done, done
    assert _status("fx-pac") == "cancelled"
    # The child is refused before it is recorded: nothing would ever cancel it.
    kid = runs.get("fx-pac.late")
    assert kid is None or (kid.status == "cancelled"), kid
    if kid is not None:
        assert _run(runs, "fx-pac.late") in ("settled", "cancelled")
    assert EXECUTED["fx-pac.late:body"] == 0


@pytest.mark.parametrize("where", ["redis_url", "cluster_url"])
def test_a_child_recorded_after_its_parents_cancel_walked_its_children_never_runs(
        request: pytest.FixtureRequest, where: str) -> None:
    url = request.getfixturevalue(where)
    URL["url"] = url
    EXECUTED.clear()
    runs = RunStore(open_store(url))
    parent, child = f"fx-race-{where[:3]}", f"fx-race-{where[:3]}.racing"
    if where == "cluster_url":  # the case a script cannot cover: two slots
        keys = runs.keys
        assert keys.tag_of(parent) != keys.tag_of(child)
    _record(runs, "fx_parent", None, parent)
    # The watchdog learned of the cancel and settled the run; the body's next write was
    # refused, and the delivery says why it stopped.
    assert _execute_short_lease(CancelBeforeChildRecord(open_store(url)), parent) == (
        "cancelled")
    assert _status(parent) == "cancelled"
    # Recorded after the walk, the child is cancelled by the execution that recorded it (it
    # reads its own run after the record), before any delivery: its body never runs.
    view = runs.get(child)
    assert view is not None and view.status == "cancelled", view
    assert _run(runs, child) == "settled"
    assert EXECUTED[f"{child}:body"] == 0
    notes = [e.data for e in runs.output(child) if e.type == "final"]
    assert notes and parent in str(notes[0]), notes


class FinishBeforeChildRecord(RunStore):
    """A RunStore whose child records come after the parent was settled succeeded by a newer
    execution (this one is the zombie that a redelivery outran): the parent's status is set
    as that settle sets it, between start_child's note and its record."""

    def record(self, record: Any, push: Any = None) -> Any:
        if record.parent:
            self.client.hset(self.keys.run(record.parent), "status", "succeeded")
        return super().record(record, push)


def test_a_child_recorded_after_its_parent_finished_is_cancelled_never_delivered(
        redis_url: str) -> None:
    URL["url"] = redis_url
    EXECUTED.clear()
    runs = RunStore(open_store(redis_url))
    _record(runs, "fx_parent", None, "fx-zombie")
    _execute_short_lease(FinishBeforeChildRecord(open_store(redis_url)), "fx-zombie")
    kid = runs.get("fx-zombie.racing")
    assert kid is not None and kid.status == "cancelled", kid  # nothing would gather it
    assert _run(runs, "fx-zombie.racing") == "settled"
    assert EXECUTED["fx-zombie.racing:body"] == 0


def test_a_child_whose_parent_was_cancelled_is_cancelled_when_its_delivery_starts(
        runs: RunStore) -> None:
    """The second line: a child recorded, then its parent cancelled before the recording
    execution could look (it died there), is cancelled when its delivery starts."""
    _record(runs, "fx_parent", None, "fx-dead")
    assert runs.cancel("fx-dead") == "cancelled"  # queued: settled at once, nothing walked
    kid = prepare(RunRequest("fx_kid", b"null", "fx-dead.k", origin="child"), REGISTRY)
    assert runs.record(msgspec.structs.replace(kid, parent="fx-dead")).created
    assert _run(runs, "fx-dead.k") == "cancelled"
    assert _status("fx-dead.k") == "cancelled"
    assert EXECUTED["fx-dead.k:body"] == 0
    notes = [e.data for e in runs.output("fx-dead.k") if e.type == "cancel_requested"]
    assert notes and "fx-dead" in str(notes[0]), notes


@pytest.mark.parametrize("parent_is", ["superseded", "cancel requested", "paused", "settled"])
def test_a_parent_execution_that_may_not_go_on_notes_no_child(
        runs: RunStore, parent_is: str) -> None:
    """note_child, the first write of start_child, refuses (and writes nothing) for an
    execution that is stale, or whose run is cancelled, paused or finished."""
    from marbles_rq.store.records import StepRecord

    _record(runs, "fx_parent", None, "fx-nc")
    ex = runs.start("fx-nc", 1, ttl_ms=60_000, worker="w").execution
    assert ex is not None
    if parent_is == "superseded":  # handed back: a newer delivery owns the run
        assert runs.defer(ex, "test", delay_ms=60_000) == "ok"
    elif parent_is == "cancel requested":
        assert runs.cancel("fx-nc") == "requested"
    elif parent_is == "paused":
        assert WaitStore(runs).pause("fx-nc") == "requested"
    else:
        assert runs.settle(ex, "succeeded", result=b"null") == "ok"
    note = StepRecord(version=1, key="fx_parent.|child#0", name="|child", status="running",
                      attempts=1, result=msgspec.Raw(b'{"id":"fx-nc.k","workflow":"fx_kid"}'))
    expected = {"superseded": "stale", "cancel requested": "cancelled", "paused": "paused",
                "settled": "stale"}[parent_is]
    assert runs.note_child(ex, note) == expected
    assert runs.client.hget(ex.keys.steps, note.key) is None
