"""Event batching against a real redis-server and real `marbles-rq` processes: every event
in exactly one batch run's input (also with the controller and workers killed -9 while
several processes send thousands of events), no batch over its max_size, every batch
started once, a batch sealed by time started by the controller, batches per key value, and
bad declarations refused with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

import marbles_rq as mr
from marbles_rq.engine.authoring import DefinitionError
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.triggers.batches import Batches, split_batch_id
from marbles_rq.triggers.events import EventInputError, Events, event_key
from tests.batch_workflows import MARKER_KEY
from tests.procs import REPO_ROOT, Procs, wait_for
from tests.redis_procs import RedisServer

B_SOURCE = REPO_ROOT / "tests" / "batch_workflows.py"
PROCS_SOURCES = (B_SOURCE,)


def _events(procs: Procs) -> Events:
    runs = RunStore(open_store(procs.url))
    return Events(runs, rq_connection(procs.url))


def _batch_runs(procs: Procs, workflow: str) -> dict[str, list[str]]:
    """Every recorded batch run of `workflow` -> the provider ids of its input's events."""
    runs = RunStore(open_store(procs.url))
    out: dict[str, list[str]] = {}
    client = redis.Redis.from_url(procs.url)
    for key in client.scan_iter(match="*:run:evb-*", count=1000):
        view = runs.get(key.decode().rsplit(":run:", 1)[1])
        if view is not None and view.record.name == workflow:
            out[view.record.id] = [e["id"] for e in json.loads(bytes(view.record.input))]
    return out


def _markers(procs: Procs) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(procs.url, decode_responses=True)
    return [json.loads(m) for m in client.lrange(MARKER_KEY, 0, -1)]


def test_a_full_batch_starts_at_once_and_a_partial_one_stays_open(procs: Procs) -> None:
    procs.start(workers=1)
    events = _events(procs)
    sent = [events.send("bfull", f"o-{i}", payload=json.dumps({"n": i}).encode())
            for i in range(250)]
    assert {s.state for s in sent} == {"batched"}
    assert split_batch_id(sent[0].run_id) is not None
    # The 100th event sealed its batch and recorded its run, in the sender's call.
    assert [i for i, s in enumerate(sent) if s.run_created] == [99, 199]
    assert len({s.run_id for s in sent}) == 3
    full = [sent[0].run_id, sent[100].run_id]
    last = sent[-1].run_id
    assert events.runs.get(last) is None  # it waits for 50 more, or an hour
    [open_batch] = Batches(events.runs).open()
    assert (open_batch.batch_id, open_batch.size, open_batch.trigger) == (last, 50, "bfull")
    assert open_batch.seals_ms - open_batch.opened_ms == 3_600_000
    for rid in full:
        procs.observer.wait_status(rid, "succeeded", timeout=60)
    runs = _batch_runs(procs, "b_full")
    assert {rid: len(ids) for rid, ids in runs.items()} == {full[0]: 100, full[1]: 100}
    # In arrival order, each event once.
    assert runs[full[0]] + runs[full[1]] == [f"o-{i}" for i in range(200)]
    status = procs.cli("status", full[1], "--json")
    assert status.returncode == 0, status.stderr
    batch = json.loads(status.stdout)["batch"]
    assert (batch["batch"], batch["events"], batch["sealed_by"], batch["trigger"]) == \
        (full[1], 100, "size", "bfull")
    assert "batch of 100 events from trigger bfull, sealed by size" \
        in procs.cli("status", full[1]).stdout
    # A resend is recognised: same batch, nothing appended.
    again = events.send("bfull", "o-3", payload=b"1")
    assert (again.created, again.run_id) == (False, full[0])
    assert Batches(events.runs).open()[0].size == 50


def test_batches_per_key_field_and_key_function(procs: Procs) -> None:
    procs.start(workers=1)
    events = _events(procs)
    for i, customer in enumerate(["a", "b", "a", "a", "b", "c", "a"]):
        events.send("bkey", f"k-{i}", payload=json.dumps({"customer": customer}).encode())
    for i, region in enumerate(["eu", "EU", "us", "Eu"]):
        events.send("bregion", f"r-{i}", payload=json.dumps({"region": region}).encode())
    wait_for(lambda: len(_markers(procs)) == 6 or None, timeout=60, what="6 batch runs")
    got = sorted(sorted(m["ids"]) for m in _markers(procs))
    assert got == sorted([["k-0", "k-2", "k-3"], ["k-6"], ["k-1", "k-4"], ["k-5"],
                          ["r-0", "r-1", "r-3"], ["r-2"]])
    keys = {b["key"] for b in (Batches(events.runs).get(m["run"]) for m in _markers(procs))
            if b is not None}
    assert keys == {"a", "b", "c", "EU", "US"}
    # An event without the key's field is refused, and nothing is written.
    with pytest.raises(mr.MarblesError, match="event payload has no field 'customer'"):
        events.send("bkey", "k-x", payload=b'{"who": 1}')
    assert events.get(event_key("bkey", "k-x")) is None
    done = procs.cli("events", "send", "bkey", "--id", "k-cli", "--payload", '{"customer": "q"}')
    assert done.returncode == 0, done.stderr
    assert f"event {event_key('bkey', 'k-cli')} received; in batch evb-" in done.stdout


def test_bad_batch_declarations_are_one_line_errors(tmp_path: Path) -> None:
    cases = [(dict(max_size=0), "invalid max_size 0: a whole number from 1 to 10000"),
             (dict(max_size=2.5), "invalid max_size 2.5"),
             (dict(max_wait="soon"), "invalid max_wait 'soon': use a duration such as '5s'"),
             (dict(max_wait=0), "invalid max_wait 0: from 1 ms to 24 hours"),
             (dict(key="not a field"), "invalid batch key 'not a field'"),
             (dict(key=3), "invalid batch key 3")]
    for kwargs, message in cases:
        with pytest.raises(DefinitionError, match="^" + message) as info:
            mr.Batch(**kwargs)  # type: ignore[arg-type]
        assert "\n" not in str(info.value)
    with pytest.raises(DefinitionError, match=r"batch= takes mr\.Batch"):
        mr.on_event("x", batch={"max_size": 3})  # type: ignore[arg-type]

    def one(ctx: mr.RunContext, event: mr.Event) -> None: ...

    with pytest.raises(DefinitionError, match="its input must be a list"):
        mr.on_event("x", batch=mr.Batch())(mr.workflow(one))
    # From a source file, `marbles-rq list --source` says the same in one line, exit 2.
    bad = tmp_path / "bad_batch.py"
    bad.write_text("import marbles_rq as mr\n\n\n"
                   "@mr.on_event('bad', batch=mr.Batch(max_wait='5 seconds'))\n"
                   "@mr.workflow\n"
                   "def bad_batch(ctx: mr.RunContext, events: list[mr.Event]) -> None: ...\n")
    done = subprocess.run(
        [sys.executable, "-m", "marbles_rq", "--redis-url", "redis://127.0.0.1:1", "--source",
         str(bad), "list"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert done.stderr.strip().count("\n") == 0 and "invalid max_wait '5 seconds'" \
        in done.stderr


SENDER = """
import json, sys
sys.path.insert(0, {root!r})
import tests.batch_workflows  # declares the triggers
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.triggers.events import Events

url, prefix, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
events = Events(RunStore(open_store(url)), rq_connection(url))
for i in range(count):
    sent = events.send("bshop", f"{{prefix}}-{{i}}", payload=json.dumps({{"i": i}}).encode())
    assert sent.state == "batched", sent
print("sent", count, flush=True)
"""


def _journaled(procs: Procs, source: str) -> list[str]:
    """The provider ids of every journaled event of `source` (the events accepted)."""
    runs = RunStore(open_store(procs.url))
    client = redis.Redis.from_url(procs.url)
    pipe = client.pipeline(transaction=False)
    for bucket in range(runs.keys.buckets):
        pipe.zrange(runs.keys.event_listing(bucket), 0, -1)
    keys = [k.decode() for found in pipe.execute() for k in found]
    ids = []
    for view in Events(runs)._views(keys):
        if view.source == source:
            ids.append(view.id)
    return ids


def test_every_event_in_exactly_one_batch_across_kill_9_of_controller_workers_and_a_sender(
        procs: Procs) -> None:
    events = _events(procs)
    # Deterministic orphans, before any controller leads: 30 events journaled by a sender
    # that died before their append (pending), and a batch filled by a sender that died
    # before recording its run (sealed, its last event still pending).
    for i in range(30):
        record, trigger = events.prepare("bshop", f"pend-{i}", payload=b"0")
        assert events.journal(record, trigger, events.slot(record, trigger)).state == "pending"
    no_rq = Events(events.runs)  # no RQ connection: it cannot record a run
    with pytest.raises(ValueError, match="needs an RQ connection"):
        for i in range(100):
            no_rq.send("bshop", f"seal-{i}", payload=b"0")
    workers = procs.start(workers=2, interval=0.1)

    script = SENDER.format(root=str(REPO_ROOT))
    senders = [subprocess.Popen([sys.executable, "-c", script, procs.url, f"s{n}", "700"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for n in range(4)]
    try:
        client = redis.Redis.from_url(procs.url)

        def journaled_at_least(n: int) -> bool:
            return sum(client.zcard(events.keys.event_listing(b))
                       for b in range(events.keys.buckets)) >= n

        wait_for(lambda: journaled_at_least(600) or None, timeout=120, what="600 events")
        ctl = next(p for p in procs.procs if p.role == "controller")
        ctl.kill9()
        workers[0].kill9()
        senders[0].kill()  # SIGKILL: mid-stream, between any two of its calls
        senders[0].wait(timeout=10)
        wait_for(lambda: journaled_at_least(1400) or None, timeout=120, what="1400 events")
        procs.controller(interval=0.1)
        procs.worker()
        wait_for(lambda: journaled_at_least(2000) or None, timeout=120, what="2000 events")
        next(p for p in procs.procs if p.role == "controller" and p.alive()).kill9()
        workers[1].kill9()
        procs.start(workers=1, interval=0.1)
        for sender in senders[1:]:
            out, err = sender.communicate(timeout=300)
            assert sender.returncode == 0, err
            assert "sent 700" in out
    finally:
        for sender in senders:
            if sender.poll() is None:
                sender.kill()
                sender.wait()

    accepted = _journaled(procs, "bshop")
    assert len(accepted) >= 30 + 100 + 3 * 700

    def all_done() -> dict[str, list[str]] | None:
        runs = _batch_runs(procs, "b_orders")
        if sum(len(ids) for ids in runs.values()) < len(accepted):
            return None
        if any(events.runs.get(rid).status != "succeeded" for rid in runs):  # type: ignore[union-attr]
            return None
        return runs

    runs = wait_for(all_done, timeout=180, what="every accepted event in a finished batch run",
                    interval=0.5, context=procs.report)
    per_event = Counter(i for ids in runs.values() for i in ids)
    assert set(per_event) == set(accepted)
    assert max(per_event.values()) == 1, [i for i, n in per_event.items() if n > 1][:5]
    assert max(len(ids) for ids in runs.values()) <= 100
    # Every event names the batch (the run) it is in; every batch was started once.
    views = {v.id: v for v in Events(events.runs)._views(
        [event_key("bshop", i) for i in accepted])}
    assert {v.state for v in views.values()} == {"batched"}
    assert all(views[i].run_id == rid for rid, ids in runs.items() for i in ids)
    batches = Batches(events.runs)
    assert {batches.get(rid)["state"] for rid in runs} == {"started"}  # type: ignore[index]
    assert batches.open() == []
    markers = Counter(m["run"] for m in _markers(procs))
    assert set(markers) == set(runs)
    print(f"{len(accepted)} events in {len(runs)} batch runs; sealed by "
          f"{Counter(batches.get(r)['sealed_by'] for r in runs)}")  # type: ignore[index]


def test_a_timed_batch_is_sealed_by_the_controller_after_max_wait_also_one_left_by_a_dead_one(
        procs: Procs) -> None:
    events = _events(procs)
    sent = [events.send("btime", f"t-{i}", payload=b"0") for i in range(5)]
    batch_id = sent[0].run_id
    assert {s.run_id for s in sent} == {batch_id} and not any(s.run_created for s in sent)
    # No controller leads: the batch stays open past its wait, and nothing starts it.
    [still] = Batches(events.runs).open()
    wait_for(lambda: events.runs.store.client.time()[0] * 1000 > still.seals_ms + 500 or None,
             timeout=10, what="the batch's wait to end")
    assert events.runs.get(batch_id) is None and Batches(events.runs).open() == [still]
    workers = procs.start(workers=1)
    procs.observer.wait_status(batch_id, "succeeded", timeout=60)
    assert "recovered batches: 1" in next(p for p in procs.procs
                                           if p.role == "controller").text()
    info = Batches(events.runs).get(batch_id)
    assert info is not None and (info["events"], info["sealed_by"]) == (5, "time")

    # With a controller leading, a new batch seals once its wait ends, never before.
    later = [events.send("btime", f"u-{i}", payload=b"0") for i in range(3)]
    ids = sorted({s.run_id for s in later})  # one batch, or two if the sends took > 1 s
    assert batch_id not in ids
    for rid in ids:
        procs.observer.wait_status(rid, "succeeded", timeout=60)
        got = Batches(events.runs).get(rid)
        assert got is not None and got["sealed_by"] == "time"
        group, _ = split_batch_id(rid)  # type: ignore[misc]
        opened, sealed = (int(x) for x in events.runs.store.client.hmget(
            events.keys.batch(group, rid), ["opened_ms", "sealed_ms"]))
        assert sealed - opened >= 1000
    assert _markers(procs)[0]["ids"] == [f"t-{i}" for i in range(5)]
    assert sorted(i for m in _markers(procs)[1:] for i in m["ids"]) == ["u-0", "u-1", "u-2"]
    assert workers


def test_batches_on_a_cluster(cluster_url: str, redis_url: str) -> None:
    """Each batch script touches one group's tag (the sealing, by size and by time, and
    closing), the event's own scripts its bucket's: no CROSSSLOT on a 3-master cluster. RQ
    on a server of its own, as MARBLES_RQ_URL puts it."""
    runs = RunStore(open_store(cluster_url))
    events = Events(runs, rq_connection(redis_url))
    sent = [events.send("bkey", f"c-{i}", payload=json.dumps({"customer": c}).encode())
            for i, c in enumerate("abaab")]
    assert [s.run_created for s in sent] == [False, False, False, True, False]
    full = runs.get(sent[3].run_id)
    assert full is not None and full.record.origin == "batch"
    assert [e["id"] for e in json.loads(bytes(full.record.input))] == ["c-0", "c-2", "c-3"]
    batches = Batches(runs, rq_connection(redis_url))
    [open_b] = batches.open()
    assert (open_b.key, open_b.size, open_b.batch_id) == ("b", 2, sent[1].run_id)
    wait_for(lambda: batches.seal(open_b.group, 1)[0] == "sealed" or None, timeout=30,
             what="the batch's wait to end", interval=0.1)
    assert batches.start(open_b.batch_id, 1) == "started"
    assert batches.start(open_b.batch_id, 1) == "closed"  # once
    timed = runs.get(open_b.batch_id)
    assert timed is not None
    assert [e["id"] for e in json.loads(bytes(timed.record.input))] == ["c-1", "c-4"]
    assert batches.open() == [] and batches.get(open_b.batch_id)["sealed_by"] == "time"  # type: ignore[index]


API_TOKEN = "api-token-0123456789abcdef-batch"


def test_open_batches_in_the_cli_the_clients_and_the_http_api(procs: Procs) -> None:
    import asyncio

    from tests.test_web_api import curl
    from tests.web_stack import start_web

    web = start_web(procs, extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    for i, customer in enumerate(["acme", "acme", "zeta"]):
        reply = curl(web, "POST", "/api/events", {"source": "bkey", "id": f"h-{i}",
                                                  "payload": {"customer": customer}},
                     token=API_TOKEN)
        assert reply.status == 202, reply.body
        assert reply.json()["state"] == "batched"
    acme_batch = curl(web, "POST", "/api/events", {"source": "bkey", "id": "h-0",
                                                   "payload": {"customer": "acme"}},
                      token=API_TOKEN)
    assert acme_batch.status == 200 and acme_batch.json()["created"] is False

    listed = curl(web, "GET", "/api/events/batches", token=API_TOKEN)
    assert listed.status == 200, listed.body
    got = {b["key"]: b for b in listed.json()["batches"]}
    assert {k: b["size"] for k, b in got.items()} == {"acme": 2, "zeta": 1}
    assert got["acme"]["trigger"] == "bkey" and got["acme"]["workflow"] == "b_keyed"
    assert got["acme"]["batch"] == acme_batch.json()["run"]

    http = web.signed_in()  # the dashboard's events page lists them too
    page = http.get("/events")
    http.close()
    assert page.status_code == 200 and "Open batches" in page.text
    assert got["acme"]["batch"] in page.text and got["zeta"]["batch"] in page.text

    cli = procs.cli("events", "batches", "--json")
    assert cli.returncode == 0, cli.stderr
    assert [(b["key"], b["size"]) for b in json.loads(cli.stdout)] == \
        [(b["key"], b["size"]) for b in listed.json()["batches"]]
    plain = procs.cli("events")
    assert plain.returncode == 0, plain.stderr
    assert f"open batch {got['acme']['batch']}  bkey -> b_keyed  key=acme  2 events" \
        in plain.stdout
    assert f"id=h-2  batched  batch {got['zeta']['batch']} (b_keyed, open)" in plain.stdout
    with mr.connect(procs.url) as client:
        assert [b.key for b in client.open_batches()] == [b["key"] for b in
                                                          listed.json()["batches"]]
        assert client.batch("no-such-run") is None
        with pytest.raises(EventInputError, match="event payload has no field 'customer'"):
            client.send_event("bkey", "h-typed", payload={"who": 1})

        async def aio() -> list[str]:
            async with mr.connect_async(procs.url) as ac:
                return [b.key for b in await ac.open_batches()]

        assert asyncio.run(aio()) == [b.key for b in client.open_batches()]

    # Bad input: one line and exit 2 from the CLI, a 4xx JSON error from the API; nothing
    # is journaled.
    done = procs.cli("events", "send", "bkey", "--id", "h-bad", "--payload", '{"who": 1}')
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("error: event payload has no field 'customer' (the "
                                   "trigger batches by it)")
    reply = curl(web, "POST", "/api/events", {"source": "bkey", "id": "h-bad",
                                              "payload": {"customer": [1]}}, token=API_TOKEN)
    assert reply.status == 422 or reply.status == 400, reply.body
    assert reply.error()["code"] == "invalid_event"
    assert "field 'customer' is list" in reply.error()["message"]
    assert _events(procs).get(event_key("bkey", "h-bad")) is None
    bad_json = curl(web, "POST", "/api/events", raw=b"{nope", token=API_TOKEN)
    assert 400 <= bad_json.status < 500 and bad_json.error()

    # The workers seal and run them; `status` names the batch.
    procs.start(workers=1)
    procs.observer.wait_status(got["zeta"]["batch"], "succeeded", timeout=60)
    status = json.loads(procs.cli("status", got["zeta"]["batch"], "--json").stdout)
    assert status["batch"]["events"] == 1 and status["batch"]["key"] == "zeta"
    listed_after = curl(web, "GET", "/api/events/batches", token=API_TOKEN)
    assert listed_after.json() == {"batches": []}


def test_the_test_kit_refuses_a_batched_trigger_in_one_line() -> None:
    from marbles_rq.testing import Environment

    env = Environment()
    with pytest.raises(NotImplementedError) as info:
        env.send_event("bshop", payload={"n": 1}, id="kit-1")
    assert str(info.value) == ("the test kit does not batch events (the trigger of bshop "
                               "declares batch=); start 'b_orders' with a list of mr.Event "
                               "instead")


def test_the_controller_serves_batch_metrics(procs: Procs) -> None:
    from tests.redis_procs import free_port
    from tests.test_metrics import scrape, value

    port = free_port()
    events = _events(procs)
    for i in range(2):  # their sender died before the append: the controller appends them
        record, trigger = events.prepare("bslow", f"m-{i}", payload=b"0")
        events.journal(record, trigger, events.slot(record, trigger))
    procs.controller(extra=["--metrics-port", str(port)])
    procs.worker()

    def counted() -> bool:
        samples = scrape(port)
        return (value(samples, "marbles_rq_events_batched_total", workflow="b_slow") == 2
                and value(samples, "marbles_rq_open_batches", workflow="b_slow") == 1)

    wait_for(counted, timeout=60, what="2 events batched by the controller, 1 open batch",
             context=procs.report)
    for i in range(3):
        events.send("btime", f"mt-{i}", payload=b"0")
    wait_for(lambda: value(scrape(port), "marbles_rq_batches_sealed_total",
                           workflow="b_timed", by="time") == 1 or None, timeout=60,
             what="a batch sealed by time", context=procs.report)
    assert value(scrape(port), "marbles_rq_open_batches", workflow="b_timed") == 0


def test_a_batch_seals_before_an_event_would_take_its_input_past_the_limit(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARBLES_MAX_PAYLOAD", "4000")
    runs = RunStore(open_store(redis_url))
    events = Events(runs, rq_connection(redis_url))
    sent = [events.send("bfull", f"big-{i}", payload=json.dumps({"pad": "x" * 600}).encode())
            for i in range(12)]
    batches = Batches(runs)
    [still] = batches.open()
    started = sorted({s.run_id for s in sent} - {still.batch_id})
    assert started, "no batch sealed by bytes"
    seen: list[str] = []
    for rid in started:
        view = runs.get(rid)
        assert view is not None and len(bytes(view.record.input)) <= 4000
        seen += [e["id"] for e in json.loads(bytes(view.record.input))]
        info = batches.get(rid)
        assert info is not None and (info["sealed_by"], info["state"]) == ("bytes", "started")
    assert seen + [f"big-{i}" for i in range(12 - still.size, 12)] == \
        [f"big-{i}" for i in range(12)]


def test_a_controller_on_a_cluster_seals_timed_batches(
        cluster_url: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """The whole path on a 3-master cluster with three lanes (RQ on a standalone Redis, as
    the README says): `events send` journals and appends, a leading controller (one per
    lane) seals the batch once its wait ends and records its run, a worker runs it."""
    procs = Procs(cluster_url, tmp_path / "procs", sources=[B_SOURCE])
    procs.env.update(MARBLES_LANE_COUNT="3", MARBLES_RQ_URL=redis_server.url,
                     MARBLES_TEST_EFFECTS_URL=redis_server.url)
    try:
        procs.start(workers=1)
        runs: set[str] = set()
        for i in range(3):
            done = procs.cli("events", "send", "btime", "--id", f"cl-{i}", "--json")
            assert done.returncode == 0, done.stderr
            out = json.loads(done.stdout)
            assert out["state"] == "batched"
            runs.add(out["run"])
        store = RunStore(open_store(cluster_url))
        ids: list[str] = []
        for rid in sorted(runs):
            def finished(rid: str = rid) -> Any:
                view = store.get(rid)
                return view if view is not None and view.status == "succeeded" else None

            view = wait_for(finished, timeout=60, what=f"batch run {rid} to succeed",
                            context=procs.report)
            ids += [e["id"] for e in json.loads(bytes(view.record.input))]
            info = Batches(store).get(rid)
            assert info is not None and info["sealed_by"] == "time"
        assert sorted(ids) == ["cl-0", "cl-1", "cl-2"]
        assert Batches(store).open() == []
    finally:
        procs.stop_all()
        print(procs.report(lines=40))
