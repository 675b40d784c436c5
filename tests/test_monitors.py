"""Monitors against a real redis-server, real `marbles-rq` controller and worker processes,
and a real HTTP server on 127.0.0.1: the first poll is a change, a handler that raises sees
the same change again, a pending launch survives a kill -9 of the controller and starts once,
an HTTP monitor fetches only from its allow-list and hashes JSON bodies stably."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis

import marbles_rq as mr
from marbles_rq.engine.authoring import DefinitionError
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.store.keys import Keyspace
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.triggers.monitors import (
    Launch,
    MonitorDef,
    Monitors,
    list_monitors,
    monitor_key,
    roll_monitor,
)
from tests.procs import CHAIN_SOURCE, KILL_SOURCE, REPO_ROOT, Procs, wait_for
from tests.redis_procs import free_port
from tests.trigger_workflows import HANDLER_KEY, LAUNCHED_KEY

T_SOURCE = REPO_ROOT / "tests" / "trigger_workflows.py"
KEYS = Keyspace()


PROCS_SOURCES = (CHAIN_SOURCE, KILL_SOURCE, T_SOURCE)


def _client(procs: Procs) -> redis.Redis:
    return redis.Redis.from_url(procs.url, decode_responses=True)


def _list(procs: Procs, key: str) -> list[Any]:
    return [json.loads(x) for x in _client(procs).lrange(key, 0, -1)]


def _state(procs: Procs, key: str) -> dict[str, str]:
    return dict(_client(procs).hgetall(KEYS.monitor(key)))


def _polls(procs: Procs, key: str, more: int, after: int | None = None) -> None:
    """Wait until the monitor has been polled `more` more times (its last poll moved on)."""
    seen: list[int] = []
    start = after if after is not None else int(_state(procs, key).get("last_poll_ms", 0))

    def moved() -> bool:
        now = int(_state(procs, key).get("last_poll_ms", 0))
        if now > start and (not seen or now != seen[-1]):
            seen.append(now)
        return len(seen) >= more

    wait_for(moved, timeout=30, what=f"{more} more polls of monitor {key}", interval=0.02,
             context=procs.report)


def test_a_handler_that_raises_sees_the_same_change_at_the_next_poll(
        procs: Procs, tmp_path: Path) -> None:
    root = tmp_path / "watched"
    root.mkdir()
    (root / "a.txt").write_text("one")
    (root / "ignored.csv").write_text("not matched")
    (root / "FAIL").write_text("")
    procs.env.update(T_MON_ROOT=str(root), T_MON_INTERVAL="0.2")
    procs.start(workers=1)

    wait_for(lambda: len(_list(procs, HANDLER_KEY)) >= 3, timeout=30,
             what="three handler calls", context=procs.report)
    calls = _list(procs, HANDLER_KEY)
    first = {"added": ["a.txt"], "modified": [], "removed": []}
    assert calls[:3] == [first] * 3  # the first poll is a change, and it comes back
    state = _state(procs, "t-files")
    assert "obs" not in state and "pending" not in state
    assert "RuntimeError: the handler fails while FAIL exists" in state["last_error"]
    assert _list(procs, LAUNCHED_KEY) == []

    (root / "FAIL").unlink()
    procs.observer.wait_status("mon.t-files.1", "succeeded", timeout=60)
    assert _list(procs, HANDLER_KEY)[-1] == first
    assert _list(procs, LAUNCHED_KEY) == [
        {"run": "mon.t-files.1", "input": {"added": ["a.txt"], "modified": []}}]

    # No change: polled, but the handler is not called.
    handled = len(_list(procs, HANDLER_KEY))
    _polls(procs, "t-files", 3)
    assert len(_list(procs, HANDLER_KEY)) == handled

    (root / "a.txt").write_text("two")
    (root / "b.txt").write_text("new")
    procs.observer.wait_status("mon.t-files.2", "succeeded", timeout=60)
    assert _list(procs, HANDLER_KEY)[handled:] == [
        {"added": ["b.txt"], "modified": ["a.txt"], "removed": []}]
    (root / "b.txt").unlink()
    procs.observer.wait_status("mon.t-files.3", "succeeded", timeout=60)
    assert _list(procs, HANDLER_KEY)[-1] == {"added": [], "modified": [], "removed": ["b.txt"]}
    assert [x["run"] for x in _list(procs, LAUNCHED_KEY)] == [
        "mon.t-files.1", "mon.t-files.2", "mon.t-files.3"]


def test_a_pending_launch_survives_a_controller_kill9_and_starts_once(
        procs: Procs, tmp_path: Path) -> None:
    root = tmp_path / "watched"
    root.mkdir()
    (root / "a.txt").write_text("one")
    procs.env.update(T_MON_ROOT=str(root), T_MON_INTERVAL="0.2")
    client = _client(procs)
    # The launch's run cannot be recorded while its key holds a string (WRONGTYPE): the
    # controller records the observation with the launch pending, and fails to start it.
    client.set(KEYS.run("mon.t-files.1"), "in the way")
    worker = procs.worker()
    first = procs.controller(lease_ms=2000)

    wait_for(lambda: _state(procs, "t-files").get("pending_run") == "mon.t-files.1",
             timeout=30, what="the launch to be pending", context=procs.report)
    first.wait_log("starting run mon.t-files.1 failed", count=2)  # handed out again, failed
    first.kill9()
    state = _state(procs, "t-files")
    assert state["pending_run"] == "mon.t-files.1" and json.loads(state["obs"]) == {
        "files": {"a.txt": json.loads(state["obs"])["files"]["a.txt"]}}
    assert json.loads(state["pending"])["workflow"] == "t_launched"
    assert len(_list(procs, HANDLER_KEY)) == 1

    client.delete(KEYS.run("mon.t-files.1"))
    second = procs.controller(lease_ms=2000)
    procs.observer.wait_status("mon.t-files.1", "succeeded", timeout=60)
    wait_for(lambda: "pending_run" not in _state(procs, "t-files"), timeout=30,
             what="the launch to be acknowledged", context=procs.report)
    _polls(procs, "t-files", 3)
    assert [x["run"] for x in _list(procs, LAUNCHED_KEY)] == ["mon.t-files.1"]
    assert len(_list(procs, HANDLER_KEY)) == 1  # the change was handled once, not again
    assert "run mon.t-files.1 started (t_launched)" in second.text()
    assert worker.alive()


def test_a_launch_whose_target_is_not_registered_fails_one_poll_and_is_dropped(
        procs: Procs, tmp_path: Path) -> None:
    root = tmp_path / "watched"
    root.mkdir()
    (root / "a.txt").write_text("one")
    procs.env.update(T_MON_ROOT=str(root), T_MON_INTERVAL="0.2", T_MON_TARGET="gone")
    ctl = procs.controller()
    ctl.wait_log("launch target 'gone' cannot start")
    _polls(procs, "t-files", 3)
    state = _state(procs, "t-files")
    assert "pending_run" not in state and "a.txt" in json.loads(state["obs"])["files"]
    assert ctl.text().count("launch target 'gone' cannot start") == 1
    assert RunStore(open_store(procs.url)).get("mon.t-files.1") is None


class _Site:
    """A tiny HTTP server on 127.0.0.1: /data serves `body`; /redirect sends the client to
    http://localhost:<port>/secret. Every requested path is recorded."""

    def __init__(self) -> None:
        site = self
        self.body = b'{"a": 1, "b": [1, 2]}'
        self.paths: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                site.paths.append(self.path)
                if self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", f"http://localhost:{site.port}/secret")
                    self.end_headers()
                    return
                body = site.body if self.path == "/data" else b"secret"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def site() -> Iterator[_Site]:
    s = _Site()
    try:
        yield s
    finally:
        s.close()


def test_an_http_monitor_refuses_a_host_outside_its_allow_list(
        procs: Procs, site: _Site) -> None:
    with pytest.raises(DefinitionError, match=r"host '127\.0\.0\.1' is not in its allow_hosts"):
        mr.monitor(f"http://127.0.0.1:{site.port}/data", allow_hosts=["localhost"])
    with pytest.raises(DefinitionError, match="needs allow_hosts"):
        mr.monitor(f"http://127.0.0.1:{site.port}/data")

    # Declared for 127.0.0.1, redirected to localhost: refused before any request is sent.
    procs.env.update(T_MON_URL=f"http://127.0.0.1:{site.port}/redirect",
                     T_MON_ALLOW="127.0.0.1", T_MON_INTERVAL="0.2")
    ctl = procs.controller()
    ctl.wait_log("poll failed: HostNotAllowedError: host 'localhost' is not in the monitor's "
                 "allow_hosts ['127.0.0.1']", count=2)
    assert "/secret" not in site.paths and site.paths.count("/redirect") >= 2
    assert _list(procs, HANDLER_KEY) == []
    state = _state(procs, "t-http")
    assert "HostNotAllowedError" in state["last_error"] and "obs" not in state


def test_an_http_monitor_hashes_stable_json_and_fires_on_real_changes(
        procs: Procs, site: _Site) -> None:
    procs.env.update(T_MON_URL=f"http://127.0.0.1:{site.port}/data",
                     T_MON_ALLOW="127.0.0.1", T_MON_INTERVAL="0.2")
    procs.controller()
    wait_for(lambda: len(_list(procs, HANDLER_KEY)) == 1, timeout=30,
             what="the first poll's change", context=procs.report)
    [first] = _list(procs, HANDLER_KEY)
    assert first["previous"] is None and first["status"] == 200

    site.body = b'{ "b": [1, 2],\n  "a": 1 }'  # the same JSON, other key order and spacing
    requests = len(site.paths)
    wait_for(lambda: len(site.paths) >= requests + 3, timeout=30, what="three more polls")
    assert len(_list(procs, HANDLER_KEY)) == 1

    site.body = b'{"a": 2, "b": [1, 2]}'
    wait_for(lambda: len(_list(procs, HANDLER_KEY)) == 2, timeout=30,
             what="the changed body's call", context=procs.report)
    second = _list(procs, HANDLER_KEY)[1]
    assert second["previous"] == first["current"] and second["current"] != first["current"]

    site.body = b"plain text, not JSON"
    wait_for(lambda: len(_list(procs, HANDLER_KEY)) == 3, timeout=30,
             what="the text body's call", context=procs.report)


def test_roll_and_list_a_monitor_from_python(redis_url: str, tmp_path: Path) -> None:
    """The API under `marbles-rq roll` and `marbles-rq list`: one poll now, in this process."""
    root = tmp_path / "watched"
    root.mkdir()
    (root / "x.txt").write_text("x")
    seen: list[Any] = []

    def handler(change: Any) -> Launch | None:
        seen.append(change)
        return Launch("t_launched", {"n": len(seen)})

    monitors = Monitors()
    monitors.add(MonitorDef("m-roll", "*.txt", "files", handler, 60.0, root), True)
    runs = RunStore(open_store(redis_url))
    rq = rq_connection(redis_url)

    [before] = list_monitors(runs.store, monitors)
    assert (before.key, before.kind, before.interval_s) == ("m-roll", "files", 60.0)
    assert before.next_due_ms is None and before.last_change_ms is None

    out = roll_monitor(runs, rq, "m-roll", monitors=monitors)
    assert (out.status, out.run_id) == ("launched", "mon.m-roll.1")
    view = runs.get("mon.m-roll.1")
    assert view is not None and view.record.name == "t_launched"
    assert roll_monitor(runs, rq, "m-roll", monitors=monitors).status == "unchanged"
    assert len(seen) == 1

    [after] = list_monitors(runs.store, monitors)
    assert after.last_change_ms is not None and after.next_due_ms is not None
    assert after.next_due_ms >= after.last_change_ms + 60_000 - 1000
    assert after.pending_run == "" and after.to_json()["last_error"] is None
    assert monitor_key("https://api.example.com/status") == "https-api-example-com-status-" + \
        __import__("hashlib").sha256(b"https://api.example.com/status").hexdigest()[:6]


def test_a_monitor_whose_state_key_is_broken_costs_only_itself(
        procs: Procs, tmp_path: Path) -> None:
    from marbles_rq.triggers.events import Events

    root = tmp_path / "watched"
    root.mkdir()
    (root / "a.txt").write_text("one")
    procs.env.update(T_MON_ROOT=str(root), T_MON_INTERVAL="0.2")
    _client(procs).set(KEYS.monitor("t-files"), "not a hash")
    events = Events(RunStore(open_store(procs.url)))
    record, trigger = events.prepare("gh", "after-broken-monitor", type="push")
    assert events.journal(record, trigger).created

    procs.start(workers=1)
    procs.observer.wait_status(record.id, "succeeded", timeout=60)  # the controller works on
    ctl = procs.procs[-1]
    ctl.wait_log("monitor t-files: cannot arm it")
    assert "recovered monitors: 0" in ctl.text() and "Redis error" not in ctl.text()
    assert ctl.alive()


def test_an_http_monitor_whose_host_refuses_fails_the_poll_and_keeps_its_state(
        redis_url: str) -> None:
    """A transport error (httpx's, imported only when a monitor fetches) is a failed poll,
    recorded on the monitor, not an error of the duty."""
    seen: list[Any] = []
    url = f"http://127.0.0.1:{free_port()}/data"  # nothing listens there
    monitors = Monitors()
    monitors.add(MonitorDef("m-refused", url, "http", seen.append, 60.0, None, ("127.0.0.1",),
                            2.0), True)
    runs = RunStore(open_store(redis_url))
    out = roll_monitor(runs, rq_connection(redis_url), "m-refused", monitors=monitors)
    assert out.status == "poll_failed" and out.detail.startswith("ConnectError"), out
    assert seen == []
    [view] = list_monitors(runs.store, monitors)
    assert view.to_json()["last_error"] == out.detail and view.last_change_ms is None
