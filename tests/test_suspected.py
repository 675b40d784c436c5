"""The suspected faults of issue 16 (item 6), each proven fixed or impossible against a real
redis-server: the waiting duty's recheck pushing a re-parked timer late; a reaped cancelled
run keeping its concurrency slot and its children; a limit exceeded by an execution that
renews after its lease or slot expired, or whose worker was reaped as lost; two parallel
branches sharing a child under one explicit key; timers judged on stream-id time after the
server clock stepped back.

The engine executes in this process (like tests/test_waiting_flow.py); the controller is a
real `Controller` leading in this process. Where a race needs two things to interleave at
one point, the test makes them interleave there (a hook on the real Redis client runs the
other side between two of the duty's round trips; a barrier lines two branches up): the
store, the scripts and the engine are the real ones.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.controller import Controller
from marbles_rq.controller.waiting import WaitingDuty
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.execute import execute
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import RunStore, RunView
from marbles_rq.engine.waits import WaitStore
from marbles_rq.flow import limit_specs, limits
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from tests import flow_workflows as fw
from tests import suspected_workflows as sw
from tests.procs import Proc, Procs, descendants, pid_alive, wait_for

LEASE_MS = 60_000
PROCS_SOURCES = (Path(__file__).with_name("suspected_workflows.py"),)


@pytest.fixture
def runs(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> RunStore:
    monkeypatch.setenv("MARBLES_REDIS_URL", redis_url)
    return RunStore(open_store(redis_url))


def _record(runs: RunStore, name: str, inp: Any, run_id: str) -> None:
    assert runs.record(prepare(RunRequest(name, msgspec.json.encode(inp), run_id))).created


def _run(runs: RunStore, run_id: str, attempt: int) -> str:
    return execute(runs, REGISTRY, run_id, attempt, worker="w", lease_ms=LEASE_MS,
                   hard_exit=False)


def _view(runs: RunStore, run_id: str) -> RunView:
    view = runs.get(run_id)
    assert view is not None
    return view


def _server_ms(runs: RunStore) -> int:
    return fw.server_ms(runs.client)


def _leading(runs: RunStore) -> Controller:
    ctl = Controller(runs, rq_connection(runs.store.url))
    assert ctl.lead()
    return ctl


@mr.workflow("sus_kid")
def sus_kid(ctx: mr.RunContext) -> str:
    return "kid"


# -- a. the waiting duty's recheck and a run parked again meanwhile ------------------------------


@mr.workflow("sus_child_then_sleep")
def sus_child_then_sleep(ctx: mr.RunContext) -> str:
    got = mr.start_child("sus_kid", key="c").result()
    mr.sleep(0.3)
    return str(got)


def test_the_duty_recheck_never_pushes_the_timer_of_a_run_parked_again_meanwhile(
        runs: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The duty reads a run waiting for its child (not settled yet) and will look again
    later. Between its read and that write, the child settles, wakes the parent, and the
    parent goes on and parks on a 0.3 s timer. The duty's late write must not move that
    timer (before the fix, a ZADD XX pushed it to the duty's recheck time, 2 to 30 s on)."""
    parent, child = "sus-a", "sus-a.c"
    _record(runs, "sus_child_then_sleep", None, parent)
    assert _run(runs, parent, 1) == "parked"
    assert _view(runs, parent).wait_for == {"children": [child]}
    waits = runs.keys.run_keys(parent).waits
    check = runs.client.zscore(waits, parent)
    assert check is not None
    wait_for(lambda: _server_ms(runs) >= check, timeout=10,
             what="the duty's first look at the child to come due")

    ctl = _leading(runs)
    client = ctl.store.client
    real_pipeline = client.pipeline
    meanwhile: list[str] = []

    def other_side() -> None:
        meanwhile.append(_run(runs, child, 1))  # settles, wakes its parent
        meanwhile.append(_run(runs, parent, _view(runs, parent).delivery))  # parks: sleep

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute

        def execute_then_interleave(*a: Any, **kw: Any) -> Any:
            reads_child = any(tuple(cmd[:3]) == ("HGET", runs.keys.run(child), "status")
                              for cmd, _ in pipe.command_stack)
            replies = real_execute(*a, **kw)
            if reads_child and not meanwhile:
                monkeypatch.setattr(client, "pipeline", real_pipeline)
                other_side()
            return replies

        pipe.execute = execute_then_interleave
        return pipe

    monkeypatch.setattr(client, "pipeline", pipeline)
    duty = WaitingDuty(threaded=False)
    assert duty.wake_due(ctl) == (1, 0)  # read the child as running: nothing woken
    assert meanwhile == ["succeeded", "parked"]

    view = _view(runs, parent)
    assert (view.status, view.wait_reason) == ("waiting", "timer"), view
    wake_at = int(runs.client.hget(runs.keys.run(parent), "wake_at") or 0)
    assert wake_at > 0
    at = runs.client.zscore(waits, parent)
    assert at is not None and at <= wake_at, (at, wake_at)  # looked at when its timer is due
    wait_for(lambda: _server_ms(runs) >= wake_at, timeout=10, what="the timer to come due")
    assert duty.wake_due(ctl) == (1, 1)  # the pass at its due time wakes it
    assert _run(runs, parent, _view(runs, parent).delivery) == "succeeded"


# -- b. a run the reaper settles cancelled -------------------------------------------------------


def _kill_tree(proc: Proc) -> None:
    """SIGKILL a worker and its work-horse (a process group of its own), and reap them."""
    tree = descendants(proc.pid)
    for pid in [proc.pid, *tree]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    proc.wait_exit(10)
    wait_for(lambda: not any(pid_alive(p) for p in tree), timeout=10,
             what=f"the processes {tree} of worker {proc.pid} to die")


def test_a_run_reaped_as_cancelled_frees_its_slot_and_cancels_its_children(
        procs: Procs) -> None:
    """A limited run (limit 1) starts a child and blocks in a step; cancel is requested
    (the engine's cancel, which walks no children: as a walk that ran before the child was
    recorded), then its worker and horse are killed. The controller reaps the lost worker's
    run and settles it cancelled: its slot is free at once (before the hold's own expiry,
    60 s on), and its child, still queued, is cancelled with it. Before the fix both stayed:
    the hold until it expired, the child for good."""
    (worker,) = procs.start(workers=1, lease_ms=LEASE_MS)
    obs = procs.observer
    done = procs.cli("enqueue", "sus_limited_parent", "--id", "b-1")
    assert done.returncode == 0, done.stderr
    obs.wait_list(sw.HOLDING, lambda xs: any(x.startswith("b-1|") for x in xs),
                  what="run b-1 to block in its step")
    runs = RunStore(open_store(procs.url))
    assert runs.cancel("b-1") == "requested"
    kid = obs.view("b-1.kid")
    assert kid is not None and kid.status == "queued", kid
    _kill_tree(worker)
    limit = limit_specs.limit_id("sus_limited_parent", "")
    slots, holders = runs.keys.limit_slots(limit), runs.keys.limit_holders(limit)
    expiry = runs.client.zscore(slots, "b-1")
    assert expiry is not None and expiry > _server_ms(runs) + 10_000, expiry

    obs.wait_status("b-1", "cancelled", timeout=30)
    obs.wait_status("b-1.kid", "cancelled", timeout=30)
    wait_for(lambda: runs.client.hget(holders, "b-1") is None, timeout=30,
             what="the reaped run's slot to be released")
    assert _server_ms(runs) < expiry  # released by the reap, not expired
    assert runs.client.zscore(slots, "b-1") is None


# -- c. a concurrency limit and an execution frozen past its lease, or reaped as lost -----------


@mr.workflow("sus_lim1", concurrency=1)
def sus_lim1(ctx: mr.RunContext) -> str:
    return "done"


def _live_holds(runs: RunStore, name: str) -> list[str]:
    slots = runs.keys.limit_slots(limit_specs.limit_id(name, ""))
    now = _server_ms(runs)
    return sorted(m.decode() for m, at in runs.client.zrange(slots, 0, -1, withscores=True)
                  if at > now)


def _started(runs: RunStore, run_id: str, ttl_ms: int, worker: str) -> Any:
    started = limits.start(runs, run_id, 1, ttl_ms=ttl_ms, worker=worker)
    assert started.status == "ok" and started.execution is not None, started
    ex = started.execution
    assert ex.slot is not None
    lease = runs.client.zscore(runs.keys.run_keys(run_id).leases, run_id)
    hold = runs.client.zscore(runs.keys.limit_slots(limit_specs.limit_id("sus_lim1", "")), run_id)
    assert lease is not None and hold is not None
    assert lease <= hold  # a live lease lies within its hold
    return ex


def _commit(runs: RunStore, ex: Any, n: int) -> str:
    from marbles_rq.store.records import StepRecord

    record = StepRecord(version=1, key=f"sus_lim1.s#{n}", name="s", status="succeeded",
                        attempts=1, result=msgspec.Raw(b"1"), seq=n)
    return runs.commit_step(ex, record, "step_succeeded", b"{}")


@pytest.mark.parametrize("first", ["commit", "renew"])
def test_an_execution_frozen_past_its_lease_neither_retakes_its_slot_nor_writes(
        runs: RunStore, first: str) -> None:
    """Limit 1. Execution X starts with the slot, then is frozen (nothing renews) past its
    lease and its hold; run Y takes the slot. X thaws: whether its body commits first or its
    watchdog renews first, nothing of X is written, the slot is not taken back (one live
    hold, Y's), and X's run is redelivered. Before the fix X's commit was written, and its
    renewal extended the expired lease and took the hold again whatever the count: two
    holders of a limit of 1."""
    for rid in ("c-x", "c-y"):
        _record(runs, "sus_lim1", None, rid)
    x = _started(runs, "c-x", 1_000, "wx")
    assert _commit(runs, x, 0) == "ok"
    lease = runs.client.zscore(runs.keys.run_keys("c-x").leases, "c-x")
    hold = runs.client.zscore(runs.keys.limit_slots(limit_specs.limit_id("sus_lim1", "")), "c-x")
    assert lease is not None and hold is not None
    wait_for(lambda: _server_ms(runs) > max(lease, hold), timeout=10,
             what="X's lease and hold to expire")
    _started(runs, "c-y", LEASE_MS, "wy")  # its acquire prunes X's lapsed hold
    assert _live_holds(runs, "sus_lim1") == ["c-y"]

    if first == "commit":
        assert _commit(runs, x, 1) == "stale"
        assert runs.renew(x) != "ok"
    else:
        assert runs.renew(x) != "ok"
        assert _commit(runs, x, 1) == "stale"
    assert runs.settle(x, "succeeded", result=b'"done"') == "stale"
    assert _live_holds(runs, "sus_lim1") == ["c-y"]
    view = _view(runs, "c-x")
    assert [s.key for s in view.steps] == ["sus_lim1.s#0"]  # X's later commit: not written
    assert _leading(runs).reap() == 1
    assert (_view(runs, "c-x").status, _view(runs, "c-x").attempt) == ("queued", 2)


def test_a_zombie_whose_worker_was_reaped_as_lost_writes_nothing_after_its_slot_is_freed(
        runs: RunStore) -> None:
    """Limit 1. X executes on worker wx with a live lease; the controller reaps wx as lost
    (its beats lapsed: frozen, cut off) while X's horse still runs (a zombie). The reap
    raises X's epoch in the same script that redelivers the run, and only then frees X's
    slot: Y takes it, and nothing the zombie sends afterwards is written. Impossible before
    the fix too (reap_run fences first); the zombie can still run code, not commit."""
    for rid in ("z-x", "z-y"):
        _record(runs, "sus_lim1", None, rid)
    x = _started(runs, "z-x", LEASE_MS, "wx")
    ctl = _leading(runs)
    assert ctl._reap_one("z-x", worker="wx") == 1  # the lost-worker reap's own path
    assert _live_holds(runs, "sus_lim1") == []
    _started(runs, "z-y", LEASE_MS, "wy")
    assert _commit(runs, x, 0) == "stale"
    assert runs.renew(x) == "stale"
    assert runs.settle(x, "succeeded", result=b'"done"') == "stale"
    assert _live_holds(runs, "sus_lim1") == ["z-y"]
    assert _view(runs, "z-x").steps == []


# -- d. two parallel branches, one explicit child key -------------------------------------------

TWINS = threading.Barrier(2)


@mr.workflow("sus_twins")
def sus_twins(ctx: mr.RunContext) -> list[Any]:
    def start() -> str:
        TWINS.wait(timeout=30)  # both branches reach start_child together
        return mr.start_child("sus_kid", key="same").id

    return mr.parallel(start, start)


def test_two_parallel_branches_cannot_share_a_child_under_one_key(runs: RunStore) -> None:
    """Two branches start a child under the same explicit key at the same moment: one of
    them gets it, the other fails as a second start under one key does in sequence (before
    the fix both got the same child, silently: neither saw the other's ledger entry,
    committed only after its own check)."""
    TWINS.reset()
    _record(runs, "sus_twins", None, "sus-d")
    assert _run(runs, "sus-d", 1) == "failed"
    view = _view(runs, "sus-d")
    assert view.error is not None and "child id sus-d.same is already used" in \
        view.error.message, view.error
    children = [s for s in view.steps if s.name == "|child"]
    assert len(children) == 1, children
    # The branch that took the key may be stopped by its sibling's failure between naming the
    # child in the ledger and recording it: one child at most, never two under one id.
    kid = runs.get("sus-d.same")
    assert kid is None or kid.status == "queued", kid


# -- e. timers and a server clock that stepped back ---------------------------------------------


@mr.workflow("sus_sleep_or_answer")
def sus_sleep_or_answer(ctx: mr.RunContext) -> list[Any]:
    def nap() -> str:
        mr.sleep(60)
        return "slept"

    return mr.parallel(nap, lambda: mr.ask.question("Go on?", choices=["yes"], key="go"))


def _step_clock_back(runs: RunStore, run_id: str, by_ms: int) -> None:
    """What the run's output stream looks like once the server clock stepped back `by_ms`:
    its newest entry was written that far ahead of the clock (a stream's ids never go
    back, so every entry added from now on is still ahead of the clock)."""
    runs.client.xadd(runs.keys.run_keys(run_id).output,
                     {"t": "note", "a": 1, "d": b"{}"}, id=f"{_server_ms(runs) + by_ms}-0")


def test_a_timer_is_not_judged_fired_on_stream_ids_ahead_of_the_server_clock(
        runs: RunStore) -> None:
    """A run sleeps 60 s and asks a question at once; the question is answered at once. Its
    replay must see the timer still pending (park again on it), even though its output
    stream's ids run an hour ahead of the server clock (the clock stepped back)."""
    run_id = "sus-e"
    _record(runs, "sus_sleep_or_answer", None, run_id)
    assert _run(runs, run_id, 1) == "parked"
    due = int((_view(runs, run_id).wait_for or {})["until_ms"])
    _step_clock_back(runs, run_id, 3_600_000)
    assert WaitStore(runs).answer(run_id, "go", "yes", kind="question").woken_attempt == 2
    assert _run(runs, run_id, 2) == "parked"  # before the fix: "succeeded", 60 s early
    view = _view(runs, run_id)
    assert (view.status, view.wait_reason) == ("waiting", "timer"), view
    assert int((view.wait_for or {})["until_ms"]) == due
    assert _server_ms(runs) < due


@mr.workflow("sus_sleep")
def sus_sleep(ctx: mr.RunContext) -> str:
    mr.sleep(1)
    return "slept"


def test_a_new_timer_is_due_on_the_server_clock_not_on_stream_ids(runs: RunStore) -> None:
    """A one-second sleep set while the run's stream ids run an hour ahead of the server
    clock is due one second after the server clock's now (before the fix: an hour later)."""
    run_id = "sus-e2"
    _record(runs, "sus_sleep", None, run_id)
    _step_clock_back(runs, run_id, 3_600_000)
    before = _server_ms(runs)
    assert _run(runs, run_id, 1) == "parked"
    after = _server_ms(runs)
    due = int((_view(runs, run_id).wait_for or {})["until_ms"])
    # The executor's clock errs late, never early (Execution.server_now_ms), by up to the
    # round trip of the start that read the server's: a few ms on a loaded machine.
    assert before + 1_000 <= due <= after + 1_000 + 50


def test_a_commit_extends_the_lease_on_the_server_clock_not_on_stream_ids(
        runs: RunStore) -> None:
    """commit_step's lease extension (when the watchdog fell behind) counts from the server
    clock: from a stream id an hour ahead, a killed execution's lease outlived it an hour."""
    from marbles_rq.store.records import StepRecord

    run_id = "sus-e3"
    _record(runs, "sus_sleep", None, run_id)
    started = runs.start(run_id, 1, ttl_ms=10_000, worker="w")
    assert started.status == "ok" and started.execution is not None
    ex = started.execution
    _step_clock_back(runs, run_id, 3_600_000)
    keys = runs.keys.run_keys(run_id)
    record = StepRecord(version=1, key="sus_sleep.x#0", name="x", status="succeeded",
                        attempts=1, result=msgspec.Raw(b"1"), at_ms=0, seq=0)
    reply = runs.scripts.commit_step(keys=keys, epoch=ex.epoch, step_key=record.key,
                                     record=msgspec.json.encode(record),
                                     event_type="step_succeeded", event=b"{}", run_id=run_id,
                                     ttl_ms=10_000, seq=1)
    assert reply.status == "ok"
    lease = runs.client.zscore(keys.leases, run_id)
    assert lease is not None and lease <= _server_ms(runs) + 10_000, lease


