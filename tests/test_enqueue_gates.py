"""Debounce, throttle and singleton with real processes (flow/enqueue_gates.py): many
concurrent enqueuer processes against one Redis, a worker and a controller (two, when one is
killed with SIGKILL mid-window); every outcome counted. The scripts' own decisions are also
checked on a 3-master cluster. Bad definitions and bad input: one line, exit 2.

Every wait is on an event (a Redis list filling, a run's status); the enqueuers start
together on a go key.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from marbles_rq.engine.authoring import DefinitionError, load_source, workflow
from marbles_rq.engine.runs import RunStore
from marbles_rq.flow import debounce, enqueue_gates
from marbles_rq.flow.gate_specs import digest, gate_of
from marbles_rq.store import open_store
from tests.procs import Procs, wait_for

SOURCE = Path(__file__).with_name("gate_workflows.py")
PROCS_SOURCES = (SOURCE,)
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _registry() -> None:
    load_source(str(SOURCE))


class Enqueuers:
    """`n` enqueuer processes (tests/gate_enqueuer.py), started once, driven burst by burst."""

    def __init__(self, procs: Procs, workflow: str, counts: list[int], customer: str,
                 bursts: int = 1) -> None:
        self.url, self.base = procs.url, f"gates:{uuid.uuid4().hex[:8]}"
        self.conn = redis.Redis.from_url(procs.url, decode_responses=True)
        self.n = len(counts)
        # Files, not pipes: a pipe nobody reads until the end would fill and stop them.
        self.outs = [procs.dir / f"{self.base}-{i}.out" for i in range(self.n)]
        self.started = [subprocess.Popen(
            [sys.executable, "-m", "tests.gate_enqueuer", procs.url, workflow, str(bursts),
             str(count), str(i), customer, self.base], cwd=REPO, env=procs.env, text=True,
            stdout=out.open("w"), stderr=out.with_suffix(".err").open("w"))
            for i, (count, out) in enumerate(zip(counts, self.outs, strict=True))]
        wait_for(lambda: self.conn.llen(f"{self.base}:ready") == self.n or None, timeout=60,
                 what="every enqueuer ready")

    def burst(self, b: int) -> None:
        self.conn.rpush(f"{self.base}:go:{b}", "go")

        def done() -> bool | None:
            for proc in self.started:
                if proc.poll() not in (None, 0):
                    raise AssertionError(f"an enqueuer failed: {self._errors()}")
            return self.conn.llen(f"{self.base}:done:{b}") == self.n or None

        wait_for(done, timeout=120, what=f"burst {b} enqueued")

    def results(self) -> list[dict[str, Any]]:
        out = []
        for proc, path in zip(self.started, self.outs, strict=True):
            assert proc.wait(timeout=60) == 0, self._errors()
            out += [json.loads(line) for line in path.read_text().splitlines()]
        return out

    def _errors(self) -> str:
        return "\n".join(p.with_suffix(".err").read_text() for p in self.outs)


def _ran(procs: Procs, workflow: str) -> list[dict[str, Any]]:
    rows = [json.loads(r) for r in procs.observer.client.lrange("gates:ran", 0, -1)]
    return [r for r in rows if r["workflow"] == workflow]


def _debounce_bursts(procs: Procs, workflow: str, *, kill_at: tuple[int, ...] = ()
                     ) -> list[dict[str, Any]]:
    """10 bursts of 100 enqueues (4 processes x 25), each burst's window let close (its run
    finished) before the next; the controller is killed with SIGKILL mid-window in the
    bursts `kill_at`, a standby taking over."""
    procs.worker()
    controllers = [procs.controller(lease_ms=2000)]
    if kill_at:
        controllers.append(procs.controller(lease_ms=2000, ready=False))
    obs = procs.observer
    feeders = Enqueuers(procs, workflow, [25, 25, 25, 25], "acme", bursts=10)
    for b in range(10):
        feeders.burst(b)
        if b in kill_at:
            leader = next(c for c in controllers if c.alive() and "elected controller"
                          in c.text())
            leader.kill9()
            controllers.append(procs.controller(lease_ms=2000, ready=False))
        wait_for(lambda b=b: len(_ran(procs, workflow)) >= b + 1 or None,  # type: ignore[misc]
                 timeout=60, what=f"burst {b}'s run")
    results = feeders.results()
    assert len(results) == 1000
    by_run: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_run.setdefault(r["id"], []).append(r)
    assert len(by_run) == 10, Counter(r["id"] for r in results)
    for run_id, rows in by_run.items():
        assert len(rows) == 100 and len({r["burst"] for r in rows}) == 1
        outcomes = Counter(r["decision"]["outcome"] for r in rows)
        assert outcomes == {"started": 1, "merged": 99}, outcomes
        assert sorted(r["decision"]["merged"] for r in rows) == list(range(1, 101))
        obs.wait_status(run_id, "succeeded", timeout=60)
    ran = _ran(procs, workflow)
    assert sorted({r["run"] for r in ran}) == sorted(by_run)
    return results


def _last(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda r: r["decision"]["merged"])["input"]


def test_debounce_bursts_one_run_per_window_with_the_last_input(procs: Procs) -> None:
    results = _debounce_bursts(procs, "gate_last", kill_at=(4,))
    ran = {r["run"]: r["input"] for r in _ran(procs, "gate_last")}
    for run_id in ran:
        rows = [r for r in results if r["id"] == run_id]
        assert ran[run_id] == _last(rows)


def test_debounce_with_a_reducer_across_controller_kills(procs: Procs) -> None:
    results = _debounce_bursts(procs, "gate_reduce", kill_at=(2, 6))
    ran = {r["run"]: r["input"] for r in _ran(procs, "gate_reduce")}
    for run_id, inp in ran.items():
        rows = [r for r in results if r["id"] == run_id]
        assert sorted(inp["items"]) == sorted(r["input"]["n"] for r in rows)  # none lost


def test_debounce_status_during_the_window_and_max(procs: Procs) -> None:
    procs.start()
    done = procs.cli("enqueue", "gate_max", "--input", '{"customer": "x", "n": 1}', "--json")
    assert done.returncode == 0, done.stderr
    first = json.loads(done.stdout)
    run_id = first["id"]
    assert first["decision"]["outcome"] == "started"
    status = procs.cli("status", run_id, "--json")
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    if data["status"] == "waiting":  # the 1 s window may have closed under load already
        assert data["waiting"]["reason"] == "debouncing"
        assert set(data["waiting"]["for"]) == {"until", "merged", "max"}
    procs.observer.wait_status(run_id, "succeeded", timeout=30)
    assert json.loads(procs.cli("status", run_id, "--json").stdout)["input"]["n"] == 1


def test_throttle_under_8_concurrent_enqueuers(procs: Procs) -> None:
    procs.start()
    feeders = Enqueuers(procs, "gate_throttle", [7, 7, 6, 6, 6, 6, 6, 6], "acme")
    feeders.burst(0)
    results = feeders.results()
    outcomes = Counter(r["decision"]["outcome"] for r in results)
    assert outcomes == {"started": 10, "dropped": 40}, outcomes
    for r in results:
        if r["decision"]["outcome"] == "dropped":
            assert r["id"] == "" and r["decision"]["retry_at"]
    # Another key has its own throttle; the CLI says dropped with exit 4.
    other = procs.cli("enqueue", "gate_throttle", "--input", '{"customer": "b"}')
    assert other.returncode == 0 and other.stdout.startswith("started run"), other
    dropped = procs.cli("enqueue", "gate_throttle", "--input", '{"customer": "acme"}')
    assert dropped.returncode == 4 and "dropped" in dropped.stdout, dropped
    for r in results:
        if r["decision"]["outcome"] == "started":
            procs.observer.wait_status(r["id"], "succeeded", timeout=60)


def test_singleton_skip_under_8_concurrent_enqueuers(procs: Procs) -> None:
    procs.start()
    feeders = Enqueuers(procs, "gate_skip", [5] * 8, "acme")
    feeders.burst(0)
    results = feeders.results()
    outcomes = Counter(r["decision"]["outcome"] for r in results)
    assert outcomes == {"started": 1, "skipped": 39}, outcomes
    survivor = next(r["id"] for r in results if r["decision"]["outcome"] == "started")
    assert {r["id"] for r in results} == {survivor}  # each skip names the unfinished run
    skipped = procs.cli("enqueue", "gate_skip", "--input", '{"customer": "acme"}')
    assert skipped.returncode == 5 and survivor in skipped.stdout, skipped
    procs.observer.client.rpush("gates:release:acme", "go")
    procs.observer.wait_status(survivor, "succeeded", timeout=60)
    keys = RunStore(open_store(procs.url)).keys
    gate = gate_of(singleton="skip", singleton_key="customer")
    assert gate is not None
    pointer = keys.singleton_pointer(digest(gate, "gate_skip", "acme"))
    wait_for(lambda: procs.observer.client.get(pointer) is None or None, timeout=10,
             what="the pointer cleared by the settle")
    again = procs.cli("enqueue", "gate_skip", "--input", '{"customer": "acme"}')
    assert again.returncode == 0 and again.stdout.startswith("started run"), again


def test_singleton_cancel_running_under_8_concurrent_enqueuers(procs: Procs) -> None:
    procs.start()
    feeders = Enqueuers(procs, "gate_cancel", [3] * 8, "acme")
    feeders.burst(0)
    results = feeders.results()
    outcomes = Counter(r["decision"]["outcome"] for r in results)
    assert outcomes == {"started": 1, "cancelled_running": 23}, outcomes
    ids = {r["id"] for r in results}
    assert len(ids) == 24
    cancelled = [r["decision"]["cancelled"] for r in results
                 if r["decision"]["outcome"] == "cancelled_running"]
    assert len(set(cancelled)) == 23 and set(cancelled) < ids  # each cancelled once
    (survivor,) = ids - set(cancelled)
    for run_id in set(cancelled):
        procs.observer.wait_status(run_id, "cancelled", timeout=60)
    procs.observer.client.rpush("gates:release:acme", "go")
    procs.observer.wait_status(survivor, "succeeded", timeout=60)


def test_a_pointer_to_a_finished_run_is_taken_over(redis_url: str) -> None:
    """A kill -9 between a singleton run's settle and the clear of its pointer: the next
    enqueue finds the pointer, reads the run's status (finished) and takes the key over."""
    runs = RunStore(open_store(redis_url))
    keys = runs.keys
    ident = "f" * 20
    pointer = keys.singleton_pointer(ident)
    old = debounce.id_in_bucket(keys, keys.bucket_of(ident))
    assert keys.bucket_of(old) == keys.bucket_of(ident)
    runs.client.set(pointer, f"{old}|1|")
    runs.client.hset(keys.run(old), mapping={"status": "failed"})
    reply = runs.scripts.singleton_enqueue(pointer=pointer, run=keys.run(old), expect=old,
                                           run_id="new-run", mode="skip", grace_ms=30_000)
    assert reply.status == "started"
    # A stale compare-and-set is refused, naming the current run.
    stale = runs.scripts.singleton_enqueue(pointer=pointer, run=keys.run(old), expect=old,
                                           run_id="newer", mode="skip", grace_ms=30_000)
    assert (stale.status, stale.values[0]) == ("retry", b"new-run")


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_gate_scripts(where: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("redis_url" if where == "server" else "cluster_url")
    runs = RunStore(open_store(url))
    keys = runs.keys
    ident = uuid.uuid4().hex[:20]
    bucket = keys.bucket_of(ident)
    rid = debounce.id_in_bucket(keys, bucket)
    win = dict(window=keys.debounce_window(ident), due=keys.debounce_due(bucket),
               runs=keys.debounce_runs(bucket), closed=keys.debounce_closed(bucket))
    opened = runs.scripts.debounce_enqueue(**win, run_id=rid, doc=b"{}", input=b"1",
                                           merged=b"", expect="", window_ms=60_000,
                                           max_ms=0, digest=ident, request_id="r1")
    assert opened.status == "started"
    merged = runs.scripts.debounce_enqueue(**win, run_id="other", doc=b"{}", input=b"2",
                                           merged=b"", expect="", window_ms=60_000,
                                           max_ms=0, digest=ident, request_id="r2")
    assert merged.status == "merged" and merged.values[1] == 2
    conflict = runs.scripts.debounce_enqueue(**win, run_id="other", doc=b"{}", input=b"3",
                                             merged=b"9", expect="?", window_ms=60_000,
                                             max_ms=0, digest=ident, request_id="r3")
    assert conflict.status == "conflict" and conflict.values[2] == b"2"
    assert runs.scripts.close_debounce(**win, run_id=rid).status == "open"
    # debounce_max: a window closes at its max however often it is merged.
    ident2 = uuid.uuid4().hex[:20]
    b2 = keys.bucket_of(ident2)
    win2 = dict(window=keys.debounce_window(ident2), due=keys.debounce_due(b2),
                runs=keys.debounce_runs(b2), closed=keys.debounce_closed(b2))
    rid2 = debounce.id_in_bucket(keys, b2)
    first = runs.scripts.debounce_enqueue(**win2, run_id=rid2, doc=b"{}", input=b"1",
                                          merged=b"", expect="", window_ms=60_000,
                                          max_ms=60_000, digest=ident2, request_id="m1")
    again = runs.scripts.debounce_enqueue(**win2, run_id="x", doc=b"{}", input=b"2",
                                          merged=b"", expect="", window_ms=60_000,
                                          max_ms=60_000, digest=ident2, request_id="m2")
    assert again.values[2] == first.values[3] == again.values[3]  # until capped at max
    log = keys.throttle_log(ident)
    got = [runs.scripts.throttle_enqueue(log=log, run_id=f"t{i}", limit=3,
                                         period_ms=60_000).status for i in range(5)]
    assert got == ["started"] * 3 + ["dropped"] * 2
    pointer = keys.singleton_pointer(ident)
    first = runs.scripts.singleton_enqueue(pointer=pointer, run=pointer, expect="",
                                           run_id=rid, mode="skip", grace_ms=30_000)
    assert first.status == "started"
    skip = runs.scripts.singleton_enqueue(pointer=pointer, run=keys.run(rid), expect=rid,
                                          run_id=debounce.id_in_bucket(keys, bucket),
                                          mode="skip", grace_ms=30_000)
    assert (skip.status, skip.values[0]) == ("skipped", rid.encode())
    assert runs.scripts.clear_singleton(pointer=pointer, run_id=rid) == "cleared"


@pytest.mark.parametrize("options, message", [
    (dict(debounce="5 parsecs"), "invalid debounce '5 parsecs'"),
    (dict(debounce="5s", debounce_max="2s"), "debounce_max '2s' is shorter than debounce"),
    (dict(throttle="ten a minute"), "invalid throttle 'ten a minute'"),
    (dict(throttle="0/min"), "the number of runs must be"),
    (dict(singleton="maybe"), "invalid singleton 'maybe'"),
    (dict(throttle_key="customer"), "throttle_key needs throttle="),
    (dict(throttle="1/s", singleton="skip"), "choose one of debounce, throttle, singleton"),
])
def test_bad_definitions_fail_at_load(options: dict[str, Any], message: str) -> None:
    with pytest.raises(DefinitionError) as info:
        @workflow(f"bad_gate_{uuid.uuid4().hex[:6]}", **options)
        def bad(ctx: Any, inp: dict[str, Any]) -> None: ...
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_key_on_a_workflow_without_input_fails_at_load() -> None:
    with pytest.raises(DefinitionError, match="names an input field, but the workflow takes "
                                              "no input"):
        @workflow("bad_gate_noinput", throttle="10/min", throttle_key="customer")
        def bad(ctx: Any) -> None: ...


def _store_keys(procs: Procs) -> set[str]:
    """marbles-rq's keys (RQ's own, which the worker touches as it starts, left out)."""
    return {k for k in procs.observer.client.scan_iter(count=1000) if not k.startswith("rq:")}


def test_bad_input_is_refused_with_one_line(procs: Procs) -> None:
    procs.start(controller=False)
    before = _store_keys(procs)
    for args, needle in [
        (("gate_untyped", "--input", '{"n": 1}'), "the input has no field 'customer'"),
        (("gate_untyped", "--input", '{"customer": [1]}'), "must be a string or a whole"),
        (("gate_skip", "--input", '{"customer": "a"}', "--id", "mine"), "enqueue it without "
                                                                        "an id"),
        (("gate_last", "--input", '{"customer": "a"'), "not valid JSON"),
    ]:
        done = procs.cli("enqueue", *args)
        assert done.returncode == 2, done
        assert needle in done.stderr and done.stderr.count("\n") == 1, done.stderr
    batch = procs.dir / "batch.jsonl"
    batch.write_text('{"customer": "a"}\n')
    done = procs.cli("enqueue", "gate_throttle", "--batch", str(batch))
    assert done.returncode == 2 and "one by one" in done.stderr, done
    assert _store_keys(procs) == before  # nothing written
    missing = procs.cli("status", "no-such-window")
    assert missing.returncode == 2


def test_the_kit_refuses_a_gate_with_one_line() -> None:
    from marbles_rq.testing import Environment

    env = Environment(schedules=False)
    with pytest.raises(enqueue_gates.GateRefusedError, match="the test kit does not apply"):
        env.start("gate_throttle", {"customer": "a"})


def test_the_http_api_and_the_async_client_say_what_happened(procs: Procs) -> None:
    import asyncio

    import marbles_rq as mr
    from tests.test_web_api import API_TOKEN, curl
    from tests.web_stack import start_web

    procs.start()
    web = start_web(procs, extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    body = {"workflow": "gate_skip", "input": {"customer": "web"}}
    first = curl(web, "POST", "/api/runs", body)
    assert first.status == 201 and first.json()["decision"]["outcome"] == "started", first.body
    run_id = first.json()["id"]
    second = curl(web, "POST", "/api/runs", body)
    assert second.status == 200, second.body
    assert second.json()["decision"] == {"outcome": "skipped", "run_id": run_id, "key": "web"}
    assert second.json()["id"] == run_id
    for _ in range(10):
        curl(web, "POST", "/api/runs", {"workflow": "gate_throttle",
                                        "input": {"customer": "web"}})
    dropped = curl(web, "POST", "/api/runs", {"workflow": "gate_throttle",
                                              "input": {"customer": "web"}})
    assert dropped.status == 200 and dropped.json()["decision"]["outcome"] == "dropped"
    assert "retry-after:" in dropped.headers.lower()
    bad = curl(web, "POST", "/api/runs", {"workflow": "gate_untyped", "input": {"n": 1}})
    assert bad.status == 422 and "no field 'customer'" in bad.error()["message"]
    batch = curl(web, "POST", "/api/runs:batch", {"runs": [body]})
    assert batch.status == 422 and "one by one" in batch.error()["message"]
    procs.observer.client.rpush("gates:release:web", "go")  # the worker is free again
    window = curl(web, "POST", "/api/runs", {"workflow": "gate_long",
                                             "input": {"customer": "page", "n": 7}})
    assert window.status == 201, window.body
    shown = curl(web, "GET", f"/api/runs/{window.json()['id']}")
    assert shown.status == 200 and shown.json()["waiting"]["reason"] == "debouncing"
    browser = web.signed_in()  # the dashboard's run page shows the window's run
    try:
        page = browser.get(f"/runs/{window.json()['id']}")
        assert page.status_code == 200 and "debouncing" in page.text, page.text[:500]
    finally:
        browser.close()

    async def merged() -> tuple[str, str, str]:
        async with mr.connect_async(procs.url) as client:
            a = await client.start("gate_last", {"customer": "aio", "n": 1})
            b = await client.start("gate_last", {"customer": "aio", "n": 2})
            assert a.decision is not None and b.decision is not None
            return a.id, b.id, b.decision.outcome

    a, b, outcome = asyncio.run(merged())
    assert (b, outcome) == (a, "merged")
    procs.observer.wait_status(a, "succeeded", timeout=60)
    assert json.loads(procs.cli("status", a, "--json").stdout)["input"]["n"] == 2


def test_decisions_through_the_client_on_a_cluster(cluster_url: str, redis_url: str) -> None:
    """Each decision is one script on the key's bucket tag, and the client's reads (the
    pointer, a window's status) name keys of that tag only: on a 3-master cluster too (RQ,
    the transport, on a server of its own)."""
    import marbles_rq as mr

    client = mr.connect(cluster_url, rq_url=redis_url)
    decided = [client.start("gate_throttle", {"customer": "c"}).decision for _ in range(11)]
    assert [d.outcome for d in decided if d] == ["started"] * 10 + ["dropped"]
    one = client.start("gate_skip", {"customer": "c"})
    two = client.start("gate_skip", {"customer": "c"})
    assert two.decision is not None and (two.decision.outcome, two.id) == ("skipped", one.id)
    assert client.cancel(one.id).outcome == "cancelled"  # queued: settled now, key freed
    three = client.start("gate_skip", {"customer": "c"})
    assert three.decision is not None and three.decision.outcome == "started"
    first = client.start("gate_long", {"customer": "c", "n": 1})
    second = client.start("gate_long", {"customer": "c", "n": 2})
    assert second.decision is not None and second.decision.outcome == "merged"
    status = client.status(first.id)
    assert status.waiting is not None and status.waiting.reason == "debouncing"
    assert status.input == {"customer": "c", "n": 2, "items": []}
    # Cancelling the window's run: recorded cancelled, never delivered; the key opens anew.
    assert client.cancel(first.id).outcome == "cancelled"
    assert client.status(first.id).status == "cancelled"
    third = client.start("gate_long", {"customer": "c", "n": 3})
    assert third.decision is not None and third.decision.outcome == "started"
    assert third.id != first.id


def test_cancel_of_a_window_from_the_cli(procs: Procs) -> None:
    procs.start()
    done = procs.cli("enqueue", "gate_long", "--input", '{"customer": "q", "n": 1}', "--json")
    assert done.returncode == 0, done.stderr
    run_id = json.loads(done.stdout)["id"]
    # Before its window closes the run is shown (status) but cannot be acted on: each
    # action says why, in one line, exit 2, and nothing changes.
    for action in (["pause", run_id], ["retry", run_id], ["signal", run_id, "go"],
                   ["rerun", run_id]):
        refused = procs.cli(*action)
        assert refused.returncode == 2, refused
        assert refused.stderr.strip() == (
            f"error: run {run_id} has not started: its debounce window is open until "
            f"{json.loads(done.stdout)['decision']['until']} (cancel closes it); nothing to "
            f"{action[0]}"), refused.stderr
    import marbles_rq as mr

    with pytest.raises(debounce.DebouncingError, match="has not started"):
        mr.connect(procs.url).pause(run_id)
    assert procs.observer.view(run_id) is None  # still a window: nothing recorded
    cancelled = procs.cli("cancel", run_id)
    assert cancelled.returncode == 0, cancelled
    view = procs.observer.wait_status(run_id, "cancelled", timeout=10)
    assert view.attempt == 1 and [e.type for e in procs.observer.events(run_id)
                                  ].count("attempt_started") == 0  # never delivered
