"""Compensation with real processes: a real redis-server, real `marbles-rq worker` and
`controller` processes, real CLI processes; the workflows are in tests/comp_workflows.py,
where every step and every undo records what it did in Redis.

* a 5-step run that fails at step 4 runs its 3 undos in reverse, each once, although the
  worker is killed (kill -9, the horse and the worker) while the second undo runs;
* `cancel --compensate` of a waiting run and of a running one (the body stops first; the
  undos run in a new delivery), and a plain cancel that does not compensate;
* an undo that fails after its retries: the others still run, the status says which failed;
* what cannot be an undo (a lambda, a nested function, a step not registered, arguments that
  are not JSON) fails the run with one line; bad CLI and HTTP input is refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from marbles_rq.engine import ops
from marbles_rq.transport.dispatch import rq_connection
from tests.comp_workflows import BLOCKED, DONE, UNDONE
from tests.procs import REPO_ROOT, Observer, Procs, wait_for

PROCS_SOURCES = (REPO_ROOT / "tests" / "comp_workflows.py",)


def enqueue(procs: Procs, name: str, input: Any, run_id: str) -> None:
    done = ops.enqueue(procs.observer.runs, rq_connection(procs.url),
                       ops.RunRequest(name, json.dumps(input).encode(), run_id))
    assert done.created, done


def listed(obs: Observer, key: str) -> list[str]:
    return [v if isinstance(v, str) else v.decode() for v in obs.client.lrange(key, 0, -1)]


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}: {done.stdout!r} {done.stderr!r}"
    return done.stdout


def status_json(procs: Procs, run_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(ok(procs.cli("status", run_id, "--json")))
    return data


def test_a_failed_run_undoes_in_reverse_each_once_across_kill9(procs: Procs,
                                                              tmp_path: Path) -> None:
    worker = procs.worker()
    procs.controller()
    obs = procs.observer
    block = tmp_path / "block"
    block.write_text("held")
    enqueue(procs, "comp_order", {"order": "o1", "block": str(block)}, "o1")
    # The second undo (release stock) says it runs, and waits while the block file exists.
    wait_for(lambda: obs.client.get(BLOCKED + "o1"), timeout=60, what="the blocked undo",
             context=lambda: obs.dump("o1"))
    during = status_json(procs, "o1")
    assert during["status"] == "running" and during["phase"] == "compensating"
    assert [c["status"] for c in during["compensations"]] == ["done", "running", "pending"]
    horse = worker.horse()
    os.kill(horse, signal.SIGKILL)
    worker.kill9()
    block.unlink()
    procs.worker()
    view = obs.wait_status("o1", "failed", timeout=60)
    assert listed(obs, DONE + "o1") == ["charge", "reserve stock", "book tuesday",
                                        "ship (failing)"]
    assert listed(obs, UNDONE + "o1") == ["unbook tuesday", "release stock",
                                          "refund o1 30 receipt-o1"]
    assert view.error is not None and view.error.type == "RuntimeError"
    assert view.attempt == 2, obs.dump("o1")  # one redelivery: the kill
    data = status_json(procs, "o1")
    assert data["phase"] is None
    assert [(c["name"], c["status"]) for c in data["compensations"]] == [
        ("comp_unbook", "done"), ("comp_release", "done"), ("comp_refund", "done")]
    assert all(c["at"] for c in data["compensations"])
    text = ok(procs.cli("status", "o1"))
    assert "  compensation comp_unbook  done" in text
    assert "  error RuntimeError: no courier for o1" in text
    finals = [e for e in obs.events("o1") if e.type == "final"]
    assert len(finals) == 1 and finals[0].data["status"] == "failed"


def test_an_undo_that_fails_is_recorded_and_the_rest_still_run(procs: Procs) -> None:
    procs.worker()
    obs = procs.observer
    enqueue(procs, "comp_broken_undo", None, "broken")
    obs.wait_status("broken", "failed", timeout=60)
    # comp_always_fails has retries=1: two tries, then the next undo runs.
    assert listed(obs, UNDONE + "broken") == ["release c", "tried b", "tried b", "release a"]
    data = status_json(procs, "broken")
    assert [(c["name"], c["status"]) for c in data["compensations"]] == [
        ("comp_release", "done"), ("comp_always_fails", "failed"), ("comp_release", "done")]
    assert data["compensations"][1]["error"] == "ValueError: cannot undo b"
    assert data["compensations"][1]["attempts"] == 2
    assert data["error"]["message"] == "the body gives up"
    text = ok(procs.cli("status", "broken"))
    assert "  compensation comp_always_fails  failed" in text
    assert "ValueError: cannot undo b" in text


def test_cancel_compensate_of_a_waiting_run(procs: Procs) -> None:
    procs.worker()
    obs = procs.observer
    enqueue(procs, "comp_waiter", None, "waiter")
    obs.wait_status("waiter", "waiting", timeout=60)
    out = ok(procs.cli("cancel", "waiter", "--compensate"))
    assert "compensating" in out
    obs.wait_status("waiter", "cancelled", timeout=60)
    assert listed(obs, UNDONE + "waiter") == ["release w"]
    assert listed(obs, DONE + "waiter") == ["reserve w"]  # the body never went on
    data = status_json(procs, "waiter")
    assert [(c["name"], c["status"]) for c in data["compensations"]] == [
        ("comp_release", "done")]
    # Cancelled already: a second cancel does nothing.
    assert "already finished" in ok(procs.cli("cancel", "waiter", "--compensate"))


def test_cancel_compensate_of_a_run_compensating_after_its_failure(procs: Procs) -> None:
    procs.worker()
    obs = procs.observer
    enqueue(procs, "comp_parked_undo", None, "parked")
    view = obs.wait_status("parked", "waiting", timeout=60)  # its undo waits for its retry
    assert status_json(procs, "parked")["phase"] == "compensating"
    # The undos are under way already and the run ends failed: said so, nothing woken.
    out = ok(procs.cli("cancel", "parked", "--compensate"))
    assert out.strip() == "run parked is already compensating; it ends failed", out
    after = obs.view("parked")
    assert after is not None and after.status == "waiting", obs.dump("parked")
    assert after.attempt == view.attempt and after.wait_reason == "retry"
    assert listed(obs, UNDONE + "parked") == ["tried p"]
    ok(procs.cli("cancel", "parked"))  # a plain cancel still stops the compensations
    obs.wait_status("parked", "cancelled", timeout=30)


def test_fail_of_an_undo_paused_on_its_failure_runs_the_rest(procs: Procs) -> None:
    procs.worker()
    obs = procs.observer
    enqueue(procs, "comp_pausing_undo", None, "paused-undo")
    view = obs.wait_status("paused-undo", "waiting", timeout=60)
    assert view.wait_reason == "failed_step", obs.dump("paused-undo")
    out = ok(procs.cli("fail", "paused-undo"))
    # No body is left to handle it: the undo is recorded failed and the others run.
    assert "it is recorded failed; the other undos run, then the run ends" in out, out
    obs.wait_status("paused-undo", "failed", timeout=60)
    assert listed(obs, UNDONE + "paused-undo") == ["tried r", "tried r", "release q"]
    data = status_json(procs, "paused-undo")
    assert [(c["name"], c["status"]) for c in data["compensations"]] == [
        ("comp_always_fails", "failed"), ("comp_release", "done")]


def test_a_plain_cancel_does_not_compensate(procs: Procs) -> None:
    procs.worker()
    obs = procs.observer
    enqueue(procs, "comp_waiter", None, "plain")
    obs.wait_status("plain", "waiting", timeout=60)
    ok(procs.cli("cancel", "plain"))
    obs.wait_status("plain", "cancelled", timeout=30)
    assert listed(obs, UNDONE + "plain") == []
    data = status_json(procs, "plain")
    assert [c["status"] for c in data["compensations"]] == ["not_run"]


def test_cancel_compensate_of_a_running_run_stops_the_body_first(procs: Procs,
                                                                 tmp_path: Path) -> None:
    procs.worker()
    procs.controller()
    obs = procs.observer
    stop = tmp_path / "stop"
    enqueue(procs, "comp_long", str(stop), "long")
    wait_for(lambda: "slow started" in listed(obs, DONE + "long") or None, timeout=60,
             what="the slow step", context=lambda: obs.dump("long"))
    out = ok(procs.cli("cancel", "long", "--compensate"))
    assert "cancel requested" in out
    obs.wait_status("long", "cancelled", timeout=60)
    assert listed(obs, UNDONE + "long") == ["release l"]
    assert listed(obs, DONE + "long") == ["reserve l", "slow started"]  # stopped mid-step
    data = status_json(procs, "long")
    assert [(c["name"], c["status"]) for c in data["compensations"]] == [
        ("comp_release", "done")]
    types = [e.type for e in obs.events("long")]
    assert types.count("final") == 1 and "compensating" in types


@pytest.mark.parametrize(("what", "message"), [
    ("lambda", "a lambda cannot be an undo"),
    ("nested", "is not a module-level function"),
    ("json", "its arguments are not JSON"),
    ("unregistered", "'comp_nowhere' is not a registered step"),
])
def test_what_cannot_be_an_undo_fails_the_run_with_one_line(procs: Procs, what: str,
                                                            message: str) -> None:
    procs.worker()
    obs = procs.observer
    enqueue(procs, "comp_bad", what, f"bad-{what}")
    view = obs.wait_status(f"bad-{what}", "failed", timeout=60)
    assert view.error is not None and view.error.type == "CompensationError"
    assert message in view.error.message and "\n" not in view.error.message
    assert status_json(procs, f"bad-{what}")["compensations"] == []


def test_bad_cancel_input_is_refused(procs: Procs) -> None:
    done = procs.cli("cancel", "--status", "waiting", "--compensate")
    assert done.returncode == 2 and "--compensate takes one RUN_ID" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = procs.cli("cancel", "nosuchrun", "--compensate")
    assert done.returncode == 2 and "no run with id 'nosuchrun'" in done.stderr, done


@pytest.mark.parametrize("where", ["redis_server", "cluster_url"])
def test_every_compensation_script_on_one_slot(where: str, request: pytest.FixtureRequest
                                               ) -> None:
    """The scripts that ask for, hand over and take up a compensation each touch the keys of
    one slot (a 3-master cluster refuses a script whose keys span slots); a run whose
    execution vanished after a cancel that asked for compensation is redelivered (not
    settled cancelled), and its next start finds the phase marker in its ledger."""
    from marbles_rq.engine.runs import RunStore
    from marbles_rq.engine.undo_refs import MARKER_KEY
    from marbles_rq.store import open_store
    from tests import comp_workflows  # noqa: F401  (registers the workflows)

    fixture = request.getfixturevalue(where)
    url = fixture if isinstance(fixture, str) else fixture.url
    runs = RunStore(open_store(url))
    # Never started: nothing to undo, cancelled at once.
    runs.record(ops.prepare(ops.RunRequest("comp_waiter", b"null", "cs-0")))
    assert runs.cancel_compensate("cs-0")[0] == "cancelled"
    # Running: flagged; its settle as cancelled is refused; it is handed over.
    runs.record(ops.prepare(ops.RunRequest("comp_waiter", b"null", "cs-1")))
    started = runs.start("cs-1", 1, ttl_ms=30_000, worker="w")
    assert started.status == "ok" and started.execution is not None
    assert runs.cancel_compensate("cs-1")[0] == "requested"
    assert runs.settle(started.execution, "cancelled") == "compensate"
    status, attempt, _queue = runs.hand_over_compensation(started.execution)
    assert (status, attempt) == ("ok", 2)
    again = runs.start("cs-1", 2, ttl_ms=30_000, worker="w")
    assert again.execution is not None and MARKER_KEY in again.execution.ledger
    assert runs.settle(again.execution, "cancelled") == "ok"
    # Vanished after the cancel: the reaper redelivers it, its next start takes the marker.
    runs.record(ops.prepare(ops.RunRequest("comp_waiter", b"null", "cs-2")))
    gone = runs.start("cs-2", 1, ttl_ms=100, worker="w")
    assert gone.status == "ok"
    assert runs.cancel_compensate("cs-2")[0] == "requested"
    keys = runs.keys.run_keys("cs-2")

    def reaped() -> Any:
        reply = runs.scripts.reap_run(keys=keys, run_id="cs-2", ctl_epoch=1, grace_ms=0,
                                      final_cancel=b"{}", final_gave_up=b"{}")
        return reply if reply.status != "not_expired" else None

    reply = wait_for(reaped, timeout=30, what="the lease of cs-2 to expire")
    assert reply.status == "redelivered", reply
    taken = runs.start("cs-2", int(reply.values[0]), ttl_ms=30_000, worker="w")
    assert taken.status == "ok" and taken.execution is not None
    assert MARKER_KEY in taken.execution.ledger
    view = runs.get("cs-2")
    assert view is not None and not view.cancel_requested
