"""The ids the triggers derive (an event's ``ev-<sha>``, a schedule's ``sched:<key>:<ms>``, a
monitor's ``mon.<key>.<n>``) are predictable; nobody else may take one first and have the
trigger adopt a foreign run (issue 16, item 7). Real redis-server, real CLI processes."""

from __future__ import annotations

import json
import logging
import subprocess

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.controller import Controller
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.triggers.events import Events, event_key
from marbles_rq.triggers.schedules import ScheduleDuty, ScheduleRegistry
from tests import trigger_workflows
from tests.procs import REPO_ROOT, Procs

T_SOURCE = REPO_ROOT / "tests" / "trigger_workflows.py"
PROCS_SOURCES = (T_SOURCE,)
assert trigger_workflows.t_on_push  # its workflows and triggers, registered here too
EVENT_INPUT = json.dumps({"key": "k", "source": "gh", "type": "push", "id": "d",
                          "payload": None, "received_at_ms": 1})


def _one_line_exit_2(done: subprocess.CompletedProcess[str], *words: str) -> None:
    shown = f"exit {done.returncode}\nstdout: {done.stdout!r}\nstderr: {done.stderr!r}"
    assert done.returncode == 2, shown
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    for word in words:
        assert word in lines[0], shown


def test_enqueue_refuses_the_ids_of_the_triggers_namespaces(procs: Procs) -> None:
    key = event_key("gh", "delivery-7")
    _one_line_exit_2(procs.cli("enqueue", "t_on_push", "--id", key, "--input", EVENT_INPUT),
                     key, "reserved for event runs")
    _one_line_exit_2(procs.cli("enqueue", "t_launched", "--id", "sched:nightly:1767225600000",
                               "--input", "{}"), "reserved for schedule runs")
    _one_line_exit_2(procs.cli("enqueue", "t_launched", "--id", "mon.t-files.1", "--input",
                               "{}"), "reserved for monitor runs")
    runs = RunStore(open_store(procs.url))
    assert runs.get(key) is None and runs.get("sched:nightly:1767225600000") is None
    # The event, sent afterwards, starts its own run under its id.
    sent = procs.cli("events", "send", "gh", "--id", "delivery-7", "--type", "push")
    assert sent.returncode == 0, sent.stderr
    assert f"run {key} queued (t_on_push)" in sent.stdout, sent.stdout
    view = runs.get(key)
    assert view is not None and view.record.origin == "event"
    # An id that only looks alike (not 32 hex digits) is anybody's.
    done = procs.cli("enqueue", "t_launched", "--id", "ev-mine", "--input", "{}")
    assert done.returncode == 0, done.stderr


def test_an_event_that_finds_a_foreign_run_under_its_id_fails_and_says_so(
        redis_url: str) -> None:
    runs = RunStore(open_store(redis_url))
    key = event_key("gh", "delivery-8")
    # A run under the event's id that the event did not record (written before runs carried
    # their origin, or by code that writes records past `enqueue`'s check).
    foreign = msgspec.structs.replace(
        prepare(RunRequest("t_launched", b'{"x": 1}', "placeholder")), id=key)
    assert runs.record(foreign).created
    events = Events(runs, rq_connection(redis_url))
    sent = events.send("gh", "delivery-8", type="push")
    assert sent.state == "failed", sent
    view = events.get(key)
    assert view is not None and view.state == "failed" and view.run_status is None, view
    assert "did not start" in view.note and "t_launched" in view.note, view
    # The foreign run is left as it was.
    run = runs.get(key)
    assert run is not None and run.record.name == "t_launched" and run.status == "queued"


def test_a_schedule_that_finds_a_foreign_run_under_its_occurrence_id_does_not_call_it_fired(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    reg = ScheduleRegistry()
    mr.schedule(every="1h", workflow="t_launched", input={"n": 1}, key="hij", registry=reg)
    runs = RunStore(open_store(redis_url))
    duty = ScheduleDuty(reg, threaded=False)
    ctl = Controller(runs, rq_connection(redis_url), duties=[duty])
    assert ctl.lead()
    ctl.recover()
    r = runs.client
    secs, micros = r.time()
    due = int(secs) * 1000 + int(micros) // 1000 - 10
    keys = runs.keys
    r.hset(keys.schedule("hij"), "cursor", due)  # as if an hour had passed
    r.zadd(keys.schedule_due(keys.bucket_of("hij")), {"hij": due})
    run_id = f"sched:hij:{due}"
    foreign = msgspec.structs.replace(
        prepare(RunRequest("t_on_push", EVENT_INPUT.encode(), "placeholder")), id=run_id)
    assert runs.record(foreign).created
    with caplog.at_level(logging.INFO, logger="marbles_rq"):
        duty.fire_due(ctl)
    assert duty.stats.fired == 0
    assert f"fired run {run_id}" not in caplog.text
    assert any(rec.levelno == logging.ERROR and run_id in rec.getMessage()
               and "did not start" in rec.getMessage() for rec in caplog.records), caplog.text
    view = runs.get(run_id)
    assert view is not None and view.record.name == "t_on_push" and view.status == "queued"
