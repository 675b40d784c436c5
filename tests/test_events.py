"""Inbound events against a real redis-server and real `marbles-rq` processes: journal first
under a stable key, one run per event however often and however concurrently it is sent, a
pending event left by a dying sender becomes a run once a controller leads, and a controller
killed mid-recovery never makes an event run twice."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import redis

import marbles_rq as mr
from marbles_rq.engine.authoring import Registry
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.triggers.events import Events, Trigger, Triggers, event_key
from tests.procs import CHAIN_SOURCE, KILL_SOURCE, REPO_ROOT, Proc, Procs, wait_for
from tests.trigger_workflows import MARKER_KEY

T_SOURCE = REPO_ROOT / "tests" / "trigger_workflows.py"


PROCS_SOURCES = (CHAIN_SOURCE, KILL_SOURCE, T_SOURCE)


def _client(procs: Procs) -> redis.Redis:
    return redis.Redis.from_url(procs.url, decode_responses=True)


def _markers(procs: Procs) -> list[dict[str, object]]:
    return [json.loads(m) for m in _client(procs).lrange(MARKER_KEY, 0, -1)]


def _events_json(procs: Procs) -> list[dict[str, object]]:
    done = procs.cli("events", "--json", "--limit", "1000")
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def test_the_same_event_sent_twice_and_concurrently_makes_one_run(procs: Procs) -> None:
    procs.start(workers=1)
    first = procs.cli("events", "send", "gh", "--id", "delivery-1", "--type", "push",
                      "--payload", '{"ref": "main"}')
    assert first.returncode == 0, first.stderr
    key = event_key("gh", "delivery-1")
    assert f"event {key} received; run {key} queued (t_on_push)" in first.stdout
    again = procs.cli("events", "send", "gh", "--id", "delivery-1", "--type", "push",
                      "--payload", '{"ref": "other"}')
    assert again.returncode == 0, again.stderr
    assert f"event {key} was received before (started, run {key}); nothing created" \
        in again.stdout

    # Six processes send one new event at the same moment: one journals it and records
    # its run; the others say it was received before.
    racers = procs.cli_concurrently("events", "send", "gh", "--id", "delivery-2",
                                    "--type", "push", "--payload", "[1, 2]", "--json", n=6)
    assert all(r.returncode == 0 for r in racers), [r.stderr for r in racers]
    outcomes = [json.loads(r.stdout) for r in racers]
    assert sum(o["created"] for o in outcomes) == 1
    key2 = event_key("gh", "delivery-2")
    assert {o["run"] for o in outcomes} == {key2}

    for run_id in (key, key2):
        view = procs.observer.wait_status(run_id, "succeeded", timeout=60)
        assert view.record.name == "t_on_push"
    markers = _markers(procs)
    assert Counter(m["run"] for m in markers) == {key: 1, key2: 1}
    assert {m["run"]: m["payload"] for m in markers} == {key: {"ref": "main"}, key2: [1, 2]}
    assert {m["run"]: m["id"] for m in markers} == {key: "delivery-1", key2: "delivery-2"}

    listed = {e["key"]: e for e in _events_json(procs)}
    assert set(listed) == {key, key2}
    assert listed[key]["state"] == "started" and listed[key]["run_status"] == "succeeded"
    assert listed[key]["source"] == "gh" and listed[key]["type"] == "push"
    assert listed[key]["workflow"] == "t_on_push"
    text = procs.cli("events")
    assert text.returncode == 0 and f"{key}  gh/push  id=delivery-1  started" in text.stdout


def test_an_event_of_another_type_goes_to_the_source_trigger(procs: Procs) -> None:
    procs.start(workers=1)
    done = procs.cli("events", "send", "gh", "--id", "d-9", "--type", "issue", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["workflow"] == "t_on_any" and out["created"]
    view = procs.observer.wait_status(out["run"], "succeeded", timeout=60)
    assert view.record.name == "t_on_any"


def test_an_event_without_a_trigger_is_journaled_with_no_run(procs: Procs) -> None:
    done = procs.cli("events", "send", "stripe", "--id", "evt_1", "--payload", "{}")
    assert done.returncode == 0, done.stderr
    key = event_key("stripe", "evt_1")
    assert f"event {key} journaled; no trigger matches stripe, so no run" in done.stdout
    again = procs.cli("events", "send", "stripe", "--id", "evt_1")
    assert again.returncode == 0 and "received before (unmatched); nothing created" \
        in again.stdout
    [listed] = _events_json(procs)
    assert listed["state"] == "unmatched" and listed["run"] is None
    assert RunStore(open_store(procs.url)).get(key) is None


def test_a_pending_event_becomes_a_run_once_a_controller_leads(procs: Procs) -> None:
    """The sender died between journaling the event and recording its run."""
    events = Events(RunStore(open_store(procs.url)))
    record, trigger = events.prepare("gh", "orphan-1", type="push", payload=b'{"n": 1}')
    sent = events.journal(record, trigger)
    assert sent.created and sent.state == "pending" and sent.run_id == record.id
    assert events.runs.get(record.id) is None  # no run yet

    procs.start(workers=1)
    view = procs.observer.wait_status(record.id, "succeeded", timeout=60)
    assert view.record.name == "t_on_push"
    got = events.get(record.id)
    assert got is not None and got.state == "started" and got.run_status == "succeeded"
    assert [m["payload"] for m in _markers(procs)] == [{"n": 1}]
    assert "recovered events: 1" in procs.procs[-1].text()  # on election, not a later pass



def test_a_pending_event_left_while_a_controller_leads_is_started_after_its_grace(
        procs: Procs) -> None:
    """The controller's passes (not only its election) pick up an event whose sender died,
    once the sender's grace (5 s) has passed."""
    procs.start(workers=1)
    # Journaled once the new leader's recovery is over: recovery (not a pass) starts every
    # pending event at once, since on election any sender may be gone.
    next(p for p in procs.procs if p.role == "controller").wait_log("recovered monitors")
    events = Events(RunStore(open_store(procs.url)))
    record, trigger = events.prepare("gh", "late-1", type="push", payload=b"7")
    assert events.journal(record, trigger).created
    view = procs.observer.wait_status(record.id, "succeeded", timeout=60)
    got = events.get(record.id)
    assert got is not None and got.state == "started"
    assert view.created_ms - got.received_ms >= 5000  # not before the sender's grace
    assert [m["payload"] for m in _markers(procs)] == [7]


def test_a_corrupt_pending_event_fails_alone(procs: Procs) -> None:
    events = Events(RunStore(open_store(procs.url)))
    bad, trigger = events.prepare("gh", "bad-1", type="push")
    assert events.journal(bad, trigger).created
    _client(procs).hset(events.keys.event(bad.id), "doc", "{not json")
    good, trigger = events.prepare("gh", "good-1", type="push")
    assert events.journal(good, trigger).created
    procs.start(workers=1)
    procs.observer.wait_status(good.id, "succeeded", timeout=60)
    wait_for(lambda: _client(procs).hget(events.keys.event(bad.id), "state") == "failed",
             timeout=30, what="the corrupt event to be failed", context=procs.report)
    assert events.recent() == events._views([good.id])  # the listing skips the corrupt one
    note = _client(procs).hget(events.keys.event(bad.id), "note")
    assert note is not None and "corrupt record" in note
    assert events.runs.get(bad.id) is None
    assert procs.procs[-1].alive()

def test_a_controller_killed_while_recovering_events_runs_none_twice(procs: Procs) -> None:
    events = Events(RunStore(open_store(procs.url)))
    keys = []
    for i in range(300):
        record, trigger = events.prepare("gh", f"bulk-{i}", type="push", payload=str(i).encode())
        assert events.journal(record, trigger).created
        keys.append(record.id)
    client = _client(procs)

    first = procs.controller(lease_ms=2000, ready=False)

    def some_started() -> bool:
        return any(v.state == "started" for v in events._views(keys))

    wait_for(some_started, timeout=30, what="the first controller to start some events",
             interval=0.005, context=procs.report)
    first.kill9()
    started_by_first = sum(1 for v in events._views(keys) if v.state == "started")

    procs.controller(lease_ms=2000)
    procs.worker(pool=4)

    def all_ran() -> bool:
        return client.llen(MARKER_KEY) >= len(keys) and all(
            v.run_status == "succeeded" for v in events._views(keys))

    wait_for(all_ran, timeout=120, what="every event's run to succeed", interval=0.2,
             context=procs.report)
    assert Counter(m["run"] for m in _markers(procs)) == {k: 1 for k in keys}
    assert all(v.state == "started" for v in events._views(keys))
    print(f"the first controller started {started_by_first} of {len(keys)} before its kill")


def _exits_2(procs: Procs, *args: str, env: dict[str, str] | None = None) -> str:
    argv = procs.cli_argv(*args)
    done = subprocess.run(argv, cwd=REPO_ROOT, env={**procs.env, **(env or {})},
                          capture_output=True, text=True, timeout=60)
    procs.log_cli(argv, done.returncode, done.stdout, done.stderr)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "env", "says"), [
    (["gh", "--id", "1", "--payload", "{not json"], None, "not valid JSON"),
    (["gh", "--id", "1", "--payload", json.dumps({"x": "y" * 200})],
     {"MARBLES_MAX_PAYLOAD": "100"}, "the limit is 100"),
    (["gh", "--id", "1", "--payload", "[" * 65 + "]" * 65], None, "deeper than 64"),
    (["git hub", "--id", "1"], None, "invalid event source"),
    (["gh", "--id", ""], None, "invalid event id"),
    (["gh", "--id", "a b"], None, "invalid event id"),
    (["gh", "--id", "1", "--type", "pu sh"], None, "invalid event type"),
    (["gh", "--id", "1", "--payload", "@/nonexistent/file"], None, "cannot read"),
], ids=["bad-json", "too-large", "too-deep", "bad-source", "empty-id", "bad-id", "bad-type",
        "missing-file"])
def test_bad_event_input_is_one_line_exit_2_and_records_nothing(
        procs: Procs, args: list[str], env: dict[str, str] | None, says: str) -> None:
    line = _exits_2(procs, "events", "send", *args, env=env)
    assert says in line
    assert _client(procs).dbsize() == 0  # nothing recorded, not even the deployment's meta



def _without_source(procs: Procs) -> tuple[list[str], dict[str, str]]:
    """The argv prefix and environment of a process that imports no workflow code."""
    argv = procs.base_argv()
    assert argv[-2] == "--source"
    return argv[:-2], {k: v for k, v in procs.env.items() if k != "MARBLES_SOURCE"}


SEND_WITHOUT_SOURCE = """
import json
import marbles_rq as mr
from marbles_rq.triggers.events import TRIGGERS
c = mr.connect()
out = {}
for source, id, type in (("gh", "far-1", "push"), ("gh", "far-2", "issue"),
                         ("stripe", "far-3", None)):
    sent = c.send_event(source, id, type, {"from": id})
    out[id] = [sent.state, sent.workflow, sent.run_id]
assert not TRIGGERS.by_key, "this process was to import no trigger"
print(json.dumps(out))
"""


def test_a_sender_without_the_source_starts_the_trigger_the_workers_declared(
        procs: Procs) -> None:
    """Another service (the client, and `events send` without --source): the triggers the
    worker declared decide, as the sender's own would; an event no trigger matches anywhere
    is journaled as unmatched, not refused."""
    argv, env = _without_source(procs)
    procs.start(workers=1)
    done = subprocess.run([sys.executable, "-c", SEND_WITHOUT_SOURCE], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    keys = {i: event_key("gh", i) for i in ("far-1", "far-2", "far-4")}
    assert json.loads(done.stdout) == {
        "far-1": ["started", "t_on_push", keys["far-1"]],
        "far-2": ["started", "t_on_any", keys["far-2"]],
        "far-3": ["unmatched", "", ""]}
    cli = subprocess.run([*argv, "events", "send", "gh", "--id", "far-4", "--type", "push",
                          "--payload", '{"from": "far-4"}'], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert f"event {keys['far-4']} received; run {keys['far-4']} queued (t_on_push)" \
        in cli.stdout
    for event_id, key in keys.items():
        view = procs.observer.wait_status(key, "succeeded", timeout=60)
        assert view.record.name == ("t_on_any" if event_id == "far-2" else "t_on_push")
        assert view.record.origin == "event"
    assert sorted(m["payload"]["from"] for m in _markers(procs)) == ["far-1", "far-2", "far-4"]
    listed = {e["id"]: e["state"] for e in _events_json(procs)}
    assert listed == {"far-1": "started", "far-2": "started", "far-3": "unmatched",
                      "far-4": "started"}


def test_own_triggers_decide_their_sources_and_the_declared_ones_the_others(
        procs: Procs) -> None:
    """A sender whose triggers name other sources matches the rest against the declared
    ones and records their runs with the declared defaults; for a source its triggers name,
    they alone decide (the declared trigger of that source is not consulted)."""
    procs.start(workers=1)
    mine = Triggers({("gh", "release"): Trigger("gh", "release", "t_on_push")})
    events = Events(RunStore(open_store(procs.url)), rq_connection(procs.url),
                    registry=Registry(), triggers=mine)
    elsewhere = Events(RunStore(open_store(procs.url)), rq_connection(procs.url),
                       registry=Registry(), triggers=Triggers(
                           {("other", None): Trigger("other", None, "nope")}))
    far = elsewhere.send("gh", "mixed-1", type="push", payload=b'{"from": "mixed-1"}')
    assert (far.state, far.workflow) == ("started", "t_on_push")
    assert procs.observer.wait_status(far.run_id, "succeeded", timeout=60).record.name \
        == "t_on_push"
    # "gh" is this sender's: its triggers name no "gh/push", so the event goes unmatched.
    own = events.send("gh", "mixed-2", type="push")
    assert (own.state, own.workflow, own.run_id) == ("unmatched", "", "")
    assert events.runs.get(own.key) is None


def test_a_pending_event_becomes_a_run_by_a_controller_without_the_source(
        procs: Procs) -> None:
    """The sender (no source) died after the journal; the controller (no source either)
    records the run with the defaults the worker declared, at once rather than retrying."""
    argv, env = _without_source(procs)
    procs.worker()
    events = Events(RunStore(open_store(procs.url)), registry=Registry(),
                    triggers=Triggers({}))
    record, trigger = events.prepare("gh", "orphan-far", type="push", payload=b'"far"')
    assert trigger is not None and trigger.workflow == "t_on_push"
    assert events.journal(record, trigger).state == "pending"
    ctl = Proc("controller", [*argv, "controller", "--interval", "0.2"],
               procs.dir / "controller-nosource.log", env)
    procs.procs.append(ctl)
    ctl.wait_log("elected controller")
    view = procs.observer.wait_status(record.id, "succeeded", timeout=60)
    assert view.record.name == "t_on_push"
    assert "retrying" not in ctl.text()
    assert [m["payload"] for m in _markers(procs)] == ["far"]


def test_events_past_their_retention_are_pruned_but_pending_ones_stay(redis_url: str) -> None:
    from marbles_rq.controller import Controller
    from marbles_rq.transport.dispatch import rq_connection
    from marbles_rq.triggers.events import EventsDuty

    rq = rq_connection(redis_url)
    events = Events(RunStore(open_store(redis_url)), rq)
    done = mr.send_event(events.runs, rq, "stripe", "evt_1")  # the top-level helper
    started = events.send("gh", "p-1", type="push")
    record, trigger = events.prepare("gh", "p-2", type="push")
    pending = events.journal(record, trigger)
    assert (done.state, started.state, pending.state) == ("unmatched", "started", "pending")

    duty = EventsDuty(retention_s=0)
    ctl = Controller(events.runs, rq, duties=[duty])
    assert ctl.lead()
    assert duty.prune(ctl) == 2
    assert [v.key for v in events.recent()] == [pending.key]
    client = events.store.client
    assert not client.exists(events.keys.event(done.key), events.keys.event(started.key))
    # Past the retention a resend is new again; its run id is the same, so a run that is
    # still kept is not recorded twice.
    again = events.send("gh", "p-1", type="push")
    assert again.created and again.run_id == started.run_id and not again.run_created


def test_the_declared_triggers_work_on_a_cluster(cluster_url: str, redis_url: str) -> None:
    """Declaring, and matching against the declared triggers, read and write one key of the
    deployment's tag; the journal script stays in the event's slot (no CROSSSLOT). RQ on a
    server of its own, as MARBLES_RQ_URL puts it."""
    from marbles_rq.engine.authoring import REGISTRY
    from marbles_rq.engine.catalog import declare
    from marbles_rq.triggers.events import TRIGGERS, declare_triggers

    runs = RunStore(open_store(cluster_url))
    declare(runs.client, runs.keys, REGISTRY)
    declare_triggers(runs.client, runs.keys, TRIGGERS)
    events = Events(runs, rq_connection(redis_url), registry=Registry(),
                    triggers=Triggers({}))
    sent = events.send("gh", "cl-1", type="push", payload=b"1")
    assert (sent.state, sent.workflow, sent.run_created) == ("started", "t_on_push", True)
    view = runs.get(sent.run_id)
    assert view is not None and view.record.name == "t_on_push"
    assert events.send("nobody", "cl-2").state == "unmatched"
