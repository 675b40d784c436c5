"""The contract suite: `run --dry-run` and the test kit agree with production.

Each workflow of tests/contract_workflows.py (asks, timers, children, parallel branches,
signals, patches, an async body, a failure) runs on real workers with a controller on a
durable Redis, answered and signalled from outside as a person would; then through the
in-process engines with the same run id, answers and signals. The results, the final
status (and error type), and the ledgers (every entry's key, name, status and recorded
result) must be the same. Timings and epochs are not compared: they are the engines' own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from marbles_rq.engine import authoring
from marbles_rq.engine.dryrun import dry_run
from marbles_rq.engine.runs import RunView
from tests.procs import REPO_ROOT, Procs
from tests.redis_procs import RedisServer

SOURCE = REPO_ROOT / "tests" / "contract_workflows.py"


@dataclass(frozen=True)
class Case:
    workflow: str
    input: Any = None
    answers: dict[str, Any] = field(default_factory=dict)  # question key -> answer
    approvals: tuple[str, ...] = ()
    signals: tuple[tuple[str, Any], ...] = ()

    @property
    def run_id(self) -> str:
        return f"ct-{self.workflow}"


CASES = [
    Case("ct_steps", 3),
    Case("ct_ask", answers={"colour": "blue"}, approvals=("ship",)),
    Case("ct_timer"),
    Case("ct_children"),
    Case("ct_parallel"),
    Case("ct_signal", signals=(("go", {"n": 7}),)),
    Case("ct_patch"),
    Case("ct_async"),
    Case("ct_fails"),
]


@dataclass(frozen=True)
class Outcome:
    status: str
    result: Any
    error_type: str | None
    ledger: dict[str, tuple[str, str, Any]]

    @classmethod
    def of(cls, view: RunView) -> Outcome:
        return cls(view.status, None if view.result is None else json.loads(bytes(view.result)),
                   None if view.error is None else view.error.type,
                   {s.key: (s.name, s.status, _timeless(s.name, json.loads(bytes(s.result))))
                    for s in view.steps})


def _timeless(name: str, result: Any) -> Any:
    """A timer's entry holds instants of its engine's clock: kept is that it fired on time."""
    if name == "|sleep" and isinstance(result, dict):
        return {"fired_on_time": result.get("fired_ms", 0) >= result.get("due_ms", 1)}
    return result


# -- production: real workers and a controller ------------------------------------------------

@pytest.fixture(scope="module")
def production(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Outcome]]:
    """Every case run to its end on real processes (at once: they overlap)."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not found on PATH (run ops/test)", pytrace=False)
    base = tmp_path_factory.mktemp("contract")
    server = RedisServer.start(dir=base / "redis")
    procs = Procs(server.url, base / "procs", sources=[SOURCE])
    try:
        procs.start(workers=2)
        for case in CASES:
            args = ["enqueue", case.workflow, "--id", case.run_id]
            if case.input is not None:
                args += ["--input", json.dumps(case.input)]
            done = procs.cli(*args)
            assert done.returncode == 0, done.stderr
        for case in CASES:
            if case.answers or case.approvals or case.signals:
                procs.observer.wait_status(case.run_id, "waiting")
            for key, value in case.answers.items():
                done = procs.cli("answer", case.run_id, key, str(value))
                assert done.returncode == 0, done.stderr
                if case.approvals:  # the approval is asked after the answer is taken
                    procs.observer.wait_event(
                        case.run_id, lambda e: e.type == "parked" and "ship" in json.dumps(
                            e.data), what="parked at the approval")
            for key in case.approvals:
                done = procs.cli("approve", case.run_id, key)
                assert done.returncode == 0, done.stderr
            for name, payload in case.signals:
                done = procs.cli("signal", case.run_id, name, "--payload", json.dumps(payload))
                assert done.returncode == 0, done.stderr
        outcomes = {}
        for case in CASES:
            view = procs.observer.wait_status(case.run_id, "succeeded", "failed",
                                              timeout=60)
            outcomes[case.workflow] = Outcome.of(view)
            if case.workflow == "ct_children":
                for kid in view.steps:
                    if kid.name == "|child":
                        child_id = json.loads(bytes(kid.result))["id"]
                        child = procs.observer.wait_status(child_id, "succeeded")
                        outcomes[f"child {child_id}"] = Outcome.of(child)
        yield outcomes
    finally:
        procs.stop_all()
        server.stop()


# -- the dry run (engine/dryrun.py) ----------------------------------------------------------

def _dry(case: Case) -> tuple[Outcome, dict[str, Outcome]]:
    authoring.load_source(str(SOURCE))
    answers = {**case.answers, **{k: "yes" for k in case.approvals}}

    def answer(question: Any) -> Any:
        value = answers[question.key]
        if question.record.ask == "approval":
            return {"approved": True, "note": None}
        return value

    raw = b"null" if case.input is None else json.dumps(case.input).encode()
    done = dry_run(case.workflow, raw, answer=answer, run_id=case.run_id)
    children = {f"child {rid}": Outcome.of(view) for rid in done.runs.runs
                if rid != case.run_id and (view := done.runs.get(rid)) is not None}
    return Outcome.of(done.view), children


DRY_CASES = [c for c in CASES if not c.signals]  # a dry run cannot be signalled from outside


@pytest.mark.parametrize("case", DRY_CASES, ids=[c.workflow for c in DRY_CASES])
def test_the_dry_run_agrees_with_production(case: Case,
                                            production: dict[str, Outcome]) -> None:
    outcome, children = _dry(case)
    assert outcome == production[case.workflow]
    for name, child in children.items():
        assert child == production[name], name


# -- the test kit (marbles_rq.testing) --------------------------------------------------------

def _kit(case: Case) -> tuple[Outcome, dict[str, Outcome]]:
    """The case in a test kit Environment, answered and signalled as production was, the
    clock moved on until it settles."""
    import datetime as dt

    from marbles_rq.testing import Environment

    authoring.load_source(str(SOURCE))
    env = Environment(schedules=False)
    run = env.start(case.workflow, case.input, run_id=case.run_id)
    env.run_until_idle()
    for key, value in case.answers.items():
        run.answer(key, str(value))
        env.run_until_idle()
    for key in case.approvals:
        run.approve(key)
    for name, payload in case.signals:
        run.signal(name, payload)
    env.advance(dt.timedelta(minutes=1))  # the timers (1 s) fire; no timeout is reached
    store = env.engine.store
    view = store.get(case.run_id)
    assert view is not None
    children = {f"child {c.id}": Outcome.of(child) for c in env.children(case.run_id)
                if (child := store.get(c.id)) is not None}
    return Outcome.of(view), children


@pytest.mark.parametrize("case", CASES, ids=[c.workflow for c in CASES])
def test_the_test_kit_agrees_with_production(case: Case,
                                             production: dict[str, Outcome]) -> None:
    outcome, children = _kit(case)
    assert outcome == production[case.workflow]
    for name, child in children.items():
        assert child == production[name], name


def test_every_case_ran_in_production(production: dict[str, Outcome]) -> None:
    """The production side itself: what each workflow is documented to do."""
    assert production["ct_steps"].result == "<[4, 6]>"
    assert production["ct_ask"].result == {"first": 2, "colour": "blue", "ship": True,
                                           "last": "<blue>"}
    assert production["ct_signal"].result == "<{'n': 7}>"
    assert production["ct_patch"].result == "<new>"
    assert production["ct_children"].result == ["<[2, 4]>", "<[6, 8]>"]
    assert production["ct_async"].result == [3, 4, 5, 9]
    assert production["ct_fails"].status == "failed"
    assert production["ct_fails"].error_type == "ValueError"
