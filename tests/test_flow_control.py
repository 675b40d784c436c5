"""Flow control with real processes (flow/limits.py): concurrency limits held in the store
across a fleet of workers, per key, through a kill -9 of a slot's holder; priorities; bad
input refused before anything is written. The slot scripts' own semantics are checked first,
on a server and on a 3-master cluster.

Every wait is on an event (a run's status, a Redis list, a hold leaving the store); the
only time-based condition is the documented band refresh (BAND_REFRESH_S) in the priority
test, which is waited out by the clock, not slept over hopefully.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from marbles_rq.engine.authoring import load_source
from marbles_rq.engine.ops import RunRequest, enqueue_many
from marbles_rq.engine.runs import RunStore
from marbles_rq.flow import limit_specs, limits
from marbles_rq.store import open_store
from marbles_rq.store.keys import Keyspace
from marbles_rq.transport.lean import BAND_REFRESH_S
from tests import flowctl_workflows as fw
from tests.procs import DEFAULT_LEASE_MS, Procs, _cli_argv, descendants, wait_for

FLOW_SOURCE = Path(__file__).with_name("flowctl_workflows.py")
PROCS_SOURCES = (FLOW_SOURCE,)
PREFIX = "mrq"


@pytest.fixture(autouse=True)
def _registry() -> None:
    load_source(str(FLOW_SOURCE))  # the test process enqueues these workflows itself


def _enqueue(url: str, requests: list[RunRequest]) -> None:
    runs = RunStore(open_store(url))
    conn = redis.Redis.from_url(url)
    try:
        for done in enqueue_many(runs, conn, requests):
            assert done.created, done
    finally:
        conn.close()
        runs.client.close()


def _slots_key(name: str, label: str = "") -> str:
    return Keyspace(prefix=PREFIX).limit_slots(limit_specs.limit_id(name, label))


class HolderWatch(threading.Thread):
    """Polls the store: the most live holds (expiry after the server's now) each limit's
    slots zset ever had at once, and every run id seen holding one."""

    def __init__(self, url: str, keys: list[str]) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=3)
        self.keys = keys
        self.most = dict.fromkeys(keys, 0)
        self.seen: set[str] = set()
        self.polls = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.time()
                for key in self.keys:
                    pipe.zrange(key, 0, -1, withscores=True)
                (sec, usec), *sets = pipe.execute()
            except redis.RedisError:
                continue
            now_ms = sec * 1000 + usec // 1000
            for key, members in zip(self.keys, sets, strict=True):
                live = [m for m, expiry in members if expiry > now_ms]
                self.most[key] = max(self.most[key], len(live))
                self.seen.update(live)
            self.polls += 1
            self._halt.wait(0.005)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def _spans(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(s) for s in client.lrange(fw.SPANS, 0, -1)]


def _most_overlapping(spans: list[dict[str, Any]]) -> int:
    """The most bodies that ran at the same instant, from their own start and end times."""
    edges = sorted([(s["start"], 1) for s in spans] + [(s["end"], -1) for s in spans],
                   key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


# --------------------------------------------------------------------------------------------
# the slot scripts


def _slot_calls(url: str, prefix: str) -> None:
    store = open_store(url, prefix=prefix)
    scripts, keys = store.scripts, store.keys
    lim = dict(slots_key=keys.limit_slots("t"), holders_key=keys.limit_holders("t"))

    def acquire(run: str, attempt: int, token: str, limit: int = 2, ttl: int = 10_000) -> Any:
        return scripts.acquire_slot(**lim, run_id=run, attempt=attempt, token=token,
                                    limit=limit, ttl_ms=ttl)

    assert acquire("a", 1, "ta").status == "ok"
    assert acquire("b", 1, "tb").status == "ok"
    full = acquire("c", 1, "tc")
    assert (full.status, int(full.values[0])) == ("full", 2)
    # a resend, and a duplicate delivery of the same attempt: ok, the holder's token kept
    assert acquire("a", 1, "other").status == "ok"
    assert scripts.release_slot(**lim, run_id="a", holder="1|other") == "not_held"
    # a newer delivery of a run replaces the older one's hold; the older is then stale
    assert acquire("b", 2, "tb2").status == "ok"
    assert acquire("b", 1, "tb").status == "stale"
    assert scripts.renew_slot(**lim, run_id="b", attempt=1, token="tb",
                              ttl_ms=10_000, limit=2).status == "stale"
    assert scripts.release_slot(**lim, run_id="b", holder="1|tb") == "not_held"
    assert scripts.release_slot(**lim, run_id="b", holder="2|tb2") == "ok"
    assert scripts.release_slot(**lim, run_id="b", holder="2|tb2") == "not_held"  # resent
    assert acquire("c", 1, "tc").status == "ok"
    # the controller frees a vanished delivery's hold whatever its token
    assert scripts.release_slot(**lim, run_id="c", holder="2|*") == "not_held"
    assert scripts.release_slot(**lim, run_id="c", holder="1|*") == "ok"
    # an expired hold is pruned by the next acquire and no longer counted
    assert acquire("d", 1, "td", ttl=1).status == "ok"
    time.sleep(0.005)  # the hold's 1 ms expiry passes on the server's clock
    assert acquire("e", 1, "te").status == "ok"
    assert sorted(m.decode() for m in store.client.zrange(lim["slots_key"], 0, -1)) == ["a", "e"]
    # a renewal does not re-take an expired hold while every slot is held (its lease,
    # capped at the hold's expiry, has expired too: the execution is fenced) ...
    lost = scripts.renew_slot(**lim, run_id="d", attempt=1, token="td", ttl_ms=10_000, limit=2)
    assert (lost.status, int(lost.values[0])) == ("lost", 2)
    assert store.client.zscore(lim["slots_key"], "d") is None
    # ... and does when a slot is free (counted again)
    assert scripts.release_slot(**lim, run_id="e", holder="1|te") == "ok"
    renewed = scripts.renew_slot(**lim, run_id="d", attempt=1, token="td", ttl_ms=10_000,
                                 limit=2)
    assert (renewed.status, int(renewed.values[0])) == ("ok", 1)


def test_slot_scripts(redis_url: str) -> None:
    _slot_calls(redis_url, "slots1")


def test_slot_scripts_on_a_cluster(cluster_url: str) -> None:
    """Each limit is one hash tag: the scripts run on a cluster with no cross-slot call."""
    _slot_calls(cluster_url, "slots2")


def test_hold_hands_the_run_back_not_counted(redis_url: str) -> None:
    """A delivery that finds its limit full: the run is queued again as a new delivery, not
    started, its hold counted as a deferral (not against max_deliveries), status says why,
    and a long wait is one output line."""
    store = open_store(redis_url, prefix="hold1")
    runs = RunStore(store)
    request = RunRequest("solo", b'{"sleep_s": 0}', "h1")
    from marbles_rq.engine.ops import prepare

    runs.record(prepare(request))
    assert store.client.hget(store.keys.run("h1"), "limit") is not None
    started = runs.start("h1", 1, ttl_ms=2000, worker="w")
    assert started.status == "needs_slot" and started.execution is None
    for attempt in (1, 2, 3):
        reply = store.scripts.hold_run(
            keys=store.keys.run_keys("h1"), run_id="h1", attempt=attempt, base_ms=250,
            cap_ms=2000, jitter=1.0, note="concurrency limit solo 1/1", event=b"{}")
        assert reply.status == "ok" and int(reply.values[0]) == attempt + 1
    assert [int(v) for v in [reply.values[1]]] == [562]  # 250 x 1.5^2
    assert store.scripts.hold_run(
        keys=store.keys.run_keys("h1"), run_id="h1", attempt=1, base_ms=250, cap_ms=2000,
        jitter=1.0, note="x", event=b"{}").status == "moved"
    view = runs.get("h1")
    # Holds are deliveries, not attempts: nothing failed.
    assert view is not None and (view.status, view.delivery, view.attempt) == ("queued", 4, 1)
    assert view.note == "concurrency limit solo 1/1"
    fields = store.client.hmget(store.keys.run("h1"), "deferred", "epoch")
    assert fields == [b"3", b"0"]  # deferrals; never started
    assert [e.type for e in runs.output("h1")] == ["queued", "held"]


# --------------------------------------------------------------------------------------------
# a limit of 2 across 4 workers


@pytest.mark.parametrize("pool", [None, 4], ids=["4-forking-workers", "pool-4"])
def test_limit_holds_across_workers(procs: Procs, pool: int | None) -> None:
    procs.start(workers=1 if pool else 4, pool=pool)
    key = _slots_key("limited")
    watch = HolderWatch(procs.url, [key])
    watch.start()
    ids = [f"lim-{i}" for i in range(12)]
    try:
        _enqueue(procs.url, [RunRequest("limited", b'{"sleep_s": 0.4}', rid) for rid in ids])
        for rid in ids:
            procs.observer.wait_status(rid, "succeeded", timeout=120)
    finally:
        watch.stop()
    spans = _spans(procs.observer.client)
    assert sorted(s["run"] for s in spans) == sorted(ids)  # each body ran once, all finished
    assert watch.polls > 100 and watch.seen == set(ids)
    print(f"most holders seen in the store: {watch.most[key]} ({watch.polls} polls); most "
          f"bodies overlapping: {_most_overlapping(spans)}; executors used: "
          f"{len({s['pid'] for s in spans})}")
    assert watch.most[key] <= 2
    assert _most_overlapping(spans) <= 2
    assert _most_overlapping(spans) == 2  # the limit is used, not just never exceeded
    held = [rid for rid in ids if any(e.type == "held" for e in procs.observer.events(rid))]
    assert held, "no run ever found the limit full: the test did not exercise it"
    # every hold was a deferral: the runs' deliveries that counted stayed at one
    client = procs.observer.client
    for rid in ids:
        attempt, deferred = client.hmget(f"{Keyspace(prefix=PREFIX).run(rid)}", "attempt",
                                         "deferred")
        assert int(attempt) - int(deferred or 0) == 1, rid
    # every hold released at settle
    assert client.zcard(key) == 0, client.zrange(key, 0, -1, withscores=True)


def test_limit_per_key(procs: Procs) -> None:
    """Limit 1 per customer: runs of different customers overlap, of one customer never."""
    procs.start(workers=1, pool=3)
    keys = [_slots_key("per_customer", f"customer={c}") for c in ("acme", "bolt")]
    watch = HolderWatch(procs.url, keys)
    watch.start()
    ids = {f"pk-{c}-{i}": c for c in ("acme", "bolt") for i in range(3)}
    try:
        _enqueue(procs.url, [RunRequest("per_customer", json.dumps(
            {"sleep_s": 0.6, "customer": c}).encode(), rid) for rid, c in ids.items()])
        for rid in ids:
            procs.observer.wait_status(rid, "succeeded", timeout=120)
    finally:
        watch.stop()
    spans = _spans(procs.observer.client)
    assert sorted(s["run"] for s in spans) == sorted(ids)
    by = {c: [s for s in spans if ids[s["run"]] == c] for c in ("acme", "bolt")}
    assert _most_overlapping(by["acme"]) == 1 and _most_overlapping(by["bolt"]) == 1
    assert max(watch.most.values()) == 1
    assert any(_overlap(a, b) for a in by["acme"] for b in by["bolt"])
    view = procs.observer.view("pk-acme-0")
    assert view is not None
    assert view.to_json()["concurrency"] == {"limit": 1, "key": "customer=acme"}


# --------------------------------------------------------------------------------------------
# kill -9 of a worker holding a slot


def test_kill_of_a_slot_holder(procs: Procs) -> None:
    """Limit 1, three runs (priority 3), two workers. The worker executing the holder is
    killed mid-step: its hold leaves the store (released when the controller redelivers the
    lost worker's run, at the latest when it expires with the lease), the waiting runs
    proceed, the killed run is redelivered on its priority band and finishes; nothing is
    lost, no finished step runs again, every effect once, and the limit held throughout."""
    workers = procs.start(workers=2)
    key = _slots_key("solo")
    watch = HolderWatch(procs.url, [key])
    watch.start()
    ids = ["k-0", "k-1", "k-2"]
    obs = procs.observer
    try:
        _enqueue(procs.url, [RunRequest("solo", b'{"sleep_s": 1.5}', rid, priority=3)
                             for rid in ids])
        first = json.loads(obs.wait_list(fw.SLEEPING, lambda xs: len(xs) >= 1,
                                         what="a holder in its sleep")[0])
        victim = next(w for w in workers if first["pid"] in descendants(w.pid))
        holds = obs.client.zrange(key, 0, -1, withscores=True)
        assert [m for m, _ in holds] == [first["run"]]
        killed_at = time.monotonic()
        victim.kill9()
        holders = Keyspace(prefix=PREFIX).limit_holders(limit_specs.limit_id("solo", ""))

        def killed_hold_gone() -> bool:
            """The killed delivery no longer holds a live slot: released, taken over by
            the run's next delivery, or expired."""
            holder = obs.client.hget(holders, first["run"]) or ""
            expiry = obs.client.zscore(key, first["run"])
            sec, usec = obs.client.time()
            return (not holder.startswith(f"{first['attempt']}|") or expiry is None
                    or expiry <= sec * 1000 + usec // 1000)

        wait_for(killed_hold_gone, timeout=DEFAULT_LEASE_MS / 1000 + 8,
                 what="the killed holder's hold to go")
        freed_s = time.monotonic() - killed_at
        for rid in ids:
            obs.wait_status(rid, "succeeded", timeout=90)
    finally:
        watch.stop()
    print(f"the killed holder's hold left the store {freed_s:.2f} s after the kill")
    assert watch.most[key] <= 1
    assert obs.client.smembers(fw.RECEIPTS) == {f"{rid}:solo.effect#{i}"
                                               for rid in ids for i in (0, 1)}
    execs = obs.client.lrange(fw.EXECS, 0, -1)
    for rid in ids:
        assert sum(1 for e in execs if e.startswith(f"{rid}|0|")) == 1  # finished: not again
        tries = sum(1 for e in execs if e.startswith(f"{rid}|1|"))
        assert tries == (2 if rid == first["run"] else 1), (rid, execs)
    view = obs.view(first["run"])
    assert view is not None and view.delivery > first["attempt"]  # run.attempt: a delivery
    assert obs.client.hget(Keyspace(prefix=PREFIX).run(first["run"]), "queue") == "default~3"
    assert any(e.type == "redelivered" for e in obs.events(first["run"]))
    assert obs.client.zcard(key) == 0, obs.client.zrange(key, 0, -1, withscores=True)


# --------------------------------------------------------------------------------------------
# priorities


def test_priorities_high_before_low(procs: Procs) -> None:
    """One worker, busy: low runs enqueued first, then high ones (the CLI's --priority,
    RunRequest(priority=...), a workflow's default): the high ones start first, highest
    band first, each band in order."""
    procs.start(workers=1)
    obs = procs.observer
    _enqueue(procs.url, [RunRequest("blocker", b"null", "p-block")])
    obs.wait_list(fw.STARTS, lambda xs: xs == ["p-block"], what="the blocker to start")
    blocked_at = time.monotonic()
    _enqueue(procs.url, [RunRequest("ordered", b"null", f"p-low-{i}") for i in range(3)])
    _enqueue(procs.url, [RunRequest("ordered", b"null", "p-high-0", priority=5)])
    done = procs.cli("enqueue", "ordered", "--id", "p-high-1", "--priority", "5")
    assert done.returncode == 0, done.stderr
    _enqueue(procs.url, [RunRequest("urgent", b"null", "p-urgent")])  # its default: 7
    queues = obs.client.smembers("rq:queues")
    assert {"rq:queue:mrq.default", "rq:queue:mrq.default~5",
            "rq:queue:mrq.default~7"} <= queues
    info = subprocess.run([str(Path(sys.executable).parent / "rq"), "info", "--only-queues",
                           "-u", procs.url], capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    assert "mrq.default~5" in info.stdout and "mrq.default~7" in info.stdout, info.stdout
    # The deployment's prefix is still everything before a band's last '.' (the delivery
    # id checks and MarblesIntermediateQueue.cleanup rely on it).
    assert limit_specs.band_queue("mrq.default", 5).rpartition(".")[0] == "mrq"
    # The worker reads which bands exist at most every BAND_REFRESH_S: the blocker started
    # (its pop read them) before the bands existed, so hold it that long.
    wait_for(lambda: time.monotonic() - blocked_at > BAND_REFRESH_S + 0.2,
             timeout=BAND_REFRESH_S + 5, what="one band refresh interval")
    obs.client.set(fw.GATE, "1")
    order = obs.wait_list(fw.STARTS, lambda xs: len(xs) == 7, what="every run to start")
    assert order == ["p-block", "p-urgent", "p-high-0", "p-high-1", "p-low-0", "p-low-1",
                     "p-low-2"]
    view = obs.view("p-high-1")
    assert view is not None and view.to_json()["priority"] == 5
    assert obs.client.hget(Keyspace(prefix=PREFIX).run("p-high-1"), "queue") == "default~5"


# --------------------------------------------------------------------------------------------
# bad input


def test_bad_input_is_refused_before_anything_is_written(procs: Procs, tmp_path: Path) -> None:
    client = procs.observer.client
    before = set(client.keys("*"))  # the observer's own: the deployment's bucket count
    cases: list[tuple[list[str], str]] = [
        (["enqueue", "ordered", "--priority", "x"], "'x' is not a valid integer"),
        (["enqueue", "ordered", "--priority", "101"], "invalid priority 101"),
        (["enqueue", "ordered", "--priority", "-101"], "invalid priority -101"),
        (["enqueue", "per_customer", "--input", '{"sleep_s": 1}'], "the input does not have"),
        (["enqueue", "limited", "--input", '{"sleep_s": 1}', "--priority", "1000"],
         "invalid priority 1000"),
        (["enqueue", "per_customer", "--input", '{"customer": [1]}'],
         "must be a string or a whole number, not list"),
    ]
    for args, needle in cases:
        done = procs.cli(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert needle in done.stderr and done.stderr.count("\n") == 1, (args, done.stderr)
        assert set(client.keys("*")) == before, args
    bad = tmp_path / "bad_flows.py"
    for decl, needle in [("concurrency=0", "invalid concurrency 0"),
                         ("concurrency_key='customer'", "concurrency_key needs concurrency"),
                         ("priority=500", "invalid priority 500"),
                         ("concurrency=True", "invalid concurrency True")]:
        bad.write_text(f"import marbles_rq as mr\n\n@mr.workflow({decl})\n"
                       f"def bad(ctx, inp: dict) -> None: ...\n")
        done = subprocess.run([*_cli_argv(), "--redis-url", procs.url, "--source", str(bad),
                               "enqueue", "bad"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (decl, done.stderr)
        assert needle in done.stderr and done.stderr.count("\n") == 1, (decl, done.stderr)
        assert set(client.keys("*")) == before, decl


def test_no_renewal_after_release(redis_url: str) -> None:
    """A renewal from the watchdog's thread that lands after the execution released its slot
    does not take it again (a renewal re-takes an expired hold)."""
    store = open_store(redis_url, prefix="rel1")
    runs = RunStore(store)
    limit = limits.Limit(1, "x", "x")
    slot = limits.Slot(runs, limit, "r1", 1, "tok", 10_000)
    keys = dict(slots_key=store.keys.limit_slots("x"), holders_key=store.keys.limit_holders("x"))
    assert store.scripts.acquire_slot(**keys, run_id="r1", attempt=1, token="tok", limit=1,
                                      ttl_ms=10_000).status == "ok"
    slot.renew()
    assert store.client.zcard(keys["slots_key"]) == 1
    slot.release()
    slot.renew()  # too late: nothing
    slot.release()  # twice: nothing
    assert store.client.zcard(keys["slots_key"]) == 0
    assert store.client.hlen(keys["holders_key"]) == 0
