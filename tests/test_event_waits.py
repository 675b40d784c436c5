"""Runs that wait for a matching inbound event (`ctx.wait_for_event`): real redis-server, real
`marbles-rq worker` / `controller` processes, events sent as `marbles-rq events send` sends
them (Events.send, in this process, or the CLI). Workflows in tests/published_workflows.py.

A check that something did not happen relies on Events.send delivering to every matched run
before it returns: once it returned, a run it did not wake stays as it was.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from marbles_rq.engine import ops
from marbles_rq.engine.event_waits import _spec_key, wait_term
from marbles_rq.payloads.fields import open_record
from marbles_rq.store.records import StepRecord, decode
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.triggers.events import Events, event_key
from tests.procs import REPO_ROOT, Procs, wait_for
from tests.published_workflows import EXEC_PREFIX
from tests.test_waiting_questions import kill9_groups, ok, server_ms, wait_parked

PROCS_SOURCES = (REPO_ROOT / "tests" / "published_workflows.py",)


def enqueue(procs: Procs, name: str, input: Any, run_id: str) -> None:
    done = ops.enqueue(procs.observer.runs, rq_connection(procs.url),
                       ops.RunRequest(name, json.dumps(input).encode(), run_id))
    assert done.created and done.dispatched, done


def send(procs: Procs, event_id: str, payload: Any, type: str = "paid") -> dict[str, str]:
    """Send an event of source "shop"; {run id: outcome} of the waits it was delivered to."""
    events = Events(procs.observer.runs, rq_connection(procs.url))
    record, _ = events.prepare("shop", event_id, type=type,
                               payload=json.dumps(payload).encode())
    events.journal(record, None)
    return events.offer(record)


def result(procs: Procs, run_id: str) -> Any:
    obs = procs.observer
    obs.wait_final(run_id)
    view = obs.view(run_id)
    assert view is not None and view.status == "succeeded", obs.dump(run_id)
    return view.to_json()["result"]


def event_entries(procs: Procs, run_id: str) -> list[StepRecord]:
    raw = procs.observer.runs.client.hgetall(procs.observer.runs.keys.steps(run_id))
    store = procs.observer.runs.store  # entries as stored: sealed when MARBLES_KEYS is set
    return [r for r in (open_record(store, decode(StepRecord, v, "ledger")) for v in raw.values())
            if r.name == "|event"]


def executions(procs: Procs, run_id: str) -> dict[str, int]:
    raw = procs.observer.client.hgetall(EXEC_PREFIX + run_id)
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


def types(procs: Procs, run_id: str) -> list[str]:
    return [e.type for e in procs.observer.events(run_id)]


def test_events_before_and_after_the_wait_wake_the_right_runs_and_no_other(
        procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    # Before any run waits: found by run A within the lookback (1 h by default).
    assert send(procs, "pay-A", {"order": "A", "amount": 5}) == {}
    for order in ("A", "B", "C"):
        enqueue(procs, "pw_wait_event", {"order": order}, f"ew-{order}")
    got_a = result(procs, "ew-A")
    assert got_a["id"] == "pay-A" and got_a["payload"] == {"order": "A", "amount": 5}
    assert got_a["key"] == event_key("shop", "pay-A")
    assert (got_a["source"], got_a["type"]) == ("shop", "paid")
    wait_parked(obs, "ew-B", "event")
    wait_parked(obs, "ew-C", "event")

    # Not a match: another type, another order, a payload without the field.
    assert send(procs, "refund-B", {"order": "B"}, type="refunded") == {}
    assert send(procs, "pay-D", {"order": "D"}) == {}
    assert send(procs, "pay-none", {"amount": 1}) == {}
    assert send(procs, "pay-list", [1, 2]) == {}
    assert obs.status("ew-B") == obs.status("ew-C") == "waiting"

    # After the wait: B and only B.
    assert send(procs, "pay-B", {"order": "B", "amount": 7}) == {"ew-B": "woken"}
    assert result(procs, "ew-B")["id"] == "pay-B"
    assert obs.status("ew-C") == "waiting", obs.dump("ew-C")
    assert "woken" not in types(procs, "ew-C")
    # The same event again (a provider's resend) is consumed once: B is done, nothing else.
    assert send(procs, "pay-B", {"order": "B", "amount": 7}) == {}

    for run_id, event_id in (("ew-A", "pay-A"), ("ew-B", "pay-B")):
        entries = event_entries(procs, run_id)
        assert [(e.status, json.loads(bytes(e.result))["id"]) for e in entries] == [
            ("received", event_id)], obs.dump(run_id)
        assert executions(procs, run_id) == {"before": 1, "after": 1}
        assert types(procs, run_id).count("event_received") == 1
    watched = ok(procs.cli("watch", "ew-B", "--no-follow"))
    assert 'parked: waiting for an event shop/paid order="B"' in watched, watched
    assert f"event {event_key('shop', 'pay-B')} (shop/paid) received by " in watched, watched
    # Only C's wait is still indexed.
    specs = obs.runs.client.hkeys(_spec_key(obs.runs.keys))
    assert [s.decode().split("|")[0] for s in specs] == ["ew-C"]

    status = ok(procs.cli("status", "ew-C"))
    assert 'waiting: event; event shop/paid order="C"' in status, status
    waiting = json.loads(ok(procs.cli("status", "ew-C", "--json")))["waiting"]
    assert waiting["reason"] == "event"
    assert waiting["for"]["events"] == [{"source": "shop", "type": "paid",
                                         "match": {"order": "C"}}]

    # The CLI path (events send) delivers too.
    out = ok(procs.cli("events", "send", "shop", "--id", "pay-C", "--type", "paid",
                       "--payload", json.dumps({"order": "C"})))
    assert "delivered to 1 waiting run: ew-C" in out, out
    assert result(procs, "ew-C")["id"] == "pay-C"
    assert obs.runs.client.hlen(_spec_key(obs.runs.keys)) == 0


SEND_WITHOUT_SOURCE = """
import json, sys
import marbles_rq as mr
sent = mr.connect().send_event("shop", "nosrc-X", "paid", {"order": "X"})
print(json.dumps([sent.state, sent.workflow, list(sent.delivered)]))
"""


def test_an_event_no_trigger_matches_anywhere_wakes_the_runs_waiting_for_it(
        procs: Procs) -> None:
    """No trigger of "shop" anywhere (not in the sender, none declared by the workers), and a
    sender that imports no workflow code: the client and `events send` without --source
    journal the event as unmatched and deliver it to the run waiting for it."""
    procs.start(workers=1, controller=False)
    obs = procs.observer
    assert obs.runs.client.hlen(obs.runs.keys.event_triggers) == 0
    for order in ("X", "Y"):
        enqueue(procs, "pw_wait_event", {"order": order}, f"ew-{order}")
        wait_parked(obs, f"ew-{order}", "event")
    env = {k: v for k, v in procs.env.items() if k != "MARBLES_SOURCE"}
    done = subprocess.run([sys.executable, "-c", SEND_WITHOUT_SOURCE], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["unmatched", "", ["ew-X"]]
    assert result(procs, "ew-X")["id"] == "nosrc-X"
    assert obs.status("ew-Y") == "waiting"

    argv = procs.base_argv()
    assert argv[-2] == "--source"
    cli = subprocess.run([*argv[:-2], "events", "send", "shop", "--id", "nosrc-Y", "--type",
                          "paid", "--payload", json.dumps({"order": "Y"})], env=env,
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert "delivered to 1 waiting run: ew-Y" in cli.stdout, cli.stdout
    assert "no trigger matches shop/paid, so no run" in cli.stdout, cli.stdout
    assert result(procs, "ew-Y")["id"] == "nosrc-Y"
    for key in (event_key("shop", "nosrc-X"), event_key("shop", "nosrc-Y")):
        assert obs.runs.client.hget(obs.runs.keys.event(key), "state") == b"unmatched"
        assert obs.runs.get(key) is None


def test_an_event_outside_the_lookback_does_not_match(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    send(procs, "old", {"order": "L"})
    sent_at = server_ms(obs)
    wait_for(lambda: server_ms(obs) > sent_at + 600, timeout=10,
             what="the server clock to pass the lookback")
    enqueue(procs, "pw_wait_event", {"order": "L", "lookback_s": 0.5}, "ew-late")
    wait_parked(obs, "ew-late", "event")
    # Inside a longer lookback the same event matches.
    enqueue(procs, "pw_wait_event", {"order": "L", "lookback_s": 60}, "ew-long")
    assert result(procs, "ew-long")["id"] == "old"
    assert obs.status("ew-late") == "waiting"
    assert send(procs, "new", {"order": "L"}) == {"ew-late": "woken"}
    assert result(procs, "ew-late")["id"] == "new"


def test_a_wait_times_out_with_a_typed_error(procs: Procs) -> None:
    procs.start(workers=1, controller=True)
    obs = procs.observer
    enqueue(procs, "pw_wait_event", {"order": "T", "timeout_s": 1}, "ew-timeout")
    wait_parked(obs, "ew-timeout", "event")
    assert result(procs, "ew-timeout") == {"timed_out": True}
    assert [e.status for e in event_entries(procs, "ew-timeout")] == ["timed_out"]
    # An event after the timeout is not consumed by the wait that gave up.
    assert send(procs, "too-late", {"order": "T"}) == {}
    assert "event_received" not in types(procs, "ew-timeout")


def test_a_waiting_run_survives_kill9_and_consumes_each_event_once(procs: Procs) -> None:
    procs.start(workers=1, controller=True)
    obs = procs.observer
    enqueue(procs, "pw_wait_twice", {"order": "K"}, "ew-kill")
    wait_parked(obs, "ew-kill", "event")
    kill9_groups(procs.procs)
    assert obs.status("ew-kill") == "waiting", obs.dump("ew-kill")
    procs.start(workers=1, controller=True)

    # The first event ends the first wait; the second wait (whose lookback covers that
    # event) must not take it again: it parks until the next one.
    assert send(procs, "k1", {"order": "K"}) == {"ew-kill": "woken"}
    wait_for(lambda: types(procs, "ew-kill").count("parked") == 2, timeout=30,
             what="the run to park on its second wait", context=lambda: obs.dump("ew-kill"))
    assert obs.status("ew-kill") == "waiting"
    kill9_groups(procs.procs)
    procs.start(workers=1, controller=True)
    assert send(procs, "k2", {"order": "K"}) == {"ew-kill": "woken"}
    assert result(procs, "ew-kill") == ["k1", "k2"]
    assert sorted(json.loads(bytes(e.result))["id"] for e in event_entries(
        procs, "ew-kill")) == ["k1", "k2"]
    assert types(procs, "ew-kill").count("event_received") == 2


def test_an_event_whose_sender_died_before_delivering_it_is_delivered_by_the_controller(
        procs: Procs) -> None:
    procs.start(workers=1, controller=True)
    obs = procs.observer
    enqueue(procs, "pw_wait_event", {"order": "S"}, "ew-orphan")
    wait_parked(obs, "ew-orphan", "event")
    # What a sender killed between the journal and the delivery leaves: the event journaled,
    # nothing delivered.
    events = Events(obs.runs, rq_connection(procs.url))
    record, _ = events.prepare("shop", "orphan", type="paid",
                               payload=json.dumps({"order": "S"}).encode())
    assert events.journal(record, None).created
    assert obs.status("ew-orphan") == "waiting"
    assert result(procs, "ew-orphan")["id"] == "orphan"  # the controller's events duty
    procs.procs[-1].wait_log("offered to waiting runs after its sender (ew-orphan woken)")
    assert executions(procs, "ew-orphan") == {"before": 1, "after": 1}
    bucket = obs.runs.keys.bucket_of(record.id)
    assert obs.runs.client.zcard(obs.runs.keys.event_offer(bucket)) == 0


def test_an_event_is_looked_up_under_the_term_of_every_wait_it_matches() -> None:
    from marbles_rq.engine.event_waits import (
        EventWaitError,
        check_wait,
        event_terms,
        matches,
        wait_term,
    )

    payload = {"order": "A", "amount": 5.0, "paid": True, "items": [1], "note": None}
    terms = set(event_terms("shop", "paid", payload))
    for type_, match in ((None, {}), ("paid", {}), (None, {"order": "A"}),
                         ("paid", {"amount": 5, "order": "A"}), ("paid", {"paid": True}),
                         (None, {"note": None})):
        spec = {"source": "shop", "type": type_, "match": match}
        assert matches(spec, "shop", "paid", payload), spec
        assert wait_term("shop", type_, match) in terms, spec
    for source, type_, match in (("shop", "refunded", {}), ("other", None, {}),
                                 ("shop", None, {"order": "B"}), ("shop", None, {"paid": 1}),
                                 ("shop", None, {"missing": None}), ("shop", None, {"items": 1})):
        spec = {"source": source, "type": type_, "match": match}
        assert not matches(spec, "shop", "paid", payload), spec
    # A wait for other values is under another term: the event never reads it.
    assert wait_term("shop", None, {"order": "B"}) not in terms
    for bad in ({"order": ["A"]}, {"": 1}, {"order": {"a": 1}}):
        try:
            check_wait("shop", None, bad, None, None)
        except EventWaitError as exc:
            assert exc.code == "invalid_event_wait"
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_every_script_of_published_state_and_event_waits_runs_on_a_cluster(
        cluster_url: str) -> None:
    """Each script touches the keys of one slot: the run's bucket, the event's bucket, or the
    index's own tag (a cluster refuses a script whose keys span slots: CROSSSLOT)."""
    import msgspec

    from marbles_rq.engine.event_waits import _term_keys
    from marbles_rq.engine.published import NotPublishedError, get_published
    from marbles_rq.engine.runs import RunStore
    from marbles_rq.store import open_store
    from tests.published_workflows import pw_wait_event  # noqa: F401  (registers it)

    runs = RunStore(open_store(cluster_url))
    runs.record(ops.prepare(ops.RunRequest("pw_wait_event", b'{"order": "Z"}', "cw-1")))
    keys = runs.keys.run_keys("cw-1")
    reply = runs.scripts.publish_state(keys=keys, epoch=99, run_id="cw-1", seq=1, step_key="k",
                                       record=b"{}", key="stage", value=b"1", event=b"{}")
    assert reply.status == "stale"
    reply = runs.scripts.open_event_wait(keys=keys, epoch=99, wait_key="w", timeout_ms=0,
                                         timeout_record=b"{}", event=b"{}")
    assert reply.status == "stale"
    try:
        get_published(runs, "cw-1", "stage")
    except NotPublishedError:
        pass
    else:
        raise AssertionError("a value nobody published was found")

    # A wait indexed for the run: the event finds it by its term, delivers in the run's own
    # slot (the run is queued, not waiting: nothing to deliver to), and drops the entry.
    spec = {"run": "cw-1", "key": "pw_wait_event.|event#0", "seq": 1, "source": "shop",
            "type": "paid", "match": {"order": "Z"}}
    runs.scripts.add_event_wait(
        term_key=_term_keys(runs.keys, wait_term("shop", "paid", {"order": "Z"}))[1],
        spec_key=_spec_key(runs.keys), member="cw-1|pw_wait_event.|event#0",
        spec=msgspec.json.encode(spec))
    sent = Events(runs).send("shop", "cz-1", type="paid", payload=b'{"order": "Z"}')
    assert sent.created and sent.delivered == ()
    assert runs.client.hlen(_spec_key(runs.keys)) == 0
    bucket = runs.keys.bucket_of(sent.key)
    assert runs.client.zcard(runs.keys.event_offer(bucket)) == 0
