"""Schedules, monitors and the controller against bad declarations and broken state, as a
hostile review found them: one bad thing costs only itself, and the controller never exits
on it. Real redis-server, real controller processes."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.triggers.monitors import Launch, MonitorDef, Monitors, roll_monitor
from tests.procs import Procs, wait_for
from tests.redis_procs import RedisServer


@pytest.fixture
def redis_url_server(redis_server: RedisServer) -> str:
    return redis_server.url


def _procs(url: str, tmp_path: Path, body: str) -> Procs:
    source = tmp_path / "flows.py"
    source.write_text("import marbles_rq as mr\n" + body)
    return Procs(url, tmp_path / "procs", sources=(source,))


@pytest.fixture
def cleanup() -> Iterator[list[Procs]]:
    made: list[Procs] = []
    yield made
    for p in made:
        p.stop_all()
        print(p.report())


def _fired(procs: Procs, key: str) -> int:
    return sum(1 for v in procs.observer.runs.list_runs(limit=1000)
               if v.record.id.startswith(f"sched:{key}:"))


def test_a_schedule_whose_input_does_not_fit_its_workflow_costs_only_itself(
        redis_url_server: str, tmp_path: Path, cleanup: list[Procs]) -> None:
    procs = _procs(redis_url_server, tmp_path, '''
@mr.workflow()
def w(ctx, inp: dict | None) -> None:
    pass

mr.schedule(every="1s", workflow="w", input=[1], key="badinput")
mr.schedule(every="1s", workflow="w", input={"n": 1}, key="fine")
''')
    cleanup.append(procs)
    ctl = procs.controller()
    procs.worker()
    wait_for(lambda: _fired(procs, "fine") >= 2 or None, timeout=30, what="'fine' to fire")
    assert ctl.alive()
    ctl.wait_log("schedule badinput: input does not match workflow 'w'")
    assert _fired(procs, "badinput") == 0
    assert "Traceback" not in ctl.text()


def test_one_broken_schedule_state_does_not_stop_the_others(
        redis_url_server: str, tmp_path: Path, cleanup: list[Procs]) -> None:
    procs = _procs(redis_url_server, tmp_path, '''
@mr.workflow()
def w(ctx) -> None:
    pass

mr.schedule(every="1s", workflow="w", key="healthy")
mr.schedule(every="1s", workflow="w", key="broken")
''')
    cleanup.append(procs)
    ctl = procs.controller()
    procs.worker()
    wait_for(lambda: _fired(procs, "broken") >= 1 or None, timeout=30, what="'broken' fires")
    client = redis.Redis.from_url(redis_url_server)
    keys = procs.observer.runs.keys
    client.delete(keys.schedule("broken"))
    client.rpush(keys.schedule("broken"), "not a hash")
    before = _fired(procs, "healthy")
    wait_for(lambda: _fired(procs, "healthy") >= before + 3 or None, timeout=30,
             what="'healthy' to keep firing")
    shown = procs.cli("schedules", "--json")
    assert shown.returncode == 0, shown.stderr
    statuses = {s["key"]: s["status"] for s in json.loads(shown.stdout)}
    assert statuses["broken"] == "unreadable" and statuses["healthy"] == "active"
    assert ctl.alive() and "Traceback" not in ctl.text()


def test_a_monitor_whose_state_was_reset_still_starts_its_new_launches(
        redis_url: str, tmp_path: Path) -> None:
    from marbles_rq.engine.authoring import REGISTRY, workflow

    if "t_reset_target" not in REGISTRY.workflows:
        @workflow("t_reset_target")
        def t_reset_target(ctx: object, inp: dict[str, list[str]]) -> None:
            return None

    root = tmp_path / "watched"
    root.mkdir()
    (root / "a.txt").write_text("a")
    monitors = Monitors()

    def handler(change: object) -> Launch:
        return Launch("t_reset_target", {"added": sorted(change.added)})  # type: ignore

    monitors.add(MonitorDef("m-reset", "*.txt", "files", handler, 60.0, root), True)
    runs = RunStore(open_store(redis_url))
    rq = rq_connection(redis_url)
    first = roll_monitor(runs, rq, "m-reset", monitors=monitors)
    assert (first.status, first.run_id) == ("launched", "mon.m-reset.1")
    runs.client.delete(runs.keys.monitor("m-reset"))  # its state is lost
    (root / "b.txt").write_text("b")
    again = roll_monitor(runs, rq, "m-reset", monitors=monitors)
    assert again.status == "launched" and again.run_id is not None
    assert again.run_id.startswith("mon.m-reset.1.")  # not the other launch's run
    view = runs.get(again.run_id)
    assert view is not None
    assert json.loads(bytes(view.record.input)) == {"added": ["a.txt", "b.txt"]}


def test_a_controller_with_a_hung_monitor_handler_stops_on_sigterm(
        redis_url_server: str, tmp_path: Path, cleanup: list[Procs]) -> None:
    watched = tmp_path / "watched"
    watched.mkdir()
    (watched / "a.txt").write_text("a")
    marker = tmp_path / "in-handler"
    procs = _procs(redis_url_server, tmp_path, f'''
import time

@mr.monitor("*.txt", root={str(watched)!r}, interval_s=1, key="hangs")
def hangs(change):
    open({str(marker)!r}, "w").close()
    time.sleep(3600)
''')
    cleanup.append(procs)
    ctl = procs.controller()
    wait_for(lambda: marker.exists() or None, timeout=20, what="the handler to be running")
    ctl.signal(signal.SIGTERM)
    assert ctl.wait_exit(15) == 0
    assert "released the controller lease" in ctl.text()
