"""`marbles-rq export` and `marbles-rq replay --check`, on histories of REAL runs: a real
redis-server and real `marbles-rq worker`s (tests/procs.py) execute tests/replay_workflows.py;
runs wait on a question, finish after an answer, after a signal, after their children. Then a
deploy: the worker is stopped and one on the patched source (`mr.patched` added to
`shipping`) takes over, so one run goes on along the patch's old branch and a new one takes the
new branch. The checker replays them (real CLI processes) against the deployed source, which
passes, and against changed copies of it written to tmp_path: a reordered step, a removed
step, a renamed ask, a body that now raises, a patch removed too early, a patch deprecated too
early. No step body runs during a check (each step counts its executions in Redis).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.engine import authoring
from marbles_rq.engine.authoring import Registry
from marbles_rq.engine.dryrun import DryRun, dry_run
from marbles_rq.engine.history import History, QuestionState, from_line, to_line
from marbles_rq.engine.replay_check import check_all
from tests.procs import REPO_ROOT, Procs, _cli_argv
from tests.redis_procs import RedisServer, free_port
from tests.replay_workflows import EXEC_PREFIX

OLD_SOURCE = REPO_ROOT / "tests" / "replay_workflows.py"
# The deploy: `shipping` gets a step behind a patch, before its first question.
PATCH = ("    # (the patched deploy adds `weigh` here: tests/test_replay_check.py PATCH)\n",
         '    if mr.patched("weigh-first"):\n        a = weigh(a)\n')
Done = subprocess.CompletedProcess


class Recorded:
    """The runs recorded once for the module, and their exported histories."""

    def __init__(self, procs: Procs, file: Path, source: Path) -> None:
        self.procs, self.file = procs, file
        self.source = source  # the deployed source (the patch added)

    def histories(self) -> dict[str, History]:
        lines = self.file.read_bytes().splitlines()
        return {h.run_id: h for h in (from_line(line, "t") for line in lines)}

    def executions(self) -> dict[str, dict[str, int]]:
        client = self.procs.observer.client
        out = {}
        for key in client.scan_iter(match=EXEC_PREFIX + "*"):
            name = key.decode() if isinstance(key, bytes) else key
            out[name] = {str(k): int(v) for k, v in client.hgetall(key).items()}
        return out


def ok(done: Done[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def one_line_error(done: Done[str], code: int, *words: str) -> str:
    """The CLI's failure contract: exit `code`, one line on stderr, nothing on stdout."""
    shown = f"exit {done.returncode}\nstdout: {done.stdout!r}\nstderr: {done.stderr!r}"
    assert done.returncode == code, shown
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    assert done.stdout == "", shown
    for word in words:
        assert word in lines[0], shown
    return lines[0]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    base = tmp_path_factory.mktemp("replay-check")
    deployed = base / "deployed" / "replay_workflows.py"
    deployed.parent.mkdir()
    deployed.write_text(OLD_SOURCE.read_text().replace(*PATCH))
    server = RedisServer.start(dir=base / "redis")
    old = Procs(server.url, base / "old", sources=(OLD_SOURCE,))
    procs = Procs(server.url, base / "procs", sources=(deployed,))
    try:
        worker = old.worker()
        obs = old.observer
        old.enqueue("order", 1, "o-wait")
        old.enqueue("order", 2, "o-done")
        old.enqueue("nudged", None, "s-done")
        old.enqueue("parent", 5, "p-done")
        old.enqueue("shipping", 3, "sh-old")
        for rid in ("o-wait", "o-done", "sh-old"):
            obs.wait_status(rid, "waiting")
        assert obs.wait_status("p-done", "succeeded").status == "succeeded"
        worker.stop()  # the deploy: the old code is gone
        procs.worker()
        ok(procs.cli("answer", "o-done", "colour", "blue"))
        ok(procs.cli("signal", "s-done", "go", "--payload", '{"n": 4}'))
        # sh-old had asked its question before the patch existed: it takes the old branch.
        ok(procs.cli("answer", "sh-old", "colour", "red"))
        procs.enqueue("shipping", 3, "sh-new")
        for rid in ("o-done", "s-done"):
            assert obs.wait_status(rid, "succeeded", "failed").status == "succeeded", rid
        obs.wait_event("sh-old", lambda e: e.type == "parked" and e.data.get("questions") == [
            "size"], what="sh-old parked at its second question")
        obs.wait_status("sh-new", "waiting")
        file = base / "runs.jsonl"
        out = ok(procs.cli("export", *RUNS, "-o", str(file)))
        assert out.strip() == f"exported {len(RUNS)} run histories to {file}"
        yield Recorded(procs, file, deployed)
    finally:
        old.stop_all()
        procs.stop_all()
        print(old.report())
        print(procs.report())
        server.stop()


RUNS = ("o-wait", "o-done", "s-done", "p-done", "sh-old", "sh-new")


def unfingerprinted(out: str) -> list[str]:
    """The lines of `replay --check`'s text without the default versions (`order@5ce33a33f8`
    -> `order`): a fingerprint of the code, which these tests do not pin."""
    return [re.sub(r"@[0-9a-f]{10}\b", "", line) for line in out.splitlines()]


def check(recorded: Recorded, source: Path, *args: str) -> Done[str]:
    return recorded.procs.cli("replay", "--check", "--source", str(source), *args)


def check_json(recorded: Recorded, source: Path, *args: str) -> tuple[int, dict[str, Any],
                                                                     dict[str, Any]]:
    done = check(recorded, source, *args, "--json")
    assert done.returncode in (0, 1), done.stderr
    objects = [json.loads(line) for line in done.stdout.splitlines()]
    return done.returncode, {o["run"]: o for o in objects[:-1]}, objects[-1]


def changed(recorded: Recorded, tmp_path: Path, *edits: tuple[str, str]) -> Path:
    text = recorded.source.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "new_code" / "replay_workflows.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# -- export ------------------------------------------------------------------------------

def test_export_writes_what_a_replay_reads(recorded: Recorded) -> None:
    histories = recorded.histories()
    assert tuple(histories) == RUNS
    waiting = histories["o-wait"]
    assert waiting.status == "waiting" and waiting.run.name == "order"
    assert msgspec.json.decode(waiting.run.input) == 1
    assert [e.name for e in waiting.ledger] == ["rc_fetch", "check", "weigh"]
    assert [(q.record.key, q.state) for q in waiting.questions] == [("colour", "open")]
    assert waiting.wait_reason == "question" and waiting.wait_for["questions"] == ["colour"]
    done = histories["o-done"]
    assert done.status == "succeeded"
    assert [(q.record.key, q.state, msgspec.json.decode(q.answer)) for q in done.questions] == [
        ("colour", "answered", "blue")]
    assert [e.name for e in done.ledger] == ["rc_fetch", "check", "weigh", "pack"]
    assert msgspec.json.decode(done.result) == {"label": "37-blue", "colour": "blue"}
    signalled = histories["s-done"]
    assert [(s.name, s.sent, s.taken) for s in signalled.signals] == [("go", 1, 1)]
    assert "|signal" in [e.name for e in signalled.ledger]
    parent = histories["p-done"]
    assert [(c.id, c.status, msgspec.json.decode(c.result)) for c in parent.children] == [
        ("p-done.k0", "succeeded", 6), ("p-done.k1", "succeeded", 7)]
    old_branch, new_branch = histories["sh-old"], histories["sh-new"]
    assert [(e.name, msgspec.json.decode(e.result)) for e in old_branch.ledger
            if e.name.startswith("|patch:")] == [("|patch:weigh-first", False)]
    assert [e.name for e in new_branch.ledger] == ["rc_fetch", "|patch:weigh-first", "weigh"]
    # A line is a record with a version, and reads back byte for byte.
    line = recorded.file.read_bytes().splitlines()[0]
    assert json.loads(line)["kind"] == "history" and json.loads(line)["version"] == 1
    assert to_line(from_line(line, "x")) == line + b"\n"


def test_export_selects_a_workflow_by_status(recorded: Recorded) -> None:
    out = ok(recorded.procs.cli("export", "--workflow", "order", "--status", "waiting"))
    assert [json.loads(line)["run"]["id"] for line in out.splitlines()] == ["o-wait"]
    out = ok(recorded.procs.cli("export", "--workflow", "order"))
    assert sorted(json.loads(line)["run"]["id"] for line in out.splitlines()) == [
        "o-done", "o-wait"]
    # A workflow with no run (or a misspelt one) exports nothing, and says so on stderr.
    none = recorded.procs.cli("export", "--workflow", "ordr")
    assert none.returncode == 0 and none.stdout == ""
    assert none.stderr.strip() == "note: no run of workflow 'ordr' in any status"


# -- replay --check ----------------------------------------------------------------------

def test_the_unchanged_source_passes_and_no_step_body_runs(recorded: Recorded) -> None:
    before = recorded.executions()
    out = ok(check(recorded, recorded.source, "--from", str(recorded.file)))
    lines = unfingerprinted(out)
    assert lines[-1] == "6 runs: ok 6, failing 0", out
    assert "ok    o-wait  order  parked at question 'colour', as recorded" in lines
    assert "ok    o-done  order  finished the same way (same result)" in lines
    # The recorded signal and the children's outcomes are replayed, not waited for again.
    assert "ok    s-done  nudged  finished the same way (same result)" in lines
    assert "ok    p-done  parent  finished the same way (same result)" in lines
    assert "ok    sh-old  shipping@1  parked at question 'size', as recorded" in lines or (
        "ok    sh-old  shipping  parked at question 'size', as recorded" in lines)
    assert "patch 'weigh-first': 1 run still on its old branch" in lines
    assert recorded.executions() == before


def test_a_reordered_step_is_non_determinism(recorded: Recorded, tmp_path: Path) -> None:
    source = changed(recorded, tmp_path, ("    b = check(a)\n    c = weigh(b)\n",
                                          "    c = weigh(a)\n    b = check(c)\n"))
    code, runs, summary = check_json(recorded, source, "--from", str(recorded.file))
    assert code == 1
    for rid in ("o-wait", "o-done"):
        assert runs[rid]["ok"] is False and runs[rid]["outcome"] == "nondeterminism"
        problem = runs[rid]["problems"][0]
        assert (problem["frame"], problem["position"], problem["recorded"],
                problem["called"]) == ("order", 1, "check", "weigh")
    assert runs["s-done"]["ok"] and runs["p-done"]["ok"]
    assert summary["summary"] == {"runs": 6, "ok": 4, "failing": 2}


def test_a_removed_step_is_caught(recorded: Recorded, tmp_path: Path) -> None:
    source = changed(recorded, tmp_path,
                     ("    b = check(a)\n    c = weigh(b)\n", "    c = weigh(a)\n"))
    done = check(recorded, source, "--from", str(recorded.file))
    assert done.returncode == 1, done.stderr
    lines = unfingerprinted(done.stdout)
    assert ("FAIL  o-wait  order  NonDeterminism in order at position 1: recorded 'check', "
            "now 'weigh'") in lines
    assert lines[-1] == "6 runs: ok 4, failing 2"


def test_a_removed_last_step_is_caught_on_a_finished_run(recorded: Recorded,
                                                         tmp_path: Path) -> None:
    source = changed(recorded, tmp_path,
                     ("    label = pack(c, colour)\n", "    label = f'{c}-{colour}'\n"))
    code, runs, _ = check_json(recorded, source, "--from", str(recorded.file))
    assert code == 1
    assert runs["o-done"]["outcome"] == "unreached"
    assert runs["o-done"]["problems"][0]["calls"] == ["order.pack#0"]
    assert runs["o-wait"]["ok"]  # it waits before that step: nothing recorded is skipped


def test_a_renamed_ask_is_caught(recorded: Recorded, tmp_path: Path) -> None:
    source = changed(recorded, tmp_path, ('key="colour"', 'key="color"'))
    code, runs, _ = check_json(recorded, source, "--from", str(recorded.file))
    assert code == 1
    for rid in ("o-wait", "o-done"):
        assert runs[rid]["outcome"] == "ask_changed", runs[rid]
        assert runs[rid]["problems"][0]["recorded"] == "colour"
        assert runs[rid]["problems"][0]["asked"] == "color"
    assert runs["o-wait"]["summary"] == ("question 'colour' (open) is no longer asked; it asks "
                                         "'color' instead, which this run never asked")


def test_a_body_error_between_steps_is_caught(recorded: Recorded, tmp_path: Path) -> None:
    source = changed(recorded, tmp_path, ('    ctx.log.info("packing in %s", colour)\n',
                                          '    if colour == "blue":\n'
                                          '        raise ValueError("blue is sold out")\n'))
    code, runs, _ = check_json(recorded, source, "--from", str(recorded.file))
    assert code == 1
    assert runs["o-done"]["outcome"] == "body_error"
    assert runs["o-done"]["summary"] == "the body raised ValueError: blue is sold out"
    assert runs["o-wait"]["ok"]  # not answered yet: the code after the question is not reached


def test_run_ids_and_a_workflow_selection_read_redis(recorded: Recorded,
                                                     tmp_path: Path) -> None:
    out = ok(check(recorded, recorded.source, "o-wait", "p-done"))
    assert out.splitlines()[-1] == "2 runs: ok 2, failing 0"
    # --workflow alone checks the runs in flight (waiting, running, queued).
    code, runs, _ = check_json(recorded, recorded.source, "--workflow", "order")
    assert code == 0 and list(runs) == ["o-wait"]
    code, runs, _ = check_json(recorded, recorded.source, "--workflow", "order", "--status",
                               "succeeded,waiting")
    assert code == 0 and sorted(runs) == ["o-done", "o-wait"]
    source = changed(recorded, tmp_path, ('key="colour"', 'key="color"'))
    done = check(recorded, source, "--workflow", "order")
    assert done.returncode == 1 and done.stdout.splitlines()[-1] == "1 run: ok 0, failing 1"


# -- patches ---------------------------------------------------------------------------

def test_a_patch_removed_too_early_is_caught(recorded: Recorded, tmp_path: Path) -> None:
    # The new branch kept, the patch and its old branch removed: sh-old took the old one.
    source = changed(recorded, tmp_path, (PATCH[1], "    a = weigh(a)\n"))
    code, runs, summary = check_json(recorded, source, "--from", str(recorded.file))
    assert code == 1
    assert runs["sh-old"]["outcome"] == "patch_removed", runs["sh-old"]
    assert runs["sh-old"]["summary"] == ("patch 'weigh-first' removed while this run took its "
                                         "old branch")
    assert runs["sh-old"]["old_branch_patches"] == ["weigh-first"]
    assert runs["sh-new"]["ok"], runs["sh-new"]  # it took the new branch, which stays
    assert summary["patches"] == {"weigh-first": {"old_branch_runs": 1}}
    assert summary["summary"] == {"runs": 6, "ok": 5, "failing": 1}


def test_a_patch_deprecated_too_early_is_caught(recorded: Recorded, tmp_path: Path) -> None:
    source = changed(recorded, tmp_path,
                     (PATCH[1], '    mr.deprecate_patch("weigh-first")\n    a = weigh(a)\n'))
    code, runs, _ = check_json(recorded, source, "--from", str(recorded.file))
    assert code == 1
    assert runs["sh-old"]["outcome"] == "patch_deprecated", runs["sh-old"]
    assert runs["sh-old"]["problems"][0]["patch"] == "weigh-first"
    assert runs["sh-new"]["ok"]


def test_only_new_branch_runs_in_flight_let_the_old_branch_go(recorded: Recorded,
                                                              tmp_path: Path) -> None:
    out = ok(check(recorded, recorded.source, "sh-new"))
    assert ("patch 'weigh-first': no run in flight on its old branch (its old branch may be "
            "removed, as far as these runs tell)") in out.splitlines()


# -- in memory: async and parallel bodies (histories from dry runs, no Redis) ---------------

def _history(done: DryRun, status: str | None = None, drop: str = "") -> History:
    """A dry run's run as `export` writes it; `status` and `drop` (a step name whose
    entries are left out, the question reopened) make it a run still in flight."""
    run = done.runs.runs[done.view.record.id]
    questions = [QuestionState(record=a.record, state="open" if drop else a.state,
                               answer=msgspec.Raw(msgspec.json.encode(None if drop
                                                                      else a.answer)))
                 for a in run.asks.values()]
    return History(version=1, run=run.record, status=status or run.status,
                   result=msgspec.Raw(run.result or b"null"),
                   ledger=[e for e in run.ledger.values() if e.name != drop],
                   questions=questions)


def test_async_and_parallel_bodies_replay_in_memory() -> None:
    calls: list[str] = []

    @mr.step(name="rc_unit_fetch")
    async def fetch(n: int) -> int:
        calls.append("fetch")
        return n + 1

    @mr.step(name="rc_unit_size")
    def size(n: int) -> int:
        calls.append("size")
        return n * 2

    async def async_flow(ctx: Any) -> list[object]:
        x = await fetch(3)
        colour = await ctx.ask.question("Colour?", choices=["red", "blue"], key="colour")
        return [await size(x), colour]

    def parallel_flow(ctx: Any) -> list[int]:
        return list(mr.parallel(lambda: size(1), lambda: size(2)))

    @mr.step(name="rc_unit_outer")
    def outer(n: int) -> int:
        calls.append("outer")
        return size(n) + 1  # a step inside a step: replayed with the outer one's result

    def nested_flow(ctx: Any) -> int:
        return int(outer(4))

    def swapped_flow(ctx: Any) -> list[int]:
        return list(mr.parallel(lambda: size(1), lambda: size(2), lambda: size(3)))

    registry = Registry()
    for name, fn in (("a", async_flow), ("p", parallel_flow), ("n", nested_flow)):
        registry.workflows[name] = authoring.WorkflowDef(name, fn, None)
    done_a = dry_run("a", b"null", registry=registry, answer=lambda q: "red")
    done_p = dry_run("p", b"null", registry=registry)
    done_n = dry_run("n", b"null", registry=registry)
    assert sorted(e.key for e in done_n.view.steps) == ["n.rc_unit_outer#0",
                                                        "n.rc_unit_outer#0.rc_unit_size#0"]
    histories = [_history(done_a), _history(done_a, "waiting", drop="rc_unit_size"),
                 _history(done_p), _history(done_n)]
    calls.clear()
    report = check_all(histories, registry)
    assert [v.summary for v in report.verdicts] == [
        "finished the same way (same result)", "parked at question 'colour', as recorded",
        "finished the same way (same result)", "finished the same way (same result)"]
    assert calls == []  # no step body ran
    registry.workflows["p"] = authoring.WorkflowDef("p", swapped_flow, None)
    verdict = check_all([_history(done_p)], registry).verdicts[0]
    # A third branch is new work: it stops there, before finishing differently.
    assert verdict.ok and verdict.summary.startswith("reached the end of its recorded history")
    assert calls == []


def test_a_version_the_new_source_does_not_serve_is_said_and_still_checked() -> None:
    @mr.step(name="rc_unit_one")
    def one() -> int:
        return 1

    def flow(ctx: Any) -> int:
        return int(one())

    registry = Registry()  # serves version "2" (and runs recorded before versions)
    registry.workflows["v"] = authoring.WorkflowDef("v", flow, None, _version="2")
    done = _history(dry_run("v", b"null", registry=registry))
    old = msgspec.structs.replace(done, wf_version="1")
    verdicts = check_all([old, msgspec.structs.replace(done, wf_version="2")],
                         registry).verdicts
    assert verdicts[0].ok and verdicts[0].summary == "finished the same way (same result)"
    # (With versions, the current definition's own is named after it.)
    assert len(verdicts[0].notes) == 1 and verdicts[0].notes[0].startswith(
        "version 1 is not served by the new source; replayed against its current definition")
    assert verdicts[1].ok and verdicts[1].notes == []


# -- bad input ---------------------------------------------------------------------------

def test_bad_input_is_one_line_and_a_non_zero_exit(recorded: Recorded, tmp_path: Path) -> None:
    procs = recorded.procs
    one_line_error(procs.cli("export", "o-wait", "nope"), 2, "no run with id 'nope'")
    one_line_error(procs.cli("export"), 2, "give RUN ids or --workflow")
    one_line_error(procs.cli("export", "--workflow", "order", "--status", "parked"), 2,
                   "'parked' is not one of")
    one_line_error(procs.cli("export", "o-wait", "--workflow", "order"), 2, "not both")
    dead = f"redis://127.0.0.1:{free_port()}/0"
    one_line_error(procs.cli("export", "o-wait", "--redis-url", dead), 3, "cannot reach Redis")
    one_line_error(check(recorded, recorded.source, "o-wait", "--redis-url", dead), 3,
                   "cannot reach Redis")
    one_line_error(check(recorded, recorded.source, "--from", str(tmp_path / "none.jsonl")), 2,
                   "cannot read the history file")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(recorded.file.read_bytes().splitlines()[0] + b"\n{\"kind\": \"run\"}\n")
    one_line_error(check(recorded, recorded.source, "--from", str(bad)), 2, f"{bad}:2",
                   "not a run history")
    newer = json.loads(recorded.file.read_bytes().splitlines()[0])
    newer["version"] = 99
    bad.write_text(json.dumps(newer) + "\n")
    one_line_error(check(recorded, recorded.source, "--from", str(bad)), 2, f"{bad}:1")
    newer.update(version=1, status="parked")
    bad.write_text(json.dumps(newer) + "\n")
    one_line_error(check(recorded, recorded.source, "--from", str(bad)), 2, f"{bad}:1",
                   "status 'parked'")
    one_line_error(procs.cli("replay", "--source", str(recorded.source), "o-wait"), 2, "--check")
    # A misspelt workflow checks nothing: refused, where a declared one with no run in
    # flight passes.
    one_line_error(check(recorded, recorded.source, "--workflow", "ordr"), 2, "'ordr'",
                   "declares no such workflow")
    assert ok(check(recorded, recorded.source, "--workflow", "child_sum")).splitlines() == [
        "0 runs: ok 0, failing 0"]
    argv = [*_cli_argv(), "--redis-url", procs.url, "replay", "--check", "o-wait"]
    env = {k: v for k, v in procs.env.items() if k != "MARBLES_SOURCE"}
    no_source = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60,
                               stdin=subprocess.DEVNULL)
    one_line_error(no_source, 2, "give --source")
    one_line_error(check(recorded, recorded.source, "--from", str(recorded.file), "o-wait"), 2,
                   "only one of them")
    # A file export refused leaves nothing behind.
    target = tmp_path / "out.jsonl"
    one_line_error(procs.cli("export", "o-wait", "nope", "-o", str(target)), 2, "nope")
    assert not target.exists() and list(tmp_path.glob(".export-*")) == []


def test_export_to_a_pipe_writes_into_it_and_a_directory_is_refused(recorded: Recorded,
                                                                     tmp_path: Path) -> None:
    """`-o /dev/stdout` or a named pipe is written to, not replaced by a file renamed over
    it (as root that replaced /dev/stdout's link, or a device node)."""
    import os
    import stat

    fifo = tmp_path / "runs.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so the export's open does not block
    try:
        done = recorded.procs.cli("export", "o-wait", "-o", str(fifo))
        assert done.returncode == 0, done.stderr
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
        line = os.read(reader, 1 << 20)
    finally:
        os.close(reader)
    assert from_line(line, "fifo").run_id == "o-wait"
    assert done.stdout == "" and "exported 1 run history" in done.stderr
    one_line_error(recorded.procs.cli("export", "o-wait", "-o", str(tmp_path)), 1,
                   "is a directory")
    assert [p.name for p in tmp_path.iterdir()] == ["runs.fifo"]


def test_a_run_past_a_new_patch_counts_on_its_old_branch(recorded: Recorded,
                                                         tmp_path: Path) -> None:
    """o-wait recorded its steps before the patch existed: replayed by the patched code it
    decides the old branch (nothing recorded yet), and the count says so."""
    source = changed(recorded, tmp_path, ("    a = fetch(n)\n",
                                          "    a = fetch(n)\n    if mr.patched('late'):\n"
                                          "        a += 0\n"))
    code, runs, summary = check_json(recorded, source, "o-wait")
    assert code == 0 and runs["o-wait"]["ok"], runs
    assert runs["o-wait"]["old_branch_patches"] == ["late"]
    assert summary["patches"] == {"late": {"old_branch_runs": 1}}


def test_a_patch_before_a_question_the_run_already_asked_counts_on_its_old_branch(
        recorded: Recorded, tmp_path: Path) -> None:
    """o-wait asked 'colour' before the patch existed: once answered, its worker decides
    the old branch there (the question comes after the patch's place), so the check must
    decide the same, not run the new branch's step before a question already asked."""
    source = changed(recorded, tmp_path, ("    c = weigh(b)\n",
                                          "    c = weigh(b)\n    if mr.patched('pre-ask'):\n"
                                          "        c = check(c)\n"))
    code, runs, summary = check_json(recorded, source, "o-wait")
    assert code == 0 and runs["o-wait"]["ok"], runs
    assert runs["o-wait"]["old_branch_patches"] == ["pre-ask"]
    assert summary["patches"] == {"pre-ask": {"old_branch_runs": 1}}


def test_the_client_exports_and_the_test_kit_checks(recorded: Recorded) -> None:
    """From Python: `client.export` (sync and asyncio) gives the histories the CLI writes, and
    `marbles_rq.testing.check_replays` replays a file of them against the imported code."""
    import asyncio
    import sys

    client = mr.connect(recorded.procs.url)
    try:
        exported = {h.run_id: h for h in client.export(*RUNS)}
    finally:
        client.close()
    def same(h: History) -> bytes:  # as written, but for when it was exported
        return to_line(msgspec.structs.replace(h, exported_at_ms=0))

    assert {k: same(h) for k, h in exported.items()} == {
        k: same(h) for k, h in recorded.histories().items()}

    async def export_async() -> list[History]:
        aclient = mr.connect_async(recorded.procs.url)
        try:
            return await aclient.export("o-wait")
        finally:
            await aclient.aclose()

    assert [same(h) for h in asyncio.run(export_async())] == [same(exported["o-wait"])]
    script = ("from marbles_rq.engine.authoring import load_source\n"
              f"load_source({str(recorded.source)!r})\n"
              "from marbles_rq.testing import check_replays\n"
              f"report = check_replays({str(recorded.file)!r})\n"
              "print(report.summary(), report.old_branch)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "6 runs: ok 6, failing 0 {'weigh-first': 1}"


def test_a_run_twice_in_a_file_is_checked_once(recorded: Recorded, tmp_path: Path) -> None:
    doubled = tmp_path / "twice.jsonl"
    doubled.write_bytes(recorded.file.read_bytes() * 2)
    done = check(recorded, recorded.source, "--from", str(doubled))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"{len(RUNS)} runs: ok {len(RUNS)}, failing 0"
    assert done.stderr.strip() == (f"note: {len(RUNS)} line(s) repeat a run already in "
                                   f"{doubled}; each run is checked once, as its last line "
                                   f"has it")
