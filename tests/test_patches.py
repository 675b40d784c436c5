"""Patch markers (engine/patches.py): a change deployed while runs wait. Old runs take the
old branch, new runs the new one, and every replay of a run takes the branch it took first.

The deploy is real: a worker on the old source parks runs at a question, it is stopped, a
worker on the new source (the patch added) answers them and starts new ones. The dry-run
tests check the decision rules in process memory, with the same executor."""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.engine import authoring
from marbles_rq.engine.authoring import Registry
from marbles_rq.engine.context import Limits
from marbles_rq.engine.dryrun import dry_run
from marbles_rq.engine.memory_engine import MemoryEngine
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.patches import PatchIdError, check_id
from marbles_rq.store.records import StepRecord
from tests.procs import Procs

# An explicit version keeps the old and the new source on one version (a patch is how a
# body changes without a new one), where versions exist.
VERSION = ', version="1"' if "version" in inspect.signature(authoring.workflow).parameters \
    else ""

OLD = f"""
import marbles_rq as mr

@mr.step
def first(n: int) -> int:
    return n + 1

@mr.step
def finish(n: int, answer: str) -> str:
    return f"{{n}}:{{answer}}"

@mr.workflow("patchy"{VERSION})
def patchy(ctx, n: int) -> dict:
    a = first(n)
    answer = ctx.ask.question("go?", key="go")
    return {{"branch": "old", "out": finish(a, answer)}}
"""

NEW = f"""
import marbles_rq as mr

@mr.step
def first(n: int) -> int:
    return n + 1

@mr.step
def extra(n: int) -> int:
    return n * 100

@mr.step
def finish(n: int, answer: str) -> str:
    return f"{{n}}:{{answer}}"

@mr.workflow("patchy"{VERSION})
def patchy(ctx, n: int) -> dict:
    a = first(n)
    if mr.patched("add-extra"):
        a, branch = extra(a), "new"
    else:
        branch = "old"
    answer = ctx.ask.question("go?", key="go")
    return {{"branch": branch, "out": finish(a, answer)}}
"""


def _source(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _ledger(procs: Procs, run_id: str) -> dict[str, Any]:
    view = procs.observer.view(run_id)
    assert view is not None
    return {s.key: json.loads(bytes(s.result)) for s in view.steps}


def test_a_patch_added_while_runs_wait_keeps_old_runs_on_the_old_branch(
        redis_server: Any, tmp_path: Path) -> None:
    old = Procs(redis_server.url, tmp_path / "old", sources=[_source(tmp_path / "old" /
                                                                     "flows.py", OLD)])
    new = Procs(redis_server.url, tmp_path / "new", sources=[_source(tmp_path / "new" /
                                                                     "flows.py", NEW)])
    try:
        worker = old.worker()
        for run_id, n in (("old-1", 1), ("old-2", 2)):
            done = old.cli("enqueue", "patchy", "--input", str(n), "--id", run_id)
            assert done.returncode == 0, done.stderr
        for run_id in ("old-1", "old-2"):
            old.observer.wait_status(run_id, "waiting")
        worker.stop()  # the deploy: the old code is gone

        new.worker()
        done = new.cli("enqueue", "patchy", "--input", "3", "--id", "new-1")
        assert done.returncode == 0, done.stderr
        new.observer.wait_status("new-1", "waiting")
        # The new run took the new branch before it parked, and recorded it.
        assert _ledger(new, "new-1")["patchy.|patch:add-extra#0"] is True
        assert "patchy.extra#0" in _ledger(new, "new-1")

        for run_id in ("old-1", "old-2", "new-1"):
            assert new.cli("answer", run_id, "go", "yes").returncode == 0
        results = {r: new.observer.wait_status(r, "succeeded") for r in
                   ("old-1", "old-2", "new-1")}
        got = {r: json.loads(bytes(v.result)) for r, v in results.items()
               if v.result is not None}
        assert got == {"old-1": {"branch": "old", "out": "2:yes"},
                       "old-2": {"branch": "old", "out": "3:yes"},
                       "new-1": {"branch": "new", "out": "400:yes"}}
        # The old runs' replay on the new code decided once, for the old branch, and
        # recorded it: a later replay returns the same.
        for run_id in ("old-1", "old-2"):
            ledger = _ledger(new, run_id)
            assert ledger["patchy.|patch:add-extra#0"] is False
            assert "patchy.extra#0" not in ledger
        # status shows the decisions: in --json (the client's RunStatus.patches) and text.
        shown = json.loads(new.cli("status", "old-1", "--json").stdout)
        assert shown["patches"] == [{"id": "add-extra", "path": "patchy.|patch:add-extra",
                                     "new": False}]
        assert "patch add-extra  new branch" in new.cli("status", "new-1").stdout
    finally:
        old.stop_all()
        new.stop_all()


# -- the decision rules, in process memory (the same executor) ------------------------------

def _registry(**bodies: Any) -> Registry:
    registry = Registry()
    for name, fn in bodies.items():
        registry.workflows[name] = _pinned(name, fn)
    return registry


def _pinned(name: str, fn: Any) -> authoring.WorkflowDef:
    """A definition with a given version: a patched workflow keeps its version across the
    deploy that adds the patch (its default version, a fingerprint of the code, would
    change with it, and a worker would hand the runs in flight back)."""
    return authoring.WorkflowDef(name, fn, None, _version="1")


def test_a_new_run_takes_the_new_branch_and_records_it() -> None:
    def body(ctx: Any) -> list[bool]:
        return [mr.patched("a"), mr.patched("a"), mr.patched("b")]

    done = dry_run("p", b"null", registry=_registry(p=body))
    assert done.view.status == "succeeded"
    assert json.loads(bytes(done.view.result or b"null")) == [True, True, True]
    keys = {s.key: json.loads(bytes(s.result)) for s in done.view.steps}
    assert keys == {"p.|patch:a#0": True, "p.|patch:a#1": True, "p.|patch:b#0": True}


def test_a_run_that_passed_the_point_takes_the_old_branch_on_every_replay() -> None:
    """A run parked at a timer after a step, by code without the patch; the code that
    replays it has the patch before that step's position: old branch, recorded."""
    calls: list[str] = []

    @mr.step(name="patch_rule_step")
    def work() -> str:
        calls.append("work")
        return "done"

    def old(ctx: Any) -> str:
        out = work()
        mr.sleep(3600)
        return out

    def new(ctx: Any) -> str:
        branch = "new" if mr.patched("p") else "old"
        out = work()
        mr.sleep(3600)
        return f"{branch}:{out}"

    registry = _registry(flow=old)

    engine = MemoryEngine(registry, limits=Limits())
    record = prepare(RunRequest("flow", b"null", "r1"), registry)
    engine.store.record(record)
    engine.run_until_idle()
    assert engine.store.runs["r1"].status == "waiting" and calls == ["work"]
    registry.workflows["flow"] = _pinned("flow", new)
    engine.advance_to(engine.now_ms() + 3_600_000)  # its timer fires: the new code replays
    view = engine.store.get("r1")
    assert view is not None and view.status == "succeeded"
    assert json.loads(bytes(view.result or b"null")) == "old:done"
    assert calls == ["work"]  # replayed, not re-run
    assert {s.key: json.loads(bytes(s.result)) for s in view.steps
            if "|patch" in s.key} == {"flow.|patch:p#0": False}


def test_deprecate_patch_fails_a_run_on_the_old_branch_and_passes_the_others() -> None:
    def old_branch(ctx: Any) -> str:
        mr.deprecate_patch("p")
        return "ok"

    registry = _registry(flow=old_branch)
    done = dry_run("flow", b"null", registry=registry)
    assert done.view.status == "succeeded"  # nothing recorded there: the new code runs

    for decision, status in ((b"false", "failed"), (b"true", "succeeded")):
        engine = MemoryEngine(registry, limits=Limits())
        record = prepare(RunRequest("flow", b"null", f"r-{decision.decode()}"), registry)
        engine.store.record(record)
        engine.store.runs[record.id].ledger["flow.|patch:p#0"] = StepRecord(
            version=1, key="flow.|patch:p#0", name="|patch:p", status="succeeded",
            attempts=0, result=msgspec.Raw(decision))
        engine.run_until_idle()
        view = engine.store.get(record.id)
        assert view is not None and view.status == status
        if status == "failed":
            assert view.error is not None and view.error.type == "NonDeterminism"
            assert "deprecated" in view.error.message and "'p'" in view.error.message


def test_deprecate_patch_fails_a_run_that_passed_its_place_before_the_patch_existed() -> None:
    """The patch was never deployed to this run's worker (no decision recorded), but the
    run asked its question, which comes after the patch's place: it would have taken the
    old branch, so the deprecated patch fails it rather than run the new branch's step
    before a question already answered."""
    from marbles_rq.testing import Environment

    calls: list[str] = []

    @mr.step(name="deprecate_rule_extra")
    def extra() -> str:
        calls.append("extra")
        return "extra"

    def old(ctx: Any) -> str:
        return str(ctx.ask.question("go?", key="go"))

    def new(ctx: Any) -> str:
        mr.deprecate_patch("p")
        extra()
        return str(ctx.ask.question("go?", key="go"))

    registry = _registry(flow=old)
    env = Environment(registry=registry, schedules=False)
    run = env.start("flow")
    env.run_until_idle()
    assert run.status().status == "waiting"
    registry.workflows["flow"] = _pinned("flow", new)
    run.answer("go", "yes")
    env.run_until_idle()
    view = run.status()
    assert view.status == "failed" and view.error is not None, view
    assert view.error.type == "NonDeterminism"
    assert "deprecated" in view.error.message and "'p'" in view.error.message
    assert calls == []


@pytest.mark.parametrize("bad", ["", "has space", "x" * 101, "|pipe", "a#1", 7])
def test_a_bad_patch_id_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(PatchIdError, match="invalid patch id"):
        check_id(bad)


def test_patches_in_parallel_branches_and_async_tasks_each_decide_in_their_own_frame(
) -> None:
    import asyncio

    def branch(i: int) -> Any:
        return lambda: (i, mr.patched("p"))

    def sync_body(ctx: Any) -> list[Any]:
        return [mr.patched("p"), *ctx.parallel(branch(0), branch(1))]

    async def helper(i: int) -> Any:
        return i, mr.patched("p")

    async def async_body(ctx: Any) -> list[Any]:
        return [mr.patched("p"), *await asyncio.gather(helper(0), helper(1))]

    for body in (sync_body, async_body):
        done = dry_run("p", b"null", registry=_registry(p=body))
        assert done.view.status == "succeeded", done.view.error
        assert json.loads(bytes(done.view.result or b"null")) == [True, [0, True], [1, True]]
        keys = sorted(s.key for s in done.view.steps if "|patch" in s.key)
        assert len(keys) == 3 and "p.|patch:p#0" in keys, keys
