"""A replay writes no output again, and a run's attempts count only redeliveries: issue 16,
item 9. A body that writes and then waits, crashes or is killed replays from the top; the
lines it wrote before must not appear again, and `status`, `runs`, `watch` and the
dashboard's list must show resumptions (wakes after a park) apart from attempts.

The first tests execute in this process against a real Redis (as tests/test_replay.py does);
the last two use real workers, a real controller, the real CLI and a real SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from typing import Any

import pytest

from marbles_rq.controller import Controller
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.execute import execute
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.output_lines import format_event
from marbles_rq.engine.paging import RunPager
from marbles_rq.engine.runs import OutputEvent, RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from tests import replay_output_workflows as wf
from tests.procs import REPO_ROOT, Procs, pid_alive, wait_for
from tests.web_stack import start_web

PROCS_SOURCES = (REPO_ROOT / "tests" / "replay_output_workflows.py",)


def _runs(url: str) -> RunStore:
    return RunStore(open_store(url))


def _record(runs: RunStore, name: str, run_id: str) -> None:
    assert runs.record(prepare(RunRequest(name, b"null", run_id))).created


def _execute(runs: RunStore, run_id: str, attempt: int, worker: str = "w") -> str:
    return execute(runs, REGISTRY, run_id, attempt, worker=worker, lease_ms=60_000,
                   hard_exit=False)


def _texts(events: list[OutputEvent]) -> Counter[str]:
    """How often each output line (stream.write text, log message) is in the journal."""
    out: Counter[str] = Counter()
    for e in events:
        if e.type == "output":
            out[e.data.get("text")] += 1
        elif e.type == "log":
            out[e.data.get("message")] += 1
    return out


def test_a_crash_between_a_write_and_the_next_commit_does_not_repeat_the_write(
        redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "ro_crash", "roc-1")
    wf.CRASH_ONCE.append("roc-1")
    with pytest.raises(wf.Crash):
        _execute(runs, "roc-1", 1, worker="w1")
    # What the worker parent and the controller do when a horse dies.
    assert runs.abandon("roc-1", 1, "w1") == "ok"
    ctl = Controller(runs, rq_connection(redis_url))
    assert ctl.lead() and ctl.reap() == 1
    assert _execute(runs, "roc-1", 2, worker="w2") == "succeeded"
    events = runs.output("roc-1")
    assert _texts(events) == {"written before the crash": 1, "written after the step": 1}
    view = runs.get("roc-1")
    assert view is not None
    assert (view.attempt, view.resumptions, view.delivery) == (2, 0, 2)
    started = [e.data for e in events if e.type == "attempt_started"]
    assert [(d["attempt"], d["kind"]) for d in started] == [(1, "first"), (2, "redelivery")]


def test_a_retried_step_writes_its_lines_once_per_try(redis_url: str) -> None:
    """Output of a try that really ran again is new output, not a replay."""
    runs = _runs(redis_url)
    _record(runs, "ro_retry", "ror-1")
    assert _execute(runs, "ror-1", 1) == "succeeded"
    assert _texts(runs.output("ror-1")) == {"try 1 begins": 1, "try 2 begins": 1,
                                            "try 3 begins": 1}


def test_parallel_branches_replayed_after_a_wait_write_nothing_again(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "ro_parallel", "rop-1")
    assert _execute(runs, "rop-1", 1) == "parked"
    waits = runs.waits()
    woken = wait_for(lambda: (lambda w: w if w[0] == "woken" else None)(
        waits.wake("rop-1", "timer")), timeout=10, what="the timer to come due")
    assert _execute(runs, "rop-1", woken[1]) == "succeeded"
    assert _texts(runs.output("rop-1")) == {"branch a": 1, "branch b": 1}
    view = runs.get("rop-1")
    assert view is not None and (view.attempt, view.resumptions) == (1, 1)


def test_a_replayed_write_is_still_fenced(redis_url: str) -> None:
    """A position already written answers replayed only to its own run's live execution:
    a stale one (redelivered meanwhile) is refused as before, whatever it writes."""
    runs = _runs(redis_url)
    _record(runs, "ro_crash", "rof-1")
    first = runs.start("rof-1", 1, ttl_ms=60_000, worker="w1").execution
    assert first is not None
    assert runs.write(first, "output", b'{"text":"x"}', position=("f", 0)) == "ok"
    assert runs.write(first, "output", b'{"text":"x"}', position=("f", 0)) == "replayed"
    assert runs.abandon("rof-1", 1, "w1") == "ok"
    ctl = Controller(runs, rq_connection(redis_url))
    assert ctl.lead() and ctl.reap() == 1
    assert runs.write(first, "output", b'{"text":"y"}', position=("f", 1)) == "stale"
    assert runs.write(first, "output", b'{"text":"x"}', position=("f", 0)) == "stale"
    second = runs.start("rof-1", 2, ttl_ms=60_000, worker="w2").execution
    assert second is not None and second.epoch > first.epoch
    assert runs.write(second, "output", b'{"text":"x"}', position=("f", 0)) == "replayed"
    assert runs.write(second, "output", b'{"text":"y"}', position=("f", 1)) == "ok"
    assert _texts(runs.output("rof-1")) == {"x": 1, "y": 1}


# --------------------------------------------------------------------------------------------
# real processes


def _cli_json(procs: Procs, *args: str) -> Any:
    done = procs.cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _waiting_on(procs: Procs, run_id: str, key: str) -> None:
    def parked() -> bool:
        view = procs.observer.view(run_id)
        return view is not None and view.status == "waiting" and (
            view.wait_for or {}).get("questions") == [key]

    wait_for(parked, timeout=60, what=f"run {run_id} waiting on question {key}",
             context=procs.report)


def test_a_run_answered_three_times_shows_each_line_once_and_attempt_1(procs: Procs) -> None:
    procs.worker()
    obs, run_id = procs.observer, "roa-1"
    procs.enqueue("ro_asks", None, run_id)
    for key in ("q0", "q1", "q2"):
        _waiting_on(procs, run_id, key)
        done = procs.cli("answer", run_id, key, f"answer {key}")
        assert done.returncode == 0, done.stderr
    obs.wait_final(run_id)

    events = obs.events(run_id)
    assert _texts(events) == {
        "first line": 1, "a log line before any wait": 1, "after the first answer": 1,
        "in the step, before its question": 1, "after the second answer": 1,
        "after the third answer": 1}, obs.dump(run_id)

    data = _cli_json(procs, "status", run_id)
    assert data["status"] == "succeeded"
    assert data["result"] == ["answer q0", "answer q1", "answer q2"]
    assert (data["attempt"], data["resumptions"], data["delivery"]) == (1, 3, 4)
    text = procs.cli("status", run_id).stdout
    assert "succeeded  attempt 1  resumed 3 times" in text, text
    row = next(r for r in _cli_json(procs, "runs") if r["id"] == run_id)
    assert (row["attempt"], row["resumptions"]) == (1, 3)
    page = RunPager(obs.runs).page(limit=10)
    dash = next(r for r in page.rows if r.id == run_id)
    assert (dash.attempt, dash.resumptions) == (1, 3)
    web = start_web(procs)
    with web.client() as anon:  # reads are open on loopback
        html = anon.get(f"/runs/{run_id}").text
        listed = anon.get("/runs").text
    assert "<dt>Attempt</dt><dd>1</dd>" in html and "<dt>Resumed</dt><dd>3 times</dd>" in html
    assert '<td data-label="Attempt" class="num">1</td>' in listed, listed
    assert '<td data-label="Resumed" class="num">3</td>' in listed, listed

    # watch: four executions, each of attempt 1; the three after a wait are resumptions.
    started = [e for e in events if e.type == "attempt_started"]
    assert [(e.data["attempt"], e.data["resumptions"], e.data["kind"]) for e in started] == [
        (1, 0, "first"), (1, 1, "resumption"), (1, 2, "resumption"), (1, 3, "resumption")]
    lines = [format_event(e) for e in started]
    assert all(" attempt 1 " in ln for ln in lines) and not any(
        f"attempt {n}" in ln for ln in lines for n in (2, 3, 4)), lines
    assert "attempt 1 continues on " in lines[-1] and "(resumption 3, epoch" in lines[-1], lines
    watched = procs.cli("watch", run_id, "--no-follow")
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.count("first line") == 1, watched.stdout
    assert "attempt 4" not in watched.stdout, watched.stdout


def test_a_sigkilled_horse_shows_attempt_2_and_its_line_before_the_kill_once(
        procs: Procs) -> None:
    procs.start(workers=1)
    obs, run_id = procs.observer, "rok-1"
    procs.enqueue("ro_kill", None, run_id)
    blocked = obs.wait_list(wf.BLOCKED_KEY, lambda items: len(items) >= 1,
                            what="the step to block in its first delivery")
    pid = json.loads(blocked[0])["pid"]
    # "before the step" is written; the step's commit is not (it blocks): kill between them.
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), timeout=10, what=f"horse {pid} to die")
    obs.wait_final(run_id, timeout=90)

    events = obs.events(run_id)
    # The workflow's own line is written once. The step ran twice (try 1 was killed), and
    # a line written inside it is output of each try (README: "Output and replay").
    assert _texts(events) == {"before the step": 1, "inside the step": 2,
                              "after the step": 1}, obs.dump(run_id)
    data = _cli_json(procs, "status", run_id)
    assert data["status"] == "succeeded"
    assert (data["attempt"], data["resumptions"], data["delivery"]) == (2, 0, 2)
    assert "succeeded  attempt 2\n" in procs.cli("status", run_id).stdout
    started = [e.data for e in events if e.type == "attempt_started"]
    assert [(d["attempt"], d["kind"]) for d in started] == [(1, "first"), (2, "redelivery")]
    watched = procs.cli("watch", run_id, "--no-follow").stdout
    assert "attempt 2 started on " in watched and "(redelivery, epoch" in watched, watched


def test_old_events_without_counts_still_read() -> None:
    """An attempt_started event written before attempts and resumptions were counted apart
    (a run in flight across the upgrade) says which delivery started."""
    ev = OutputEvent(f"{int(time.time() * 1000)}-0", "attempt_started", 3,
                     {"epoch": 3, "worker": "w"})
    assert format_event(ev).endswith("d3 delivery 3 started on w (epoch 3)")
