"""Runs that wait, part 2: durable timers, child runs, parallel steps, threads and replay
safety (issue 8, acceptance item 9).

Where a process boundary matters (a timer outliving its controller and worker, a worker
killed around a child run or mid-parallel) the tests drive real `marbles-rq worker` and
`controller` processes against a fresh durable redis-server and send real signals; they
wait on events (run status, the output journal, the server clock), never on sleeps. Pure
engine logic (replay checks, parallel cancellation, frames, threads) executes in this
process against a real Redis, like tests/test_replay.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections import Counter
from typing import Any

import msgspec
import pytest
import redis

import marbles_rq as mr
from marbles_rq.controller import Controller
from marbles_rq.controller.waiting import WaitingDuty
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.execute import execute
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import OutputEvent, RunStore, RunView
from marbles_rq.engine.waits import WaitStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from tests import flow_workflows as fw
from tests.procs import REPO_ROOT, Observer, Proc, Procs, descendants, pid_alive, wait_for

FLOW_SOURCE = REPO_ROOT / "tests" / "flow_workflows.py"
PROCS_SOURCES = (FLOW_SOURCE,)
PROCS_REPORT_LINES = 60
CTL_LEASE_MS = 2000  # a restarted controller takes over a killed one's lease this soon


# --------------------------------------------------------------------------------------------
# helpers


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


def _effects(url: str, run_id: str) -> Counter[str]:
    """How often each effect of run `run_id` ran (effect steps of other runs left out)."""
    return Counter(e.split(":", 1)[1] for e in _client(url).lrange(fw.EFFECTS_KEY, 0, -1)
                   if e.split(":", 1)[0] == run_id)


def _of(events: list[OutputEvent], type_: str, **data: Any) -> list[OutputEvent]:
    return [e for e in events if e.type == type_
            and all(e.data.get(k) == v for k, v in data.items())]


def _started(events: list[OutputEvent], step: str) -> int:
    return len(_of(events, "step_started", step=step))


def _succeeded(obs: Observer, run_id: str) -> tuple[RunView, list[OutputEvent]]:
    obs.wait_final(run_id)
    view, events = obs.view(run_id), obs.events(run_id)
    assert view is not None and view.status == "succeeded", obs.dump(run_id)
    assert len(_of(events, "final")) == 1, obs.dump(run_id)
    return view, events


def _result(view: RunView) -> Any:
    return msgspec.json.decode(view.result or b"null")


def _status_json(procs: Procs, run_id: str) -> dict[str, Any]:
    done = procs.cli("status", run_id, "--json")
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def _children_of(procs: Procs, parent: str) -> list[str]:
    """The runs whose record names `parent` as their parent (`marbles-rq runs --json`)."""
    done = procs.cli("runs", "--json", "--limit", "1000")
    assert done.returncode == 0, done.stderr
    return sorted(r["id"] for r in json.loads(done.stdout) if r["parent"] == parent)


def _wait_holding(procs: Procs, run_id: str) -> None:
    procs.observer.wait_list(fw.HOLDING_KEY, lambda items: run_id in items,
                             what=f"run {run_id} to reach its hold point")


def _kill_worker(worker: Proc) -> None:
    """SIGKILL a worker's process group and its work-horse's (RQ's horse has a group of
    its own), and reap them."""
    tree = descendants(worker.pid)
    for pid in [worker.pid, *tree]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    worker.wait_exit(10)
    wait_for(lambda: not any(pid_alive(p) for p in tree), timeout=10,
             what=f"the processes {tree} of worker {worker.pid} to die")


def _server_ms(url: str) -> int:
    return fw.server_ms(redis.Redis.from_url(url))


def _due_ms(view: RunView, key: str) -> int:
    entry = next(s for s in view.steps if s.key == key)
    assert entry.name == "|sleep", entry
    return int(msgspec.json.decode(entry.result)["due_ms"])


# --------------------------------------------------------------------------------------------
# 1. durable timers


def test_a_sleeping_run_holds_no_worker_and_fires_once_never_early(procs: Procs) -> None:
    (worker,) = procs.start(workers=1, controller=False)  # no controller: no timer fires
    obs, url, run_id = procs.observer, procs.url, "timer-1"
    procs.enqueue("fl_timer", {"seconds": 1.5}, run_id)
    view = obs.wait_status(run_id, "waiting")
    assert view.wait_reason == "timer", obs.dump(run_id)
    due = _due_ms(view, "fl_timer.|sleep#0")
    status = _status_json(procs, run_id)
    assert status["waiting"]["reason"] == "timer"
    assert status["waiting"]["for"] == {"until_ms": due}
    assert [t["path"] for t in status["timers"]] == ["fl_timer.|sleep"]
    # It holds no worker: no lease, no worker named, no work-horse; the one worker runs
    # another run to the end while it waits.
    assert view.worker is None and status["worker"] is None
    assert _client(url).zscore(obs.runs.keys.run_keys(run_id).leases, run_id) is None
    wait_for(lambda: not worker.children(), timeout=10, what="the work-horse to exit")
    procs.enqueue("fl_quick", None, "quick-1")
    _succeeded(obs, "quick-1")
    assert obs.status(run_id) == "waiting"
    wait_for(lambda: _server_ms(url) > due, timeout=10, what="the server clock to pass due")
    assert obs.status(run_id) == "waiting"  # due, but nothing wakes it without a controller
    assert not _of(obs.events(run_id), "woken")

    procs.controller()
    view, events = _succeeded(obs, run_id)
    result = _result(view)
    # Fired once, and never early: the step after the sleep ran on a server clock at or
    # past the due time the sleep recorded (itself >= the clock before + 1.5 s).
    assert due >= result["before"] + 1500, (due, result)
    assert result["after"] >= due, (due, result)
    assert len(_of(events, "parked", reason="timer")) == 1, obs.dump(run_id)
    woken = _of(events, "woken")
    assert [e.data["cause"] for e in woken] == ["timer"], obs.dump(run_id)
    assert (view.attempt, view.resumptions, view.delivery) == (1, 1, 2)
    assert _effects(url, run_id) == {"before": 1, "after": 1}
    assert _started(events, "fl_timer.fl_now#0") == 1  # recorded before the sleep: replayed
    assert [s.key for s in view.steps if s.name == "|sleep"] == ["fl_timer.|sleep#0"]


def test_a_timer_due_while_controller_and_worker_are_down_fires_once(procs: Procs) -> None:
    (worker,) = procs.start(workers=1, controller=False)
    controller = procs.controller(lease_ms=CTL_LEASE_MS)
    obs, url, run_id = procs.observer, procs.url, "timer-down"
    procs.enqueue("fl_timer", {"seconds": 2.0}, run_id)
    view = obs.wait_status(run_id, "waiting")
    due = _due_ms(view, "fl_timer.|sleep#0")
    controller.kill9()
    assert _server_ms(url) < due, "the timer came due before the kill: make it longer"
    _kill_worker(worker)
    wait_for(lambda: _server_ms(url) > due + 200, timeout=10,
             what="the server clock to pass the timer's due time")
    assert obs.status(run_id) == "waiting" and not _of(obs.events(run_id), "woken")

    procs.controller(lease_ms=CTL_LEASE_MS)  # wakes it on startup recovery
    obs.wait_status(run_id, "queued")
    assert len(_of(obs.events(run_id), "woken")) == 1
    procs.worker()
    view, events = _succeeded(obs, run_id)
    assert [e.data["cause"] for e in _of(events, "woken")] == ["timer"], obs.dump(run_id)
    assert _result(view)["after"] >= due
    assert _effects(url, run_id) == {"before": 1, "after": 1}
    assert (view.attempt, view.resumptions, view.delivery) == (1, 1, 2)


def test_a_timer_after_a_child_that_woke_its_running_parent_fires_once(procs: Procs) -> None:
    """A child that finishes while its parent still executes leaves a wake for the parent;
    once the parent has its result, that wake is spent: a later timer is not cut short."""
    procs.start(workers=1, pool=2)
    obs, run_id = procs.observer, "child-then-sleep"
    procs.enqueue("fl_child_then_sleep", None, run_id)
    view, events = _succeeded(obs, run_id)
    due = _due_ms(view, "fl_child_then_sleep.|sleep#0")
    assert _result(view)["after"] >= due
    assert [e.data["reason"] for e in _of(events, "parked")] == ["timer"], obs.dump(run_id)
    assert [e.data["cause"] for e in _of(events, "woken")] == ["timer"], obs.dump(run_id)
    assert (view.attempt, view.resumptions, view.delivery) == (1, 1, 2), obs.dump(run_id)


def test_sleep_until_takes_an_aware_datetime_and_refuses_a_naive_one(procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    # Half a millisecond into a millisecond, in a zone five hours east of UTC: the timer
    # is due at that instant (never before it), whatever the zone.
    procs.enqueue("fl_until", {"in_ms": 1500, "tz_hours": 5}, "until-aware")
    procs.enqueue("fl_until", {"in_ms": 1500, "naive": True}, "until-naive")

    view, events = _succeeded(obs, "until-aware")
    at_us, due = _result(view)["at_us"], _due_ms(view, "fl_until.|sleep#0")
    assert due * 1000 >= at_us and due * 1000 - at_us < 1000, (due, at_us)
    assert _result(view)["after"] >= due
    assert len(_of(events, "woken")) == 1

    obs.wait_final("until-naive")
    naive = obs.view("until-naive")
    assert naive is not None and naive.status == "failed", obs.dump("until-naive")
    assert naive.error is not None and naive.error.type == "InputError"
    assert "timezone-aware" in naive.error.message
    assert not [s for s in naive.steps if s.name == "|sleep"]  # nothing was recorded


# --------------------------------------------------------------------------------------------
# 2. child runs


def _child_result(child_id: str, v: int) -> dict[str, Any]:
    return {"child": child_id, "v": v * 10}


def test_a_parent_waits_for_its_child_under_a_stable_id(procs: Procs) -> None:
    procs.start(workers=1)
    obs, url, parent = procs.observer, procs.url, "parent-1"
    child = f"{parent}.c0"
    procs.enqueue("fl_parent", {"child": {"v": 4, "nap_s": 0.2}}, parent)
    view, events = _succeeded(obs, parent)
    assert _result(view) == {"child_id": child, "result": _child_result(child, 4)}
    assert _children_of(procs, parent) == [child]
    assert [e.data for e in _of(events, "child_started")] == [
        {"child": child, "workflow": "fl_child"}]
    assert [e.data for e in _of(events, "parked")] == [{"reason": "child",
                                                        "children": [child]}]
    assert _effects(url, child) == {"child-effect": 1}
    assert _effects(url, parent) == {"parent-effect": 1}

    parent_status, child_status = _status_json(procs, parent), _status_json(procs, child)
    assert parent_status["children"] == [{"id": child, "workflow": "fl_child"}]
    assert parent_status["parent"] is None
    assert child_status["parent"] == parent and child_status["children"] == []
    assert child_status["status"] == "succeeded"


def test_gather_returns_every_childs_result_in_call_order(procs: Procs) -> None:
    procs.start(workers=1)
    obs, url, parent = procs.observer, procs.url, "gather-1"
    procs.enqueue("fl_gather", {"values": [3, 1, 2]}, parent)
    view, events = _succeeded(obs, parent)
    ids = [f"{parent}.k{i}" for i in range(3)]
    assert _result(view) == [_child_result(ids[0], 3), _child_result(ids[1], 1),
                             _child_result(ids[2], 2)]
    assert _children_of(procs, parent) == ids
    assert all(_effects(url, cid) == {"child-effect": 1} for cid in ids)
    parked = _of(events, "parked")
    assert parked and parked[0].data == {"reason": "child", "children": ids}, obs.dump(parent)


def test_a_failed_child_raises_child_failed_error_in_its_parent(procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    procs.enqueue("fl_parent", {"child": {"v": 1, "fail": True}}, "fails-1")
    procs.enqueue("fl_parent", {"child": {"v": 2, "fail": True}, "catch": True}, "catches-1")

    obs.wait_final("fails-1")
    failed = obs.view("fails-1")
    assert failed is not None and failed.status == "failed", obs.dump("fails-1")
    assert failed.error is not None and failed.error.type == "ChildFailedError"
    assert failed.error.message == "child run fails-1.c0 failed: ValueError: child 1 broke"

    view, _ = _succeeded(obs, "catches-1")
    assert _result(view) == {"caught": "catches-1.c0", "status": "failed",
                             "error": "child 2 broke"}
    for parent in ("fails-1", "catches-1"):
        assert _effects(procs.url, parent) == {}  # nothing after the failed child's result
        assert _effects(procs.url, f"{parent}.c0") == {"child-effect": 1}


def test_a_child_cancelled_while_its_parent_waits_fails_the_parent(procs: Procs) -> None:
    procs.start(workers=1)
    obs, parent = procs.observer, "cancels-1"
    child = f"{parent}.c0"
    procs.enqueue("fl_parent", {"child": {"nap_s": 3600}}, parent)
    obs.wait_status(child, "waiting")
    view = obs.wait_status(parent, "waiting")
    assert view.wait_reason == "child" and view.wait_for == {"children": [child]}
    done = procs.cli("cancel", child)
    assert done.returncode == 0 and f"run {child} cancelled" in done.stdout, done.stderr

    obs.wait_final(parent)
    view = obs.view(parent)
    assert view is not None and view.status == "failed", obs.dump(parent)
    assert view.error is not None and view.error.type == "ChildFailedError"
    assert view.error.message == f"child run {child} cancelled: cancelled"
    # No worker settled the child, so none woke the parent: the controller's check did.
    assert [e.data for e in _of(obs.events(parent), "woken")] == [{"cause": "child"}]
    assert obs.status(child) == "cancelled"


KILL_POINTS = {
    # where the kill lands: (the parent's input, the run whose hold point the test waits for)
    "parent-after-child-recorded": ({"child": {"v": 5}, "gate": True}, "{parent}"),
    "child-mid-run": ({"child": {"v": 5, "hold": True}}, "{parent}.c0"),
    "parent-while-waiting": ({"child": {"v": 5, "nap_s": 1.5}}, None),
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_killed_worker_around_a_child_run_loses_and_repeats_nothing(procs: Procs,
                                                                      point: str) -> None:
    (worker,) = procs.start(workers=1)
    obs, url, parent = procs.observer, procs.url, f"kp-{point}"
    child = f"{parent}.c0"
    inp, holder = KILL_POINTS[point]
    procs.enqueue("fl_parent", inp, parent)
    if holder is not None:
        _wait_holding(procs, holder.format(parent=parent))
    else:
        obs.wait_status(child, "waiting")
        obs.wait_status(parent, "waiting")
    if point == "parent-after-child-recorded":
        # The child is recorded and enqueued; the parent has not waited on it yet.
        assert _children_of(procs, parent) == [child]
        assert obs.status(parent) == "running" and obs.status(child) == "queued"
    elif point == "child-mid-run":
        assert obs.status(parent) == "waiting" and obs.status(child) == "running"
        assert _effects(url, child) == {"child-effect": 1}
    _kill_worker(worker)
    procs.worker()

    view, events = _succeeded(obs, parent)
    assert _result(view) == {"child_id": child, "result": _child_result(child, 5)}
    assert _children_of(procs, parent) == [child]  # exactly one child run
    child_view, child_events = _succeeded(obs, child)
    assert child_view.record.parent == parent
    assert _effects(url, child) == {"child-effect": 1}  # the child's effect ran once
    assert _effects(url, parent) == {"parent-effect": 1}
    assert len(_of(events, "child_started")) == 1
    redelivered = {"parent-after-child-recorded": events,
                   "child-mid-run": child_events}.get(point)
    if redelivered is not None:  # the killed execution came back as a redelivery
        assert _of(redelivered, "redelivered"), obs.dump(parent) + obs.dump(child)


# --------------------------------------------------------------------------------------------
# 3. parallel steps


def test_kill9_mid_parallel_reruns_only_the_unfinished_branch(procs: Procs) -> None:
    (worker,) = procs.start(workers=1)
    obs, url, run_id = procs.observer, procs.url, "par-kill"
    slow, fast = "fl_par.|parallel#0[0].fl_slow#0", "fl_par.|parallel#0[1].fl_fast#0"
    procs.enqueue("fl_par", None, run_id)
    # Branch 1 finishes first; branch 0 is still in its step when the worker dies.
    obs.wait_event(run_id, lambda e: e.type == "step_succeeded" and e.data["step"] == fast,
                   what="the fast branch's step to succeed")
    _wait_holding(procs, run_id)
    _kill_worker(worker)
    procs.worker()

    view, events = _succeeded(obs, run_id)
    assert _result(view) == ["slow-a", "fast-b"]  # in call order, not finish order
    assert {s.key: (s.status, s.attempts) for s in view.steps} == {
        slow: ("succeeded", 2), fast: ("succeeded", 1)}
    assert _started(events, fast) == 1 and _started(events, slow) == 2, obs.dump(run_id)
    assert _effects(url, run_id) == {"slow-a": 2, "fast-b": 1}
    assert _of(events, "redelivered"), obs.dump(run_id)


# --------------------------------------------------------------------------------------------
# in-process: the engine against a real Redis (one server for the session, emptied per test)


class Crash(BaseException):
    """Stands in for the process dying mid-run: nothing is settled."""


CRASH: set[str] = set()   # workflows that crash after their first recorded call
FLIP: set[str] = set()    # workflows whose replay calls something else
CALLS: Counter[str] = Counter()
TRIES: Counter[str] = Counter()


@pytest.fixture
def runs(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> RunStore:
    monkeypatch.setenv("MARBLES_REDIS_URL", redis_url)  # where flow_workflows' effects go
    CRASH.clear()
    FLIP.clear()
    CALLS.clear()
    TRIES.clear()
    return RunStore(open_store(redis_url))


def _record(runs: RunStore, name: str, inp: Any, run_id: str) -> None:
    assert runs.record(prepare(RunRequest(name, msgspec.json.encode(inp), run_id))).created


def _run(runs: RunStore, run_id: str, attempt: int) -> str:
    return execute(runs, REGISTRY, run_id, attempt, worker="w", lease_ms=60_000,
                   hard_exit=False)


def _view(runs: RunStore, run_id: str) -> RunView:
    view = runs.get(run_id)
    assert view is not None
    return view


def _redeliver(runs: RunStore, url: str, run_id: str, attempt: int) -> None:
    """What the worker parent and the controller do when a horse dies."""
    assert runs.abandon(run_id, attempt, "w") == "ok"
    ctl = Controller(runs, rq_connection(url))
    assert ctl.lead()
    assert ctl.reap() == 1


def _wake_timer(runs: RunStore, run_id: str) -> int:
    """Wake a parked timer the way the controller does, once the server clock passed it."""
    view = _view(runs, run_id)
    assert view.status == "waiting" and view.wait_reason == "timer", view
    until = int((view.wait_for or {})["until_ms"])
    wait_for(lambda: fw.server_ms(runs.client) >= until, timeout=10,
             what="the server clock to pass the timer")
    ctl = Controller(runs, rq_connection(runs.store.url))
    assert ctl.lead()
    handled, woken = WaitingDuty(threaded=False).wake_due(ctl)
    assert woken == 1, (handled, woken)
    return _view(runs, run_id).delivery


# -- 3. parallel (engine logic)


def test_a_failing_branch_stops_its_sibling_at_its_next_step_boundary(runs: RunStore) -> None:
    _record(runs, "fl_par_fail", None, "par-fail")
    assert _run(runs, "par-fail", 1) == "failed"
    view, events = _view(runs, "par-fail"), list(runs.output("par-fail", count=1000))
    assert view.error is not None
    assert (view.error.type, view.error.message, view.error.step) == (
        "ValueError", "branch a broke", "fl_par_fail.|parallel#0[0].fl_boom#0")
    b1, b2 = "fl_par_fail.|parallel#0[1].fl_b1#0", "fl_par_fail.|parallel#0[1].fl_b2#0"
    # The sibling finished the step it was in, and started no other.
    assert [e.data["step"] for e in _of(events, "step_started")] in (
        ["fl_par_fail.|parallel#0[0].fl_boom#0", b1], [b1, "fl_par_fail.|parallel#0[0].fl_boom#0"])
    assert not _started(events, b2)
    assert _effects(runs.store.url, "par-fail") == {"boom": 1, "b1": 1}
    # The failure is reported once the sibling has stopped: after its last step's commit.
    types = [(e.type, e.data.get("step")) for e in events]
    assert types.index(("step_succeeded", b1)) < types.index(("final", None)), types
    assert [s.key for s in view.steps if s.key.endswith("fl_b1#0")] == [b1]


@pytest.mark.parametrize("how", ["sleep", "question"])
def test_a_branch_that_waits_parks_the_run_once_its_sibling_is_done(runs: RunStore,
                                                                     how: str) -> None:
    run_id = f"par-park-{how}"
    sibling = "fl_par_park.|parallel#0[1].fl_sibling#0"
    _record(runs, "fl_par_park", {"how": how}, run_id)
    assert _run(runs, run_id, 1) == "parked"
    view = _view(runs, run_id)
    assert view.status == "waiting" and view.wait_reason == ("timer" if how == "sleep"
                                                             else "question")
    events = list(runs.output(run_id, count=1000))
    types = [(e.type, e.data.get("step")) for e in events]
    assert types.index(("step_succeeded", sibling)) < types.index(("parked", None)), types
    if how == "sleep":
        attempt = _wake_timer(runs, run_id)
    else:
        attempt = WaitStore(runs).answer(run_id, "go", "yes", kind="question").woken_attempt
    assert attempt == 2
    assert _run(runs, run_id, 2) == "succeeded"
    view, events = _view(runs, run_id), list(runs.output(run_id, count=1000))
    assert _result(view) == ["slept" if how == "sleep" else "yes", "sibling"]
    assert _started(events, sibling) == 1  # recorded once; replayed after the wake
    assert _effects(runs.store.url, run_id) == {"sibling": 1}


@mr.workflow("fl_mixed")
def fl_mixed(ctx: mr.RunContext, inp: dict[str, str]) -> list[Any]:
    def waits() -> Any:
        if inp["how"] == "question":
            return mr.ask.question("Go on?", choices=["yes", "no"], key="go")
        mr.sleep(3.5)  # due well after the controller's first check of the child (at 2 s)
        return "slept"

    return mr.parallel(
        waits, lambda: mr.start_child("fl_child", fw.ChildInput(v=4), key="slow").result())


@pytest.mark.parametrize("how", ["question", "sleep"])
def test_a_run_waiting_for_a_child_and_more_wakes_for_whichever_is_done_first(
        runs: RunStore, how: str) -> None:
    """One branch asks or sleeps, the other waits for a child. The controller's checks of
    the unfinished child wake nothing (no replay at every check while the question is
    open), and the timer wakes the run when it is due, not once the child has finished."""
    run_id, waits = f"mixed-{how}", runs.keys.run_keys(f"mixed-{how}").waits
    child = f"{run_id}.slow"
    _record(runs, "fl_mixed", {"how": how}, run_id)
    assert _run(runs, run_id, 1) == "parked"
    view = _view(runs, run_id)
    assert view.wait_reason == ("question" if how == "question" else "child")
    assert (view.wait_for or {})["children"] == [child]
    ctl = Controller(runs, rq_connection(runs.store.url))
    assert ctl.lead()
    duty = WaitingDuty(threaded=False)

    def next_check() -> float:
        at = runs.client.zscore(waits, run_id)
        assert at is not None
        wait_for(lambda: fw.server_ms(runs.client) >= at, timeout=10,
                 what="the controller's next look at the run to come due")
        return at

    check = next_check()
    assert duty.wake_due(ctl) == (1, 0)  # the child's check: not done, nothing to wake
    view = _view(runs, run_id)
    assert (view.status, view.attempt) == ("waiting", 1)
    assert (runs.client.zscore(waits, run_id) or 0) > check  # it looks again later
    if how == "question":
        assert WaitStore(runs).answer(run_id, "go", "1", kind="question").woken_attempt == 2
    else:
        until = int((view.wait_for or {})["until_ms"])
        assert next_check() <= until  # looked at again no later than the timer's due time
        assert duty.wake_due(ctl) == (1, 1)
        assert [e.data for e in _of(list(runs.output(run_id, count=1000)), "woken")] == [
            {"cause": "timer"}]
    assert _run(runs, run_id, 2) == "parked"  # its other branch done; on the child alone
    assert _view(runs, run_id).wait_for == {"children": [child]}
    assert _run(runs, child, 1) == "succeeded"  # and wakes its parent
    assert _run(runs, run_id, 3) == "succeeded"
    assert _result(_view(runs, run_id)) == ["yes" if how == "question" else "slept",
                                            _child_result(child, 4)]


# -- 4. threads


@mr.step
def fl_t_step() -> str:
    CALLS["fl_t_step"] += 1
    return "ran"


THREAD_CALLS = {
    "decorated step": lambda ctx: fl_t_step(),
    "ctx.step": lambda ctx: ctx.step(fl_t_step),
    "mr.sleep": lambda ctx: mr.sleep(0.1),
    "ctx.sleep": lambda ctx: ctx.sleep(0.1),
    "mr.start_child": lambda ctx: mr.start_child("fl_quick"),
}


@mr.workflow("fl_thread")
def fl_thread(ctx: mr.RunContext, inp: dict[str, str]) -> str:
    caught: list[BaseException] = []

    def call() -> None:
        try:
            THREAD_CALLS[inp["call"]](ctx)
        except BaseException as exc:  # handed to the body, which raises it
            caught.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    if caught:
        raise caught[0]
    return "the call went through"


@pytest.mark.parametrize("call", list(THREAD_CALLS))
def test_a_recorded_call_from_a_thread_the_body_started_is_refused(runs: RunStore,
                                                                    call: str) -> None:
    run_id = "thread-" + call.replace(" ", "-").replace(".", "-")
    _record(runs, "fl_thread", {"call": call}, run_id)
    assert _run(runs, run_id, 1) == "failed"
    view = _view(runs, run_id)
    assert view.error is not None and view.error.type == "MarblesError", view.error
    assert f"called from a thread that run {run_id} started" in view.error.message
    assert "mr.parallel" in view.error.message
    assert CALLS["fl_t_step"] == 0 and view.steps == []  # nothing ran, nothing recorded
    assert [r.record.id for r in runs.list_runs(limit=10)] == [run_id]  # no child either


# -- 5. replay safety


@mr.step
def fl_nd_a() -> str:
    CALLS["fl_nd_a"] += 1
    return "a"


@mr.step
def fl_nd_b() -> str:
    CALLS["fl_nd_b"] += 1
    return "b"


@mr.step
def fl_nd_outer() -> list[str]:
    first, second = (fl_nd_b, fl_nd_a) if "fl_nd" in FLIP else (fl_nd_a, fl_nd_b)
    out = [first()]
    if "fl_nd" in CRASH:
        raise Crash
    return [*out, second()]


@mr.workflow("fl_nd")
def fl_nd(ctx: mr.RunContext, inp: dict[str, str]) -> Any:
    if inp["where"] == "nested":
        return fl_nd_outer()
    if "fl_nd" in FLIP:
        mr.sleep(0)
    else:
        fl_nd_a()
    if "fl_nd" in CRASH:
        raise Crash
    return fl_nd_b()


ND_CASES = {
    # where: (the frame path, the recorded name, the name the replay calls)
    "root": ("fl_nd", "fl_nd_a", "mr.sleep"),
    "nested": ("fl_nd.fl_nd_outer#0", "fl_nd_a", "fl_nd_b"),
}


@pytest.mark.parametrize("where", list(ND_CASES))
def test_a_replay_that_calls_something_else_fails_the_run(runs: RunStore, redis_url: str,
                                                          where: str) -> None:
    run_id = f"nd-{where}"
    _record(runs, "fl_nd", {"where": where}, run_id)
    CRASH.add("fl_nd")
    with pytest.raises(Crash):
        _run(runs, run_id, 1)
    _redeliver(runs, redis_url, run_id, 1)
    CRASH.clear()
    FLIP.add("fl_nd")  # the code changed between the deliveries
    assert _run(runs, run_id, 2) == "failed"
    view = _view(runs, run_id)
    frame, recorded, called = ND_CASES[where]
    assert view.error is not None and view.error.type == "NonDeterminism", view.error
    assert view.error.step == frame
    message = view.error.message
    assert f"in {frame} at position 0" in message, message
    assert f"recorded {recorded!r}" in message and f"now calls {called!r}" in message, message
    assert CALLS == {"fl_nd_a": 1}  # nothing ran in the failed replay
    assert not [s for s in view.steps if s.name == "|sleep"]


ARG = {"v": 1}


@mr.step
def fl_arg(v: int) -> int:
    CALLS["fl_arg"] += 1
    return v * 100


@mr.workflow("fl_args")
def fl_args(ctx: mr.RunContext) -> int:
    value = int(fl_arg(ARG["v"]))
    if "fl_args" in CRASH:
        raise Crash
    return value


def test_a_step_replayed_with_other_arguments_warns_and_keeps_its_result(
        runs: RunStore, redis_url: str) -> None:
    _record(runs, "fl_args", None, "args-1")
    CRASH.add("fl_args")
    ARG["v"] = 1
    with pytest.raises(Crash):
        _run(runs, "args-1", 1)
    _redeliver(runs, redis_url, "args-1", 1)
    CRASH.clear()
    ARG["v"] = 2
    try:
        assert _run(runs, "args-1", 2) == "succeeded"
    finally:
        ARG["v"] = 1
    view = _view(runs, "args-1")
    assert _result(view) == 100 and CALLS == {"fl_arg": 1}  # the recorded result
    warnings = [e.data["message"] for e in runs.output("args-1", count=1000)
                if e.type == "log" and e.data.get("level") == "WARNING"]
    assert len(warnings) == 1 and "other arguments" in warnings[0], warnings
    assert "fl_args.fl_arg#0" in warnings[0]


@mr.step(retries=1, delay_s=0.01, jitter=False)
def fl_frame_outer(tag: str) -> int:
    mr.sleep(0.2)
    value = mr.start_child("fl_child", fw.ChildInput(v=7)).result()
    TRIES[tag] += 1
    if TRIES[tag] == 1:
        raise RuntimeError("fails once, after its sleep and its child")
    return int(value["v"])


@mr.workflow("fl_frames")
def fl_frames(ctx: mr.RunContext, inp: dict[str, str]) -> int:
    return int(fl_frame_outer(inp["tag"]))


def test_a_retried_step_replays_its_sleep_and_child_at_the_same_positions(
        runs: RunStore) -> None:
    run_id, outer = "frames-1", "fl_frames.fl_frame_outer#0"
    _record(runs, "fl_frames", {"tag": "t"}, run_id)
    assert _run(runs, run_id, 1) == "parked"  # on the sleep inside the step
    assert _wake_timer(runs, run_id) == 2
    assert _run(runs, run_id, 2) == "parked"  # on the child, started under a stable id
    (child,) = (_view(runs, run_id).wait_for or {})["children"]
    assert child.startswith(f"{run_id}.fl_frame_outer-0-c0")  # derived from the position
    assert _run(runs, child, 1) == "succeeded"  # and wakes its parent
    assert _view(runs, run_id).status == "queued"
    # The step fails once after its sleep and child, and is retried: the retry finds both
    # at the positions it used before, so it neither sleeps again nor starts a second child.
    assert _run(runs, run_id, 3) == "succeeded"
    view, events = _view(runs, run_id), list(runs.output(run_id, count=1000))
    assert _result(view) == 70 and TRIES == {"t": 2}
    assert {s.key: s.name for s in view.steps} == {
        outer: "fl_frame_outer", f"{outer}.|sleep#0": "|sleep", f"{outer}.|child#0": "|child"}
    assert next(s.attempts for s in view.steps if s.key == outer) == 2
    assert [e.data["reason"] for e in _of(events, "parked")] == ["timer", "child"]
    assert len(_of(events, "step_retry")) == 1
    assert [r.record.id for r in runs.list_runs(limit=10) if r.record.parent == run_id] == [
        child]
    assert _effects(runs.store.url, child) == {"child-effect": 1}


# Two steps whose names differ only in a character a run id cannot hold; each starts a
# child at its own position, so each must get a child of its own.
@mr.step("fl.send")
def fl_send_dot() -> Any:
    return mr.start_child("fl_child", fw.ChildInput(v=1)).result()


@mr.step("fl-send")
def fl_send_dash() -> Any:
    return mr.start_child("fl_child", fw.ChildInput(v=2)).result()


@mr.workflow("fl_two_steps_two_children")
def fl_two_steps_two_children(ctx: mr.RunContext) -> list[Any]:
    return [fl_send_dot(), fl_send_dash()]


def test_children_started_at_different_positions_are_different_runs(runs: RunStore) -> None:
    run_id = "two-children"
    _record(runs, "fl_two_steps_two_children", None, run_id)
    attempt = 1
    for _ in range(4):
        outcome = _run(runs, run_id, attempt)
        if outcome != "parked":
            break
        (child,) = (_view(runs, run_id).wait_for or {})["children"]
        assert _run(runs, child, 1) == "succeeded"  # and wakes the parent
        attempt = _view(runs, run_id).delivery
    assert outcome == "succeeded"
    children = sorted(r.record.id for r in runs.list_runs(limit=10)
                      if r.record.parent == run_id)
    assert len(children) == 2, children
    assert [r["v"] for r in _result(_view(runs, run_id))] == [10, 20]


@mr.workflow("fl_wake_during")
def fl_wake_during(ctx: mr.RunContext, inp: dict[str, str]) -> Any:
    child = mr.start_child("fl_child", fw.ChildInput(v=3))
    if ctx.attempt == 1:
        # What a settling child's worker does while its parent still executes.
        assert WaitStore(ctx.runs).wake(ctx.run_id, "child", detail={"child": child.id})[
            0] == "pending"
    if inp["then"] == "sleep":
        mr.sleep(3600)
    return child.result()


@pytest.mark.parametrize("then", ["wait for the child", "sleep"])
def test_a_childs_wake_during_its_parents_execution_requeues_only_a_wait_for_children(
        runs: RunStore, then: str) -> None:
    run_id = "wake-during-" + then.split()[-1]
    _record(runs, "fl_wake_during", {"then": then}, run_id)
    if then == "sleep":
        # The child's wake is spent: the run waits for its timer, nothing requeues it.
        assert _run(runs, run_id, 1) == "parked"
        view = _view(runs, run_id)
        assert view.status == "waiting" and view.wait_reason == "timer"
        assert not _of(list(runs.output(run_id, count=1000)), "woken")
        return
    # It parks waiting for the child, and goes again at once (the wake could have come
    # after it read the child's state), not at the controller's next check.
    assert _run(runs, run_id, 1) == "requeued"
    view = _view(runs, run_id)
    assert view.status == "queued" and (view.attempt, view.delivery) == (1, 2)
    assert [e.data for e in _of(list(runs.output(run_id, count=1000)), "woken")] == [
        {"cause": "wake_pending"}]
    assert _run(runs, f"{run_id}.c0", 1) == "succeeded"
    assert _run(runs, run_id, 2) == "succeeded"
    assert _result(_view(runs, run_id)) == _child_result(f"{run_id}.c0", 3)
