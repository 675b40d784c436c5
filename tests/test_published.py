"""Published state: `ctx.publish` from a run body, read from outside with get_published /
`marbles-rq get` / `status --json`, and waited for with wait_published. Real redis-server,
real `marbles-rq worker` / `controller` processes; workflows in tests/published_workflows.py.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from marbles_rq.engine import ops
from marbles_rq.engine.execution import RunNotFoundError
from marbles_rq.engine.published import (
    NotPublishedError,
    PublishedWaitTimeoutError,
    get_published,
    wait_published,
)
from marbles_rq.payloads.fields import open_record
from marbles_rq.store.records import StepRecord, decode
from marbles_rq.transport.dispatch import rq_connection
from tests.procs import REPO_ROOT, Procs, wait_for
from tests.published_workflows import EXEC_PREFIX, GATE_PREFIX
from tests.test_waiting_questions import closed_port, kill9_groups, ok, one_line_error

PROCS_SOURCES = (REPO_ROOT / "tests" / "published_workflows.py",)


def enqueue(procs: Procs, name: str, input: Any, run_id: str) -> None:
    done = ops.enqueue(procs.observer.runs, rq_connection(procs.url),
                       ops.RunRequest(name, json.dumps(input).encode(), run_id))
    assert done.created and done.dispatched, done


def publish_entries(procs: Procs, run_id: str) -> list[StepRecord]:
    raw = procs.observer.runs.client.hgetall(procs.observer.runs.keys.steps(run_id))
    store = procs.observer.runs.store  # entries as stored: sealed when MARBLES_KEYS is set
    records = [open_record(store, decode(StepRecord, v, "ledger")) for v in raw.values()]
    return sorted((r for r in records if r.name == "|publish"), key=lambda r: r.key)


def published_events(procs: Procs, run_id: str) -> list[dict[str, Any]]:
    return [e.data for e in procs.observer.events(run_id) if e.type == "published"]


def test_publish_get_and_replay_after_kill9_publishes_once(procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    enqueue(procs, "pw_publish", None, "pub1")
    # The gated step runs after the first publish: the value is readable while it runs.
    obs.wait_step_started("pub1", "pw_publish.pw_gate#0", attempt=1)
    assert get_published(obs.runs, "pub1", "stage") == "one"
    with pytest.raises(NotPublishedError) as err:
        get_published(obs.runs, "pub1", "late")
    assert err.value.code == "not_published"

    # kill -9 right after the publish: the replay finds it in the ledger, publishes nothing.
    kill9_groups(procs.procs)
    procs.start(workers=1)
    wait_for(lambda: int(obs.client.hget(EXEC_PREFIX + "pub1", "gate") or 0) == 2, timeout=60,
             what="the gated step to run again after the redelivery",
             context=lambda: obs.dump("pub1"))
    assert get_published(obs.runs, "pub1", "stage") == "one"
    obs.client.rpush(GATE_PREFIX + "pub1", "go")
    obs.wait_final("pub1")
    assert obs.status("pub1") == "succeeded", obs.dump("pub1")

    assert get_published(obs.runs, "pub1", "stage") == "two"  # last write wins
    assert get_published(obs.runs, "pub1", "late") == {"n": 2}
    entries = publish_entries(procs, "pub1")
    assert [(r.key, bytes(r.result)) for r in entries] == [
        ("pw_publish.|publish#0", b'{"key":"stage"}'),
        ("pw_publish.|publish#1", b'{"key":"stage"}'),
        ("pw_publish.|publish#2", b'{"key":"late"}')], obs.dump("pub1")
    assert [e["key"] for e in published_events(procs, "pub1")] == ["stage", "stage", "late"]

    watched = ok(procs.cli("watch", "pub1", "--no-follow"))
    assert watched.count("published stage") == 2 and "published late" in watched, watched
    data = json.loads(ok(procs.cli("status", "pub1", "--json")))
    assert data["published"] == {"late": {"n": 2}, "stage": "two"}
    assert all(not s["name"].startswith("|") for s in data["steps"])


def test_wait_published_returns_when_published_and_times_out_otherwise(
        procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    enqueue(procs, "pw_publish", None, "pub2")
    obs.wait_step_started("pub2", "pw_publish.pw_gate#0", attempt=1)

    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(
        wait_published(obs.runs, "pub2", "late", 60)))
    waiter.start()
    # It blocks: it has not returned while the run is held at its gate.
    with pytest.raises(PublishedWaitTimeoutError) as err:
        wait_published(obs.runs, "pub2", "late", 0.3)
    assert err.value.code == "published_wait_timeout"
    assert waiter.is_alive() and got == []
    obs.client.rpush(GATE_PREFIX + "pub2", "go")
    waiter.join(30)
    assert got == [{"n": 2}]
    # Published already: at once.
    started = time.monotonic()
    assert wait_published(obs.runs, "pub2", "stage", 5) == "two"
    assert time.monotonic() - started < 1
    obs.wait_final("pub2")
    # A finished run that never published the key: told at once, not after the timeout.
    started = time.monotonic()
    with pytest.raises(NotPublishedError):
        wait_published(obs.runs, "pub2", "never", 30)
    assert time.monotonic() - started < 5
    with pytest.raises(RunNotFoundError):
        wait_published(obs.runs, "nope", "stage", 1)


def test_get_cli_output_exit_codes_and_one_line_errors(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    enqueue(procs, "pw_publish", None, "pub3")
    obs.wait_step_started("pub3", "pw_publish.pw_gate#0", attempt=1)

    assert ok(procs.cli("get", "pub3", "stage")) == '"one"\n'
    assert json.loads(ok(procs.cli("get", "pub3", "stage", "--json"))) == {
        "run": "pub3", "key": "stage", "value": "one"}
    one_line_error(procs.cli("get", "pub3", "late"), 1, "has not published", "late")
    one_line_error(procs.cli("get", "missing-run", "stage"), 2, "no run", "missing-run")
    one_line_error(procs.cli("get", "bad id!", "stage"), 2, "run id")
    one_line_error(procs.cli("get", "pub3", "bad\x01key"), 2, "published key")
    waited = procs.cli("get", "pub3", "late", "--wait", "0.2")
    one_line_error(waited, 1, "did not publish", "late")

    obs.client.rpush(GATE_PREFIX + "pub3", "go")
    assert json.loads(ok(procs.cli("get", "pub3", "late", "--wait", "30"))) == {"n": 2}

    down = f"redis://127.0.0.1:{closed_port()}/0"
    argv = procs.cli_argv("get", "pub3", "stage")
    argv[argv.index("--redis-url") + 1] = down
    import subprocess

    done = subprocess.run(argv, cwd=REPO_ROOT, env={**procs.env, "MARBLES_REDIS_URL": down},
                          capture_output=True, text=True, timeout=60)
    one_line_error(done, 3)
