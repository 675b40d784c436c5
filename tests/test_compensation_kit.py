"""Compensation in the test kit (marbles_rq.testing): the real executor in memory runs the
undos the way a worker does: in reverse order of registration, each once across a crash,
one that fails recorded while the rest run; a cancel with compensation of a waiting run;
and the refusals of what cannot be an undo."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

import marbles_rq as mr
from marbles_rq.client.errors import RunCancelledError, RunFailedError
from marbles_rq.engine.authoring import DefinitionError, StepDef
from marbles_rq.testing import Environment

UNDONE: list[str] = []


def kit_release(item: str) -> None:
    UNDONE.append(f"release {item}")


@mr.step(name="kit_comp_refund", retries=1, delay_s=0.01)
def kit_refund(order: str, amount: int, result: Any = None) -> None:
    UNDONE.append(f"refund {order} {amount} {result}")


@mr.step(name="kit_comp_charge", compensate=kit_refund)
def kit_charge(order: str, amount: int) -> str:
    return f"ch-{order}"


@mr.step(name="kit_comp_broken_undo", retries=1, delay_s=0.01)
def kit_broken_undo(item: str) -> None:
    UNDONE.append(f"broken {item}")
    raise RuntimeError(f"cannot undo {item}")


@mr.step(name="kit_comp_reserve")
def kit_reserve(item: str) -> str:
    return item


@mr.step(name="kit_comp_ship")
def kit_ship(order: str) -> None:
    raise ValueError(f"no courier for {order}")


@mr.workflow()
def kit_comp_order(ctx: mr.RunContext, order: str) -> str:
    ctx.compensate(kit_release, "a") if kit_reserve("a") else None
    kit_charge(order, 30)
    kit_reserve("b")
    mr.compensate(kit_broken_undo, "b")
    kit_reserve("c")
    ctx.compensate(kit_release, "c")
    kit_ship(order)
    return "shipped"


@mr.workflow()
def kit_comp_waiter(ctx: mr.RunContext) -> str:
    kit_reserve("w")
    ctx.compensate(kit_release, "w")
    mr.wait_for_signal("go")
    return "done"


@pytest.fixture(autouse=True)
def _clear() -> None:
    UNDONE.clear()


def test_a_failed_run_runs_its_undos_in_reverse_and_lists_them() -> None:
    env = Environment()
    run = env.start(kit_comp_order, "o1")
    env.advance(timedelta(seconds=1))  # the broken undo's retry waits on the kit's clock
    with pytest.raises(RunFailedError, match="no courier"):
        run.result()
    assert UNDONE == ["release c", "broken b", "broken b", "refund o1 30 ch-o1", "release a"]
    status = env.status(run)
    assert status.status == "failed" and status.error is not None
    assert status.error.type == "ValueError"
    assert [(c.name, c.status) for c in status.compensations] == [
        ("kit_release", "done"), ("kit_comp_broken_undo", "failed"),
        ("kit_comp_refund", "done"), ("kit_release", "done")]
    assert status.compensations[1].error == "RuntimeError: cannot undo b"
    assert status.phase is None


def test_a_crash_during_the_undos_runs_each_once() -> None:
    env = Environment()
    env.crash_after("|compensate.kit_release#0")
    run = env.start(kit_comp_order, "o2")
    env.advance(timedelta(seconds=1))  # the broken undo's retry waits on the kit's clock
    with pytest.raises(RunFailedError):
        run.result()
    assert UNDONE == ["release c", "broken b", "broken b", "refund o2 30 ch-o2", "release a"]
    assert env.status(run).attempt == 2


def test_cancel_with_compensation_of_a_waiting_run() -> None:
    env = Environment()
    run = env.start(kit_comp_waiter)
    env.run_until_idle()
    assert env.status(run).status == "waiting"
    done = run.cancel(compensate=True)
    assert done.outcome == "compensating"
    assert UNDONE == ["release w"]
    status = env.status(run)
    assert status.status == "cancelled"
    assert [(c.name, c.status) for c in status.compensations] == [("kit_release", "done")]
    with pytest.raises(RunCancelledError):
        run.result()


def test_a_plain_cancel_does_not_compensate() -> None:
    env = Environment()
    run = env.start(kit_comp_waiter)
    env.run_until_idle()
    run.cancel()
    assert UNDONE == []
    assert [c.status for c in env.status(run).compensations] == ["not_run"]


def _nested() -> None:
    def inner() -> None: ...
    mr.compensate(inner)


@mr.workflow()
def kit_comp_bad(ctx: mr.RunContext, what: str) -> None:
    if what == "lambda":
        ctx.compensate(lambda: None)
    elif what == "args":
        ctx.compensate(kit_release, object())
    elif what == "nested":
        _nested()


@pytest.mark.parametrize(("what", "message"), [
    ("lambda", "a lambda cannot be an undo"),
    ("args", "its arguments are not JSON"),
    ("nested", "is not a module-level function"),
])
def test_what_cannot_be_an_undo_is_refused_with_one_line(what: str, message: str) -> None:
    env = Environment()
    run = env.start(kit_comp_bad, what)
    with pytest.raises(RunFailedError) as failed:
        run.result()
    assert message in str(failed.value)
    error = env.status(run).error
    assert error is not None and error.type == "CompensationError"
    assert "\n" not in error.message


def test_an_unregistered_step_cannot_be_declared_as_an_undo() -> None:
    stray = StepDef("kit_comp_stray", kit_release)  # never registered
    with pytest.raises(DefinitionError,
                       match="'kit_comp_stray' is not a registered step"):
        mr.step(name="kit_comp_uses_stray", compensate=stray)(kit_release)


def test_a_replayed_body_registers_nothing_twice() -> None:
    env = Environment()
    env.crash_after("kit_comp_order.kit_comp_reserve#2")  # after every registration but one
    run = env.start(kit_comp_order, "o3")
    env.advance(timedelta(seconds=1))  # the broken undo's retry waits on the kit's clock
    with pytest.raises(RunFailedError):
        run.result()
    status = env.status(run)
    assert status.attempt == 2  # the body ran again and replayed its registrations
    assert [c.name for c in status.compensations] == [
        "kit_release", "kit_comp_broken_undo", "kit_comp_refund", "kit_release"]
    assert UNDONE == ["release c", "broken b", "broken b", "refund o3 30 ch-o3", "release a"]


@mr.workflow()
async def kit_comp_async(ctx: mr.AsyncRunContext, order: str) -> str:
    await kit_charge(order, 5)
    ctx.compensate(kit_release, "async")
    await kit_ship(order)
    return "shipped"


def test_an_async_body_compensates_the_same_way() -> None:
    env = Environment()
    run = env.start(kit_comp_async, "o4")
    with pytest.raises(RunFailedError, match="no courier"):
        run.result()
    assert UNDONE == ["release async", "refund o4 5 ch-o4"]
    assert [c.status for c in env.status(run).compensations] == ["done", "done"]


@mr.step(name="kit_comp_undo_later", retry=mr.Retry(initial="1m", max_attempts=2,
                                                    jitter=False))
def kit_undo_later(item: str) -> None:
    UNDONE.append(f"tried {item}")
    raise RuntimeError(f"cannot undo {item} yet")


@mr.workflow()
def kit_comp_parked_undo(ctx: mr.RunContext) -> str:
    mr.compensate(kit_undo_later, kit_reserve("p"))
    raise ValueError("the body gives up")


def test_cancel_compensate_of_a_run_compensating_after_its_failure() -> None:
    UNDONE.clear()
    env = Environment()
    run = env.start("kit_comp_parked_undo")
    env.run_until_idle()
    assert run.status().status == "waiting" and run.status().phase == "compensating"
    done = env.cancel(run.id, compensate=True)
    # Compensating already, to end failed: said so, and its undo's retry keeps its time.
    assert done.message == f"run {run.id} is compensating (waiting)", done.message
    assert UNDONE == ["tried p"]
    env.advance(timedelta(minutes=2))
    assert run.status().status == "failed" and UNDONE == ["tried p", "tried p"]


@mr.workflow(on_exhausted="pause")
def kit_comp_pausing(ctx: mr.RunContext) -> str:
    mr.compensate(kit_release, kit_reserve("first"))
    mr.compensate(kit_broken_undo, kit_reserve("second"))
    raise ValueError("the body gives up")


def test_an_undo_in_a_pausing_workflow_pauses_until_a_person_acts() -> None:
    UNDONE.clear()
    env = Environment()
    run = env.start("kit_comp_pausing")
    env.run_until_idle()
    env.advance(1)  # the broken undo's second try
    status = run.status()
    assert status.status == "waiting" and status.phase == "compensating"
    assert status.waiting is not None and status.waiting.reason == "failed_step"
    assert status.waiting.for_["step"] == "|compensate.kit_comp_broken_undo#0"
    assert UNDONE == ["broken second", "broken second"]  # the one before it waits
    env.fail(run, reason="done by hand")
    with pytest.raises(RunFailedError):
        run.result()
    assert UNDONE == ["broken second", "broken second", "release first"]
    assert [(c.name, c.status) for c in run.status().compensations] == [
        ("kit_comp_broken_undo", "failed"), ("kit_release", "done")]
