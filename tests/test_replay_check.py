"""`marbles-rq export` and `marbles-rq replay --check`, on histories of REAL runs: a real
redis-server and a real `marbles-rq worker` (tests/procs.py) execute tests/replay_workflows.py;
runs wait on a question, finish after an answer, after a signal, after their children. The
checker then replays them (real CLI processes) against changed copies of that source written
to tmp_path: a reordered step, a removed step, a renamed ask, a body that now raises, a patch
removed too early. The unchanged source passes, and no step body runs during a check (each
step counts its executions in Redis).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from marbles_rq.engine.history import History, from_line, to_line
from marbles_rq.store.records import StepRecord
from tests.procs import REPO_ROOT, Procs, _cli_argv
from tests.redis_procs import RedisServer, free_port
from tests.replay_workflows import EXEC_PREFIX

SOURCE = REPO_ROOT / "tests" / "replay_workflows.py"
Done = subprocess.CompletedProcess


class Recorded:
    """The runs recorded once for the module, and their exported histories."""

    def __init__(self, procs: Procs, file: Path) -> None:
        self.procs, self.file = procs, file

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
    server = RedisServer.start(dir=base / "redis")
    procs = Procs(server.url, base / "procs", sources=(SOURCE,))
    try:
        procs.worker()
        obs = procs.observer
        procs.enqueue("order", 1, "o-wait")
        procs.enqueue("order", 2, "o-done")
        procs.enqueue("nudged", None, "s-done")
        procs.enqueue("parent", 5, "p-done")
        for rid in ("o-wait", "o-done"):
            obs.wait_status(rid, "waiting")
        ok(procs.cli("answer", "o-done", "colour", "blue"))
        ok(procs.cli("signal", "s-done", "go", "--payload", '{"n": 4}'))
        for rid in ("o-done", "s-done", "p-done"):
            assert obs.wait_status(rid, "succeeded", "failed").status == "succeeded", rid
        file = base / "runs.jsonl"
        out = ok(procs.cli("export", "o-wait", "o-done", "s-done", "p-done", "-o", str(file)))
        assert out.strip() == f"exported 4 run histories to {file}"
        yield Recorded(procs, file)
    finally:
        procs.stop_all()
        print(procs.report())
        server.stop()


def check(recorded: Recorded, source: Path, *args: str) -> Done[str]:
    return recorded.procs.cli("replay", "--check", "--source", str(source), *args)


def check_json(recorded: Recorded, source: Path, *args: str) -> tuple[int, dict[str, Any],
                                                                     dict[str, Any]]:
    done = check(recorded, source, *args, "--json")
    assert done.returncode in (0, 1), done.stderr
    objects = [json.loads(line) for line in done.stdout.splitlines()]
    return done.returncode, {o["run"]: o for o in objects[:-1]}, objects[-1]


def changed(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    text = SOURCE.read_text()
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
    assert list(histories) == ["o-wait", "o-done", "s-done", "p-done"]
    waiting = histories["o-wait"]
    assert waiting.status == "waiting" and waiting.run.name == "order"
    assert msgspec.json.decode(waiting.run.input) == 1
    assert [e.name for e in waiting.ledger] == ["fetch", "check", "weigh"]
    assert [(q.record.key, q.state) for q in waiting.questions] == [("colour", "open")]
    assert waiting.wait_reason == "question" and waiting.wait_for["questions"] == ["colour"]
    done = histories["o-done"]
    assert done.status == "succeeded"
    assert [(q.record.key, q.state, msgspec.json.decode(q.answer)) for q in done.questions] == [
        ("colour", "answered", "blue")]
    assert [e.name for e in done.ledger] == ["fetch", "check", "weigh", "pack"]
    assert msgspec.json.decode(done.result) == {"label": "37-blue", "colour": "blue"}
    signalled = histories["s-done"]
    assert [(s.name, s.sent, s.taken) for s in signalled.signals] == [("go", 1, 1)]
    assert "|signal" in [e.name for e in signalled.ledger]
    parent = histories["p-done"]
    assert [(c.id, c.status, msgspec.json.decode(c.result)) for c in parent.children] == [
        ("p-done.k0", "succeeded", 6), ("p-done.k1", "succeeded", 7)]
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


# -- replay --check ----------------------------------------------------------------------

def test_the_unchanged_source_passes_and_no_step_body_runs(recorded: Recorded) -> None:
    before = recorded.executions()
    out = ok(check(recorded, SOURCE, "--from", str(recorded.file)))
    lines = out.splitlines()
    assert lines[-1] == "4 runs: ok 4, failing 0", out
    assert "ok    o-wait  order  parked at question 'colour', as recorded" in lines
    assert "ok    o-done  order  finished the same way (same result)" in lines
    # The recorded signal and the children's outcomes are replayed, not waited for again.
    assert "ok    s-done  nudged  finished the same way (same result)" in lines
    assert "ok    p-done  parent  finished the same way (same result)" in lines
    assert recorded.executions() == before


def test_a_reordered_step_is_non_determinism(recorded: Recorded, tmp_path: Path) -> None:
    source = changed(tmp_path, ("    b = check(a)\n    c = weigh(b)\n",
                                "    c = weigh(a)\n    b = check(c)\n"))
    code, runs, summary = check_json(recorded, source, "--from", str(recorded.file))
    assert code == 1
    for rid in ("o-wait", "o-done"):
        assert runs[rid]["ok"] is False and runs[rid]["outcome"] == "nondeterminism"
        problem = runs[rid]["problems"][0]
        assert (problem["frame"], problem["position"], problem["recorded"],
                problem["called"]) == ("order", 1, "check", "weigh")
    assert runs["s-done"]["ok"] and runs["p-done"]["ok"]
    assert summary["summary"] == {"runs": 4, "ok": 2, "failing": 2}


def test_a_removed_step_is_caught(recorded: Recorded, tmp_path: Path) -> None:
    source = changed(tmp_path, ("    b = check(a)\n    c = weigh(b)\n", "    c = weigh(a)\n"))
    done = check(recorded, source, "--from", str(recorded.file))
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert ("FAIL  o-wait  order  NonDeterminism in order at position 1: recorded 'check', "
            "now 'weigh'") in lines
    assert lines[-1] == "4 runs: ok 2, failing 2"


def test_a_removed_last_step_is_caught_on_a_finished_run(recorded: Recorded,
                                                         tmp_path: Path) -> None:
    source = changed(tmp_path, ("    label = pack(c, colour)\n", "    label = f'{c}-{colour}'\n"))
    code, runs, _ = check_json(recorded, source, "--from", str(recorded.file))
    assert code == 1
    assert runs["o-done"]["outcome"] == "unreached"
    assert runs["o-done"]["problems"][0]["calls"] == ["order.pack#0"]
    assert runs["o-wait"]["ok"]  # it waits before that step: nothing recorded is skipped


def test_a_renamed_ask_is_caught(recorded: Recorded, tmp_path: Path) -> None:
    source = changed(tmp_path, ('key="colour"', 'key="color"'))
    code, runs, _ = check_json(recorded, source, "--from", str(recorded.file))
    assert code == 1
    for rid in ("o-wait", "o-done"):
        assert runs[rid]["outcome"] == "ask_changed", runs[rid]
        assert runs[rid]["problems"][0]["recorded"] == "colour"
        assert runs[rid]["problems"][0]["asked"] == "color"
    assert runs["o-wait"]["summary"] == ("question 'colour' (open) is no longer asked; it asks "
                                         "'color' instead, which this run never asked")


def test_a_body_error_between_steps_is_caught(recorded: Recorded, tmp_path: Path) -> None:
    source = changed(tmp_path, ('    ctx.log.info("packing in %s", colour)\n',
                                '    if colour == "blue":\n'
                                '        raise ValueError("blue is sold out")\n'))
    code, runs, _ = check_json(recorded, source, "--from", str(recorded.file))
    assert code == 1
    assert runs["o-done"]["outcome"] == "body_error"
    assert runs["o-done"]["summary"] == "the body raised ValueError: blue is sold out"
    assert runs["o-wait"]["ok"]  # not answered yet: the code after the question is not reached


def test_run_ids_and_a_workflow_selection_read_redis(recorded: Recorded,
                                                     tmp_path: Path) -> None:
    out = ok(check(recorded, SOURCE, "o-wait", "p-done"))
    assert out.splitlines()[-1] == "2 runs: ok 2, failing 0"
    # --workflow alone checks the runs in flight (waiting, running, queued).
    code, runs, _ = check_json(recorded, SOURCE, "--workflow", "order")
    assert code == 0 and list(runs) == ["o-wait"]
    code, runs, _ = check_json(recorded, SOURCE, "--workflow", "order", "--status",
                               "succeeded,waiting")
    assert code == 0 and sorted(runs) == ["o-done", "o-wait"]
    source = changed(tmp_path, ('key="colour"', 'key="color"'))
    done = check(recorded, source, "--workflow", "order")
    assert done.returncode == 1 and done.stdout.splitlines()[-1] == "1 run: ok 0, failing 1"


# -- patches (ledgers built here: a patch entry as `mr.patched` records it) -----------------

def _with_patch(history: History, decision: bool) -> History:
    """`history` with a patch decision recorded before its first step."""
    first = history.ledger[0]
    entry = StepRecord(version=1, key="order.patch:fast-pack#0", name="patch:fast-pack",
                       status="succeeded", attempts=0, seq=-1, epoch=first.epoch,
                       wseq=first.wseq - 1,
                       result=msgspec.Raw(msgspec.json.encode(decision)))
    return msgspec.structs.replace(history, ledger=[entry, *history.ledger])


def test_a_patch_removed_while_runs_took_its_old_branch(recorded: Recorded,
                                                        tmp_path: Path) -> None:
    histories = recorded.histories()
    file = tmp_path / "patched.jsonl"
    file.write_bytes(to_line(_with_patch(histories["o-wait"], False))
                     + to_line(_with_patch(histories["o-done"], True)))
    # The source declares no `mr.patched("fast-pack")`: the patch was removed.
    code, runs, summary = check_json(recorded, SOURCE, "--from", str(file))
    assert code == 1
    assert runs["o-wait"]["outcome"] == "patch_removed"
    assert runs["o-wait"]["summary"] == ("patch 'fast-pack' removed while this run took its "
                                         "old branch")
    assert runs["o-wait"]["old_branch_patches"] == ["fast-pack"]
    assert runs["o-done"]["ok"]  # it took the new branch
    assert summary["patches"] == {"fast-pack": {"old_branch_runs": 1}}
    done = check(recorded, SOURCE, "--from", str(file))
    assert "patch 'fast-pack': 1 run still on its old branch" in done.stdout.splitlines()
    # Only new-branch runs: the old branch may go.
    file.write_bytes(to_line(_with_patch(histories["o-wait"], True)))
    out = ok(check(recorded, SOURCE, "--from", str(file)))
    assert ("patch 'fast-pack': no run in flight on its old branch (its old branch may be "
            "removed, as far as these runs tell)") in out.splitlines()


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
    one_line_error(check(recorded, SOURCE, "o-wait", "--redis-url", dead), 3,
                   "cannot reach Redis")
    one_line_error(check(recorded, SOURCE, "--from", str(tmp_path / "none.jsonl")), 2,
                   "cannot read the history file")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(recorded.file.read_bytes().splitlines()[0] + b"\n{\"kind\": \"run\"}\n")
    one_line_error(check(recorded, SOURCE, "--from", str(bad)), 2, f"{bad}:2",
                   "not a run history")
    newer = json.loads(recorded.file.read_bytes().splitlines()[0])
    newer["version"] = 99
    bad.write_text(json.dumps(newer) + "\n")
    one_line_error(check(recorded, SOURCE, "--from", str(bad)), 2, f"{bad}:1")
    one_line_error(procs.cli("replay", "--source", str(SOURCE), "o-wait"), 2, "--check")
    argv = [*_cli_argv(), "--redis-url", procs.url, "replay", "--check", "o-wait"]
    env = {k: v for k, v in procs.env.items() if k != "MARBLES_SOURCE"}
    no_source = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60,
                               stdin=subprocess.DEVNULL)
    one_line_error(no_source, 2, "give --source")
    one_line_error(check(recorded, SOURCE, "--from", str(recorded.file), "o-wait"), 2,
                   "only one of them")
    # A file export refused leaves nothing behind.
    target = tmp_path / "out.jsonl"
    one_line_error(procs.cli("export", "o-wait", "nope", "-o", str(target)), 2, "nope")
    assert not target.exists() and list(tmp_path.glob(".export-*")) == []
