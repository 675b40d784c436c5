"""Replay, fencing, retries and timeouts, executed in this process against a real Redis.
(The same paths with real workers and real signals are in test_kill.py.)"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.controller import Controller
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.execute import execute
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.store.records import StepRecord
from marbles_rq.transport.dispatch import rq_connection

CALLS: Counter[int] = Counter()
CRASH_AT: list[int] = []
FLAKY: Counter[str] = Counter()


class Crash(BaseException):
    """Stands in for the process dying mid-run: nothing is settled."""


class Item(msgspec.Struct):
    i: int
    big: int


@mr.step
def t_replay_step(i: int) -> Item:
    CALLS[i] += 1
    return Item(i, 12345678901234567890 + i)


@mr.workflow("t_replay")
def t_replay(ctx: mr.RunContext, inp: dict[str, int]) -> list[int]:
    out = []
    for i in range(inp["n"]):
        if CRASH_AT and i == CRASH_AT[0]:
            raise Crash
        item = t_replay_step(i)
        assert isinstance(item, Item)  # replayed results come back typed
        out.append(item.big)
    return out


@mr.step(retries=2, delay_s=0.01, jitter=False)
def t_flaky(name: str) -> str:
    FLAKY[name] += 1
    if FLAKY[name] < 3:
        raise ConnectionError(f"flaky #{FLAKY[name]}")
    return "ok"


@mr.step(retries=1, delay_s=0.01)
def t_broken() -> None:
    raise ValueError("always broken")


@mr.workflow("t_retry")
def t_retry(ctx: mr.RunContext, inp: dict[str, str]) -> str:
    return t_flaky(inp["name"]) if inp["which"] == "flaky" else str(t_broken())


@mr.workflow("t_slow", timeout_s=1.0)
def t_slow(ctx: mr.RunContext) -> None:
    ctx.step(lambda: threading.Event().wait(2.5))
    ctx.step(lambda: None)


def _runs(url: str) -> RunStore:
    return RunStore(open_store(url))


def _record(runs: RunStore, name: str, raw: bytes, run_id: str) -> None:
    assert runs.record(prepare(RunRequest(name, raw, run_id))).created


def _redeliver(runs: RunStore, url: str, run_id: str, attempt: int, worker: str) -> None:
    """What the worker parent and the controller do when a horse dies."""
    assert runs.abandon(run_id, attempt, worker) == "ok"
    ctl = Controller(runs, rq_connection(url))
    assert ctl.lead()
    assert ctl.reap() == 1


def _run(runs: RunStore, run_id: str, attempt: int, worker: str = "w", **kw: Any) -> str:
    return execute(runs, REGISTRY, run_id, attempt, worker=worker,
                   lease_ms=kw.get("lease_ms", 60_000), hard_exit=False)


def test_a_redelivered_run_replays_recorded_steps(redis_url: str) -> None:
    runs = _runs(redis_url)
    CALLS.clear()
    _record(runs, "t_replay", b'{"n": 4}', "rep-1")
    CRASH_AT[:] = [2]
    with pytest.raises(Crash):
        _run(runs, "rep-1", 1, worker="w1")
    assert dict(CALLS) == {0: 1, 1: 1}
    _redeliver(runs, redis_url, "rep-1", 1, "w1")
    CRASH_AT.clear()
    assert _run(runs, "rep-1", 2, worker="w2") == "succeeded"
    assert dict(CALLS) == {0: 1, 1: 1, 2: 1, 3: 1}  # finished steps never ran again
    view = runs.get("rep-1")
    assert view is not None and view.status == "succeeded" and view.attempt == 2
    assert msgspec.json.decode(view.result or b"") == [12345678901234567890 + i
                                                       for i in range(4)]
    types = [(e.type, e.attempt) for e in runs.output("rep-1")]
    assert types.count(("final", 2)) == 1 and ("redelivered", 2) in types
    # A late duplicate of the first delivery is a no-op.
    assert _run(runs, "rep-1", 1) == "settled"


def test_a_stale_execution_cannot_write_anything(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "t_replay", b'{"n": 1}', "fence-1")
    old = runs.start("fence-1", 1, ttl_ms=60_000, worker="w1").execution
    assert old is not None
    assert runs.start("fence-1", 1, ttl_ms=60_000, worker="w9").status == "busy"
    _redeliver(runs, redis_url, "fence-1", 1, "w1")
    assert runs.start("fence-1", 1, ttl_ms=60_000, worker="w9").status == "stale_attempt"
    new = runs.start("fence-1", 2, ttl_ms=60_000, worker="w2").execution
    assert new is not None and new.epoch > old.epoch

    step = StepRecord(version=1, key="t_replay.x#0", name="x", status="running", attempts=1)
    assert runs.start_step(old, step) == "stale"
    assert runs.commit_step(old, step, "step_succeeded", b"{}") == "stale"
    assert runs.write(old, "output", b'{"text":"zombie"}') == "stale"
    assert runs.renew(old) == "stale"
    assert runs.claim_effect(old, "charge-1") == "stale_epoch"
    assert runs.settle(old, "succeeded", result=b'"zombie"') == "stale"

    assert runs.claim_effect(new, "charge-1") == "ok"
    assert runs.claim_effect(new, "charge-1") == "exists"
    assert runs.settle(new, "succeeded", result=b'"real"') == "ok"
    assert runs.settle(new, "failed") == "settled"  # the first terminal record stands
    assert runs.claim_effect(new, "after-the-end") == "stale_epoch"  # nothing after settling
    view = runs.get("fence-1")
    assert view is not None and view.status == "succeeded" and bytes(view.result or b"") == (
        b'"real"')
    assert not any(e.data == {"text": "zombie"} for e in runs.output("fence-1"))


def test_step_retries_are_recorded_then_succeed(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "t_retry", b'{"which": "flaky", "name": "r1"}', "retry-1")
    assert _run(runs, "retry-1", 1) == "succeeded"
    view = runs.get("retry-1")
    assert view is not None
    assert [(s.key, s.status, s.attempts) for s in view.steps] == [
        ("t_retry.t_flaky#0", "succeeded", 3)]
    assert [e.type for e in runs.output("retry-1")].count("step_retry") == 2


def test_a_step_past_its_retries_fails_the_run(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "t_retry", b'{"which": "broken", "name": "-"}', "broken-1")
    assert _run(runs, "broken-1", 1) == "failed"
    view = runs.get("broken-1")
    assert view is not None and view.error is not None
    assert (view.error.type, view.error.message, view.error.step) == (
        "ValueError", "always broken", "t_retry.t_broken#0")
    assert view.steps[0].attempts == 2


def test_a_run_past_its_timeout_fails(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "t_slow", b"null", "slow-1")
    _run(runs, "slow-1", 1, lease_ms=600)
    view = runs.get("slow-1")
    assert view is not None and view.status == "failed"
    assert view.error is not None and view.error.type == "RunTimeout"
    # The step that was running when the deadline passed could not record a result.
    assert [s.status for s in view.steps] == ["running"]


def test_a_crash_between_record_and_enqueue_is_dispatched(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "t_replay", b'{"n": 1}', "undispatched-1")  # recorded; RQ never told
    rq = rq_connection(redis_url)
    ctl = Controller(runs, rq)
    assert ctl.lead()
    assert ctl.dispatch() == 0  # within the enqueuer's grace period: not yet
    keys = runs.keys.run_keys("undispatched-1")
    runs.client.zadd(keys.dispatch, {"undispatched-1": 0})  # the grace period has passed
    assert ctl.dispatch() == 1
    assert rq.lrange("rq:queue:mrq.default", 0, -1) == [b"mrq-undispatched-1-a1"]
    runs.client.zadd(keys.dispatch, {"undispatched-1": 0})
    assert ctl.dispatch() == 0  # it is waiting in RQ now: not dispatched twice
    assert _run(runs, "undispatched-1", 1) == "succeeded"


def test_a_delivery_lost_inside_rq_is_redelivered(redis_url: str) -> None:
    from marbles_rq.engine import ops

    runs = _runs(redis_url)
    rq = rq_connection(redis_url)
    result = ops.enqueue(runs, rq, RunRequest("t_replay", b'{"n": 1}', "lost-1"))
    assert result.dispatched
    # A worker pops the job (BLMOVE into the intermediate list) and is killed before it
    # records it anywhere else.
    assert rq.lmove("rq:queue:mrq.default", "rq:queue:mrq.default:intermediate") == (
        b"mrq-lost-1-a1")
    ctl = Controller(runs, rq, lost_after_s=0.0)
    assert ctl.lead()
    assert ctl.find_lost() == 1
    assert rq.lrange("rq:queue:mrq.default", 0, -1) == [b"mrq-lost-1-a2"]
    assert ctl.find_lost() == 0  # the run has moved on to attempt 2: nothing more to do
    assert _run(runs, "lost-1", 1) == "stale_attempt"  # the lost one, if it ever turns up
    assert _run(runs, "lost-1", 2) == "succeeded"
    assert [e.data["reason"] for e in runs.output("lost-1") if e.type == "redelivered"] == [
        "delivery lost before it started"]


def test_enqueue_many_records_each_run_once_and_enqueues_only_new_ones(redis_url: str) -> None:
    from marbles_rq.engine import ops

    runs = _runs(redis_url)
    rq = rq_connection(redis_url)
    first = ops.enqueue(runs, rq, RunRequest("t_replay", b'{"n": 1}', "batch-0"))
    assert first.created
    requests = [RunRequest("t_replay", b'{"n": 1}', f"batch-{i}") for i in range(50)]
    results = ops.enqueue_many(runs, rq, requests)
    assert [r.created for r in results] == [False] + [True] * 49
    assert all(r.dispatched for r in results[1:])
    queued = rq.lrange("rq:queue:mrq.default", 0, -1)
    assert sorted(queued) == sorted(f"mrq-batch-{i}-a1".encode() for i in range(50))
    for i in range(50):
        assert _run(runs, f"batch-{i}", 1) == "succeeded"


def test_enqueue_many_validates_everything_before_recording_anything(redis_url: str) -> None:
    from marbles_rq.engine import ops
    from marbles_rq.engine.authoring import InputError

    runs = _runs(redis_url)
    requests = [RunRequest("t_replay", b'{"n": 1}', "ok-1"),
                RunRequest("t_replay", b'{"n": "x"}', "bad-1")]
    with pytest.raises(InputError):
        ops.enqueue_many(runs, rq_connection(redis_url), requests)
    assert runs.get("ok-1") is None


def test_enqueue_many_after_the_script_cache_was_emptied(redis_url: str) -> None:
    from marbles_rq.engine import ops

    runs = _runs(redis_url)
    runs.client.script_flush()  # as after a restart or a failover
    results = ops.enqueue_many(runs, rq_connection(redis_url), [
        RunRequest("t_replay", b'{"n": 1}', f"flushed-{i}") for i in range(20)])
    assert all(r.created for r in results)
    assert len(runs.list_runs(limit=100)) == 20
