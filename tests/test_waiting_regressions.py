"""Regressions from a hostile trial of runs that wait, executed in this process against a
real Redis (the process-level paths are in test_waiting_questions.py and
test_waiting_flow.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.execute import execute
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import RunStore
from marbles_rq.engine.waits import AnswerRefusedError, WaitStore
from marbles_rq.store import open_store

ASK_KIND: dict[str, str] = {"kind": "question"}


@mr.workflow("hx_par_ask")
def hx_par_ask(ctx: mr.RunContext) -> list[Any]:
    return mr.parallel(lambda: ctx.ask.question("in a branch, default key"), lambda: 1)


@mr.workflow("hx_dup_child")
def hx_dup_child(ctx: mr.RunContext) -> list[Any]:
    a = mr.start_child("hx_leaf", 1, key="same")
    b = mr.start_child("hx_leaf", 2, key="same")
    return [a.id, b.id]


@mr.workflow("hx_leaf")
def hx_leaf(ctx: mr.RunContext, inp: Any) -> Any:
    return inp


@mr.workflow("hx_kind")
def hx_kind(ctx: mr.RunContext) -> Any:
    if ASK_KIND["kind"] == "question":
        return ctx.ask.question("q", key="rq")
    return ctx.ask.approval("q", key="rq")


@mr.workflow("hx_nest")
def hx_nest(ctx: mr.RunContext, depth: int) -> Any:
    if depth == 0:
        return ctx.ask.question("deepest")
    return mr.start_child("hx_nest", depth - 1, key="down").result()


@mr.workflow("hx_kbint")
def hx_kbint(ctx: mr.RunContext) -> None:
    raise KeyboardInterrupt


@mr.workflow("hx_long_sleep")
def hx_long_sleep(ctx: mr.RunContext, seconds: float) -> None:
    mr.sleep(seconds)


@mr.workflow("hx_big_title")
def hx_big_title(ctx: mr.RunContext) -> str:
    return ctx.ask.question("t" * 100_000)


@mr.workflow("hx_default_none")
def hx_default_none(ctx: mr.RunContext) -> Any:
    return ctx.ask.question("q", timeout_s=0.001, default=None)


@pytest.fixture
def runs(redis_url: str) -> RunStore:
    return RunStore(open_store(redis_url))


def _record(runs: RunStore, name: str, inp: Any, run_id: str) -> None:
    assert runs.record(prepare(RunRequest(name, msgspec.json.encode(inp), run_id))).created


def _run(runs: RunStore, run_id: str) -> str:
    view = runs.get(run_id)
    assert view is not None
    return execute(runs, REGISTRY, run_id, view.delivery, worker="w", lease_ms=60_000,
                   hard_exit=False)


def _error(runs: RunStore, run_id: str) -> tuple[str, str]:
    view = runs.get(run_id)
    assert view is not None and view.status == "failed" and view.error is not None
    return view.error.type, view.error.message


def test_a_default_keyed_question_in_a_parallel_branch_can_be_seen_and_answered(
        runs: RunStore) -> None:
    _record(runs, "hx_par_ask", None, "hx-pa")
    assert _run(runs, "hx-pa") == "parked"
    view = runs.get("hx-pa")
    assert view is not None and view.status == "waiting"
    (key,) = (view.wait_for or {})["questions"]
    assert "|" not in key
    waits = WaitStore(runs)
    assert [q.key for q in waits.questions("hx-pa")] == [key]
    assert [q.key for q in waits.feed() if q.run_id == "hx-pa"] == [key]
    assert waits.answer("hx-pa", key, "yes", kind="question").woken_attempt == 2
    assert _run(runs, "hx-pa") == "succeeded"
    assert msgspec.json.decode(runs.get("hx-pa").result) == ["yes", 1]  # type: ignore[union-attr,arg-type]


def test_two_children_started_under_one_key_are_refused_not_merged(runs: RunStore) -> None:
    _record(runs, "hx_dup_child", None, "hx-dc")
    assert _run(runs, "hx-dc") == "failed"
    _, message = _error(runs, "hx-dc")
    assert "hx-dc.same" in message and "already used" in message


def test_an_answer_recorded_for_another_kind_of_ask_is_not_read_as_this_one(
        runs: RunStore) -> None:
    ASK_KIND["kind"] = "question"
    _record(runs, "hx_kind", None, "hx-k")
    assert _run(runs, "hx-k") == "parked"
    WaitStore(runs).answer("hx-k", "rq", "no", kind="question")
    ASK_KIND["kind"] = "approval"  # the code changed while the run waited
    try:
        assert _run(runs, "hx-k") == "failed"
    finally:
        ASK_KIND["kind"] = "question"
    kind, message = _error(runs, "hx-k")
    assert kind == "NonDeterminism"
    assert "ask.question" in message and "ask.approval" in message


def test_cancelling_a_parent_cancels_descendants_at_any_depth(runs: RunStore) -> None:
    depth = 20
    _record(runs, "hx_nest", depth, "hx-n")
    run_id = "hx-n"
    for _ in range(depth + 1):  # each level starts the next, which parks on its child
        assert _run(runs, run_id) == "parked"
        run_id = f"{run_id}.down"
    assert runs.cancel("hx-n") == "cancelled"
    cancelled = WaitStore(runs).cancel_children("hx-n")
    assert len(cancelled) == depth
    run_id = "hx-n"
    for _ in range(depth + 1):
        view = runs.get(run_id)
        assert view is not None and view.status == "cancelled", run_id
        run_id = f"{run_id}.down"
    assert [q for q in WaitStore(runs).feed() if q.run_id.startswith("hx-n")] == []


def test_a_keyboard_interrupt_raised_by_the_body_fails_the_run_once(runs: RunStore) -> None:
    _record(runs, "hx_kbint", None, "hx-kb")
    assert _run(runs, "hx-kb") == "failed"
    assert _error(runs, "hx-kb")[0] == "KeyboardInterrupt"


@pytest.mark.parametrize("seconds", [1e300, 11 * 366 * 86400])
def test_a_timer_beyond_ten_years_is_refused_and_status_keeps_working(
        runs: RunStore, seconds: float) -> None:
    run_id = f"hx-ls-{abs(hash(seconds)) % 1000}"
    _record(runs, "hx_long_sleep", seconds, run_id)
    assert _run(runs, run_id) == "failed"
    assert "ten years" in _error(runs, run_id)[1]
    assert runs.get(run_id).to_json()["status"] == "failed"  # type: ignore[union-attr]


def test_a_question_with_a_huge_title_is_refused(runs: RunStore) -> None:
    _record(runs, "hx_big_title", None, "hx-bt")
    assert _run(runs, "hx-bt") == "failed"
    assert "title" in _error(runs, "hx-bt")[1]
    assert WaitStore(runs).questions("hx-bt") == []


def test_an_answer_that_is_not_text_is_refused_and_nothing_is_recorded(
        runs: RunStore) -> None:
    _record(runs, "hx_kind", None, "hx-u8")
    assert _run(runs, "hx-u8") == "parked"
    waits = WaitStore(runs)
    with pytest.raises(AnswerRefusedError):
        waits.answer("hx-u8", "rq", "\udcff\udcfe", kind="question")  # argv bytes, not UTF-8
    assert [q.state for q in waits.questions("hx-u8")] == ["open"]


def test_a_timed_out_question_returns_a_none_default_as_none(runs: RunStore) -> None:
    _record(runs, "hx_default_none", None, "hx-dn")
    assert _run(runs, "hx-dn") == "parked"
    # What the controller does when the timeout comes: close the question, wake the run.
    import time

    deadline = time.monotonic() + 10
    while True:
        status, _, _ = WaitStore(runs).wake("hx-dn", "timer")
        if status == "woken" or time.monotonic() > deadline:
            break
        time.sleep(0.01)  # the 1 ms timeout passes on the server clock
    assert status == "woken"
    assert _run(runs, "hx-dn") == "succeeded"
    assert runs.get("hx-dn").result is not None  # type: ignore[union-attr]
    assert msgspec.json.decode(runs.get("hx-dn").result) is None  # type: ignore[union-attr,arg-type]
