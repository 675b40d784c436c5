"""Buckets that scale: layout 2 (1,024 buckets whose tags spread evenly over cluster slots),
existing deployments adopted as recorded, and `buckets grow` (offline, resumable)."""

from __future__ import annotations

import bisect
import json
import math
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot

import marbles_rq as mr
from marbles_rq.engine import ops
from marbles_rq.engine.ops import RunRequest
from marbles_rq.engine.runs import RunStore
from marbles_rq.errors import BucketMismatchError, GrowInProgressError
from marbles_rq.store import keys as K
from marbles_rq.store import open_store
from marbles_rq.store.connection import connect
from marbles_rq.store.keys import Keyspace, slot_range
from marbles_rq.transport.dispatch import rq_connection
from tests.procs import REPO_ROOT, Procs, wait_for
from tests.redis_procs import RedisCluster

GROW_SOURCE = Path(__file__).parent / "grow_workflows.py"


@mr.workflow
def bk_noop(ctx: mr.RunContext) -> None:
    return None


@mr.workflow("g_ok", version="1")
def _g_ok_here(ctx: mr.RunContext, inp: Any = None) -> None:
    """Only its name, input schema and version matter here (enqueued in-process, run by
    workers that load tests/grow_workflows.py, whose g_ok declares the same version: a
    stub's own fingerprint would name code no worker has)."""


def redis_cli_slots(masters: int) -> list[int]:
    """First slot of each master, as `redis-cli --cluster create` assigns them (redis-cli.c
    clusterManagerCommandCreate: contiguous ranges of 16384/N slots, rounded)."""
    per, first, cursor, starts = K.SLOTS / masters, 0, 0.0, []
    for i in range(masters):
        last = round(cursor + per - 1)
        if last > K.SLOTS - 1 or i == masters - 1:
            last = K.SLOTS - 1
        last = max(last, first)
        starts.append(first)
        first, cursor = last + 1, cursor + per
    return starts


def per_master(slots: list[int], starts: list[int]) -> list[int]:
    counts = [0] * len(starts)
    for slot in slots:
        counts[bisect.bisect_right(starts, slot) - 1] += 1
    return counts


# -- layout 2: pure ---------------------------------------------------------------------------


def test_layout2_tags_land_in_their_slot_ranges_and_layout1_is_unchanged() -> None:
    for buckets in (1, 7, 64, 1000, 1024, 4096):
        keys = Keyspace(buckets=buckets)
        for b in range(buckets):
            assert key_slot(f"{keys.tag(b)}:run:x".encode()) in slot_range(b, buckets)
        assert len(set(keys.tags())) == buckets
    old = Keyspace(buckets=64, layout=1)
    assert old.tag(5) == "{mrq:b0005}"
    assert old.run("order-42") == f"{{mrq:b{zlib.crc32(b'order-42') % 64:04d}}}:run:order-42"
    # Tags name their bucket count: a growth never moves a key onto a name in use.
    assert not set(Keyspace(buckets=1024).tags()) & set(Keyspace(buckets=2048).tags())
    assert Keyspace().buckets == 1024 and Keyspace().layout == 2


def test_busiest_master_holds_the_fewest_buckets_possible_for_3_to_64_masters() -> None:
    keys = Keyspace()
    slots = [key_slot(keys.tag(b).encode()) for b in range(keys.buckets)]
    old = Keyspace(buckets=64, layout=1)
    old_slots = [key_slot(old.tag(b).encode()) for b in range(64)]
    rows = []
    for masters in range(3, 65):
        counts = per_master(slots, redis_cli_slots(masters))
        mean = keys.buckets / masters
        best = math.ceil(mean)  # the pigeonhole: some master holds at least this many
        assert max(counts) == best, (masters, counts)
        assert min(counts) >= math.floor(mean), (masters, counts)
        ratio = max(counts) / mean
        # <= 1.05 wherever the pigeonhole allows it (all but 60 masters: 18/17.07 = 1.055).
        assert ratio <= max(1.05, best / mean) + 1e-9
        old_ratio = max(per_master(old_slots, redis_cli_slots(masters))) / (64 / masters)
        rows.append(f"{masters:2d} masters: max {max(counts):3d} mean {mean:7.2f} "
                    f"max/mean {ratio:.3f} (layout 1, 64 buckets: {old_ratio:.2f})")
    print("\n".join(rows))


def test_lane_rq_prefix_sits_with_its_buckets_when_lanes_are_masters() -> None:
    for masters in range(2, 65):
        keys = Keyspace(lanes=masters)
        starts = redis_cli_slots(masters)
        for lane in range(masters):
            prefix = keys.lane_rq_prefix(lane)
            assert prefix is not None
            slot = key_slot(f"{prefix}:queue:x".encode())
            first = keys.lane_buckets(lane)
            assert slot_range(first.start, keys.buckets).start <= slot \
                < slot_range(first.stop - 1, keys.buckets).stop
            master = bisect.bisect_right(starts, slot) - 1
            assert master == lane, (masters, lane, slot)
            # All the lane's buckets but at most one at each end (where a master's slot range
            # and the lane's bucket range round differently) are on the lane's master.
            on = [bisect.bisect_right(starts, key_slot(keys.tag(b).encode())) - 1
                  for b in first]
            inner = on[1:-1] if len(on) > 2 else []
            assert set(inner) <= {lane} and set(on) <= {lane - 1, lane, lane + 1}, \
                (masters, lane, on)
    assert Keyspace().lane_rq_prefix(0) is None
    assert Keyspace(buckets=64, lanes=2, layout=1).lane_rq_prefix(1) == "{mrq:lane001}"


def test_tag_table_costs_milliseconds_per_process() -> None:
    K._v2_tags.cache_clear()
    started = time.perf_counter()
    Keyspace(prefix="costly", buckets=4096)
    t4096 = time.perf_counter() - started
    started = time.perf_counter()
    Keyspace(prefix="costly")
    t1024 = time.perf_counter() - started
    print(f"layout 2 tag table: 1024 buckets {t1024 * 1e3:.2f} ms, 4096 buckets "
          f"{t4096 * 1e3:.2f} ms (once per process and prefix)")
    assert t1024 < 0.5  # a guard against a search creeping in (it would take seconds)


# -- the real cluster ---------------------------------------------------------------------------


def test_cluster_keys_per_master_after_thousands_of_runs(redis_cluster: RedisCluster,
                                                         cluster_url: str,
                                                         redis_url: str) -> None:
    runs = RunStore(open_store(cluster_url))
    assert runs.keys.buckets == 1024 and runs.keys.layout == 2
    assert runs.keys.lanes == 3  # one lane per master, at creation on a cluster
    rq = rq_connection(redis_url)
    n = 4000
    for start in range(0, n, 500):
        ops.enqueue_many(runs, rq, [RunRequest("bk_noop", b"null", f"spread-{i}")
                                    for i in range(start, start + 500)])
    sizes = [node.client().dbsize() for node in redis_cluster.nodes]
    mean = sum(sizes) / len(sizes)
    print(f"keys per master after {n} runs: {sizes}, max/mean {max(sizes) / mean:.3f}")
    assert max(sizes) <= 1.05 * mean, sizes


# -- adopting what a deployment recorded --------------------------------------------------------


def mrq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("MARBLES_BUCKETS", "MARBLES_LANE_COUNT", "MARBLES_PREFIX",
                         "MARBLES_RQ_URL")}
    return subprocess.run([sys.executable, "-m", "marbles_rq", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT, env={**base, **(env or {})},
                          stdin=subprocess.DEVNULL)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_a_new_deployment_records_its_layout_and_an_old_one_is_adopted(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    store = open_store(redis_url)
    assert client.hgetall("{mrq}:meta") == {b"buckets": b"1024", b"layout": b"2",
                                            b"lanes": b"1"}
    assert (store.keys.buckets, store.keys.layout, store.keys.lanes) == (1024, 2, 1)

    # A deployment made before layout 2, exactly as the old code wrote its meta.
    client.hset("{old}:meta", mapping={"buckets": "64", "layout": "1"})
    old = open_store(redis_url, prefix="old")
    assert (old.keys.buckets, old.keys.layout, old.keys.lanes) == (64, 1, 1)
    assert old.keys.tag(3) == "{old:b0003}"
    assert open_store(redis_url, prefix="old", buckets=64, lanes=1).keys == old.keys
    with pytest.raises(BucketMismatchError, match="created with 64 buckets"):
        open_store(redis_url, prefix="old", buckets=1024)
    with pytest.raises(BucketMismatchError, match="lanes 4"):
        open_store(redis_url, prefix="old", lanes=4)
    assert client.hgetall("{old}:meta") == {b"buckets": b"64", b"layout": b"1"}  # untouched

    given = mrq("--redis-url", redis_url, "--prefix", "old", "--buckets", "1024", "runs")
    assert given.returncode == 2
    assert "was created with 64 buckets" in one_line(given) and "--buckets" in one_line(given)
    lanes = mrq("--redis-url", redis_url, "--prefix", "old", "runs",
                env={"MARBLES_LANE_COUNT": "2"})
    assert lanes.returncode == 2 and "MARBLES_LANE_COUNT" in one_line(lanes)
    assert mrq("--redis-url", redis_url, "--prefix", "old", "runs").returncode == 0
    shown = mrq("--redis-url", redis_url, "--prefix", "old", "buckets", "show", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["buckets"] == 64

    # Reading commands on a fresh prefix write nothing, whatever they were given.
    fresh = mrq("--redis-url", redis_url, "--prefix", "fresh", "--buckets", "8", "runs")
    assert fresh.returncode == 0, fresh.stderr
    nothing = mrq("--redis-url", redis_url, "--prefix", "fresh", "buckets", "show")
    assert nothing.returncode == 1 and not client.exists("{fresh}:meta")
    bad = mrq("--redis-url", redis_url, "--lane-count", "0", "runs")
    assert bad.returncode == 2 and "invalid lane count 0" in one_line(bad)


def test_a_cluster_deployment_gets_one_lane_per_master(cluster_url: str) -> None:
    store = open_store(cluster_url)
    assert store.keys.lanes == 3
    assert open_store(cluster_url, lanes=3).keys.lanes == 3
    with pytest.raises(BucketMismatchError):
        open_store(cluster_url, lanes=1)


# -- growing the bucket count --------------------------------------------------------------------


def _status(runs: RunStore, run_id: str) -> str | None:
    view = runs.get(run_id)
    return None if view is None else view.status


def _all(runs: RunStore) -> list[Any]:
    return runs.list_runs(limit=10_000)


def _old_keys(client: Any, keys: Keyspace) -> list[str]:
    tags = keys.tags()
    nodes = ([client.get_redis_connection(n) for n in client.get_primaries()]
             if isinstance(client, ClusterClient) else [client])
    found = []
    for node in nodes:
        for raw in node.scan_iter(match="{" + keys.prefix + ":*", count=1000):
            key = raw.decode()
            if key[:key.index("}") + 1] in tags:
                found.append(key)
    return found


def grow_scenario(tmp_path: Path, store_url: str, rq_url: str | None, client: Any) -> None:
    """A layout-1 deployment of 64 buckets with runs in every state, a schedule, an event, a
    monitor; `buckets grow --to 1024` killed with SIGKILL in the middle, rerun; then the
    CLI reads it all and a real worker and controller finish what was waiting."""
    gdir = tmp_path / "g"
    (gdir / "mon").mkdir(parents=True)
    client.hset("{mrq}:meta", mapping={"buckets": "64", "layout": "1"})  # as the old code did
    old = Keyspace(buckets=64, layout=1)
    p = Procs(store_url, tmp_path / "procs", sources=(GROW_SOURCE,))
    p.env.update(G_DIR=str(gdir))
    if rq_url:
        p.env["MARBLES_RQ_URL"] = rq_url
    runs = RunStore(open_store(store_url))
    assert runs.keys == old
    try:
        worker = p.worker()
        controller = p.controller()
        ok_ids = [f"ok-{i}" for i in range(40)]
        ops.enqueue_many(runs, rq_connection(rq_url or store_url),
                         [RunRequest("g_ok", json.dumps({"n": r}).encode(), r) for r in ok_ids])
        p.enqueue("g_fail", None, "fail-1")
        p.enqueue("g_ask", None, "ask-1")
        p.enqueue("g_sleep", 3600, "sleep-1")
        p.enqueue("g_parent", None, "parent-1")
        sent = p.cli("events", "send", "gh", "--id", "e1", "--payload", '{"x": 1}')
        assert sent.returncode == 0, sent.stderr
        (gdir / "mon" / "a.txt").write_text("a")
        # Layout 1 keys, spelled as the old code spelled them: crc32 % 64.
        assert client.exists(f"{{mrq:b{zlib.crc32(b'ok-0') % 64:04d}}}:run:ok-0")

        def settled() -> bool:
            want = {**{r: "succeeded" for r in ok_ids}, "fail-1": "failed",
                    "ask-1": "waiting", "sleep-1": "waiting", "parent-1": "waiting"}
            return all(_status(runs, r) == s for r, s in want.items()) and \
                sum(1 for v in _all(runs) if v.status == "waiting") >= 5 and \
                len([v for v in _all(runs) if v.record.name == "g_ok"]) > len(ok_ids) and \
                any(v.record.name == "g_on_event" and v.status == "succeeded"
                    for v in _all(runs))
        wait_for(settled, timeout=60, what="runs in their states", context=p.report)

        p.enqueue("g_hold", None, "hold-1")
        wait_for(lambda: _status(runs, "hold-1") == "running" and
                 client.exists(runs.keys.effect("hold-1", "hold")),
                 timeout=30, what="hold-1 running with its effect claimed", context=p.report)

        refused = p.cli("buckets", "grow", "--to", "1024")
        assert refused.returncode == 1 and "a controller leads" in refused.stderr, refused
        controller.signal(signal.SIGTERM)
        controller.wait_exit(30)
        refused = p.cli("buckets", "grow", "--to", "1024")  # the worker beats
        assert refused.returncode == 1 and "worker(s)" in refused.stderr, refused
        assert client.hget("{mrq}:meta", "grow_to") is None
        assert not client.exists(old.lease("controller"))  # its tombstone was taken back
        worker.kill9()  # hold-1 stays running, abandoned (its horse dies with the worker)
        p.enqueue("g_ok", None, "queued-1")
        assert _status(runs, "hold-1") == "running" and _status(runs, "queued-1") == "queued"
        wait_for(lambda: client.zcount("{mrq}:workers", f"({_server_ms(client)}", "+inf") == 0,
                 timeout=30, what="the killed worker's liveness lapses")

        before = {v.record.id: (v.status, v.attempt) for v in _all(runs)}
        events_before = json.loads(p.cli("events", "--json").stdout)
        schedules_before = json.loads(p.cli("schedules", "--json").stdout)
        assert [e["id"] for e in events_before] == ["e1"]
        assert [s["workflow"] for s in schedules_before] == ["g_tick"]
        # Where the controller will look for the timer and the schedule: their due times.
        due_before = (client.zscore(old.run_waits(old.bucket_of("sleep-1")), "sleep-1"),
                      client.zscore(old.schedule_due(old.bucket_of("g-tick")), "g-tick"))
        assert None not in due_before
        old_count = len(_old_keys(client, old))
        assert old_count > 300, old_count

        # SIGKILL in the middle: after its first progress line (20 of hundreds of keys).
        argv = p.cli_argv("buckets", "grow", "--to", "1024", "--progress-every", "20")
        growing = subprocess.Popen(argv, cwd=REPO_ROOT, env=p.env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        assert growing.stdout is not None
        lines = []
        while not any(line.startswith("moved") for line in lines):
            line = growing.stdout.readline()
            assert line, f"grow ended early: {lines}"
            lines.append(line)
        growing.send_signal(signal.SIGKILL)
        growing.wait(timeout=10)
        left = len(_old_keys(client, old))
        assert client.hget("{mrq}:meta", "grow_to") == b"1024"
        assert 0 < left < old_count, (left, old_count)
        print(f"grow killed with SIGKILL after {lines[-1].strip()!r}: {left} of {old_count} "
              f"old keys left")

        blocked = p.cli("status", "ok-1")
        assert blocked.returncode == 2 and "being grown" in blocked.stderr, blocked
        with pytest.raises(GrowInProgressError):
            open_store(store_url)
        shown = p.cli("buckets", "show")
        assert "growing to 1024" in shown.stdout, shown

        again = p.cli("buckets", "grow", "--to", "1024")
        assert again.returncode == 0, again.stderr
        assert "grown: 1024 buckets" in again.stdout and "resuming" in again.stdout
        assert client.hget("{mrq}:meta", "buckets") == b"1024"
        assert client.hget("{mrq}:meta", "layout") == b"2"
        assert client.hget("{mrq}:meta", "grow_to") is None
        assert _old_keys(client, old) == [old.lease("controller")]  # the tombstone only
        rerun = p.cli("buckets", "grow", "--to", "1024")
        assert rerun.returncode == 2 and "cannot grow from 1024" in rerun.stderr

        runs = RunStore(open_store(store_url))
        assert runs.keys == Keyspace()
        new = runs.keys
        assert (client.zscore(new.run_waits(new.bucket_of("sleep-1")), "sleep-1"),
                client.zscore(new.schedule_due(new.bucket_of("g-tick")), "g-tick")) == due_before
        after = {v.record.id: (v.status, v.attempt) for v in _all(runs)}
        assert after == before  # every run, once, unchanged
        assert client.exists(runs.keys.run("ok-0"))
        status = p.cli("status", "ok-3", "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["status"] == "succeeded"
        listed = p.cli("runs", "--json", "--limit", "1000")
        assert listed.returncode == 0 and len(json.loads(listed.stdout)) == len(before)
        assert p.cli("answer", "ask-1", "go", "yes").returncode == 0
        events = p.cli("events", "--json")
        assert events.returncode == 0 and json.loads(events.stdout) == events_before
        schedules = p.cli("schedules", "--json")
        assert schedules.returncode == 0 and json.loads(schedules.stdout) == schedules_before

        # A real worker and controller, with the adopted layout, finish what waited.
        (gdir / "release").write_text("go")
        p.worker()
        p.controller()
        children = [v.record.id for v in _all(runs)
                    if v.record.name == "g_ask" and v.record.id != "ask-1"]
        assert len(children) == 2, children
        for child in children:
            answered = p.cli("answer", child, "go", child)
            assert answered.returncode == 0, answered.stderr
        wait_for(lambda: all(_status(runs, r) == "succeeded" for r in
                             ("ask-1", "parent-1", "hold-1", "queued-1")),
                 timeout=60, what="waiting and queued runs finish", context=p.report)
        hold = runs.get("hold-1")
        assert hold is not None and hold.attempt == 2
        assert json.loads(p.cli("status", "hold-1", "--json").stdout)["result"] is False
        assert json.loads(p.cli("status", "ask-1", "--json").stdout)["result"] == "yes"
        assert _status(runs, "sleep-1") == "waiting"  # its timer is an hour away
        # The monitor kept its state: a new file is one more launch, the old one none.
        launches = len([v for v in _all(runs) if v.record.name == "g_ok"])
        (gdir / "mon" / "b.txt").write_text("b")
        wait_for(lambda: len([v for v in _all(runs) if v.record.name == "g_ok"
                              and v.status == "succeeded"]) == launches + 1,
                 timeout=30, what="the monitor launches once for b.txt", context=p.report)
        assert not [v for v in _all(runs) if v.status == "failed" and v.record.id != "fail-1"]
    finally:
        p.stop_all()
        print(p.report(lines=30))


def _server_ms(client: Any) -> int:
    sec, usec = client.time() if not isinstance(client, ClusterClient) else \
        client.get_redis_connection(client.get_primaries()[0]).time()
    return int(sec) * 1000 + int(usec) // 1000


def test_grow_standalone_with_a_kill_in_the_middle(tmp_path: Path, redis_url: str) -> None:
    grow_scenario(tmp_path, redis_url, None, redis.Redis.from_url(redis_url))


def test_grow_on_the_cluster_with_a_kill_in_the_middle(tmp_path: Path, cluster_url: str,
                                                       redis_url: str) -> None:
    grow_scenario(tmp_path, cluster_url, redis_url, connect(cluster_url))


def test_grow_refuses_bad_counts_and_a_missing_deployment(redis_url: str) -> None:
    nothing = mrq("--redis-url", redis_url, "buckets", "grow", "--to", "2048")
    assert nothing.returncode == 1 and "nothing to grow" in one_line(nothing)
    open_store(redis_url)
    for to in ("1024", "512", "5000"):
        bad = mrq("--redis-url", redis_url, "buckets", "grow", "--to", to)
        assert bad.returncode == 2 and "cannot grow from 1024" in one_line(bad)
    assert redis.Redis.from_url(redis_url).hget("{mrq}:meta", "buckets") == b"1024"


class _Killed(Exception):
    pass


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_grow_keeps_the_store_api_whole_across_interruptions(
        where: str, request: pytest.FixtureRequest) -> None:
    """Claims with owners (the `own:` sets name record and listing keys), journals, workspace
    entries, effect receipts (their index names receipt keys), fences and leases: a growth
    interrupted three times, then finished, leaves every read, CAS, claim and purge right."""
    from marbles_rq.store.grow import Grower
    from marbles_rq.store.records import (
        AgentRecord,
        EffectReceipt,
        EventRecord,
        JournalEntry,
        WorkspaceEntry,
    )
    from marbles_rq.store.redis_store import Lease

    url = request.getfixturevalue("redis_url" if where == "standalone" else "cluster_url")
    store = open_store(url, buckets=16)
    assert store.keys.buckets == 16
    n = 60
    for i in range(n):
        assert store.claim(EventRecord(version=1, id=f"ev:{i}", source="s"), owner="own").won
        assert store.append("jr", JournalEntry(version=1, id=f"e-{i}", type="t"),
                            owner="own").won
        assert store.compare_and_set(WorkspaceEntry(version=1, workspace_id=f"ws:{i % 7}",
                                                    key=f"k:{i}", updated_at="1"), None,
                                     owner="own").ok
        assert store.claim_effect(EffectReceipt(version=1, scope=f"run:{i}", key=f"x:{i}"),
                                  epoch=3).won
    assert store.provision(AgentRecord(version=1, id="ag", definition_id="d",
                                       provisioning_key="pk")).created
    lease = store.acquire_lease("job-lock", "tok", 600_000)
    assert isinstance(lease, Lease)
    store.client.hset(store.keys.scope_fence("run:5"), "epoch", "3")  # as a run's attempt 3

    steps = []

    def interrupt_after(limit: int) -> Any:
        def progress(line: str) -> None:
            steps.append(line)
            if line.startswith("moved") and len([s for s in steps if "moved" in s]) >= limit:
                raise _Killed(line)
        return progress

    client = store.client
    for limit in (1, 2, 3):  # each run moves a few more keys, then "dies"
        with pytest.raises(_Killed):
            Grower(client, "mrq", 64, progress=interrupt_after(limit), progress_every=7).run()
        steps.clear()
    moved = Grower(client, "mrq", 64, progress=steps.append, progress_every=1000).run()
    assert moved > 4 * n

    grown = open_store(url)
    assert (grown.keys.buckets, grown.keys.layout) == (64, 2)
    old = Keyspace(buckets=16)
    assert _old_keys(client, old) == [old.lease("controller")]  # the tombstone only
    assert client.ttl(old.lease("controller")) == -1 and \
        client.get(old.lease("controller")).endswith(b"|buckets-grow")
    assert len(grown.list_records(EventRecord)) == n
    assert [e.id for e in grown.read_journal("jr")] == [f"e-{i}" for i in range(n)]
    assert len(grown.list_entries("ws:3")) == len(range(3, n, 7))
    entry = grown.get_entry("ws:3", "k:3")
    assert entry is not None
    assert not grown.compare_and_set(entry, None).ok  # it is there, at its new key
    assert grown.compare_and_set(WorkspaceEntry(version=1, workspace_id="ws:3", key="k:3",
                                                updated_at="2"), "1").ok
    again = grown.claim_effect(EffectReceipt(version=1, scope="run:5", key="x:5"), epoch=3)
    assert not again.won and again.receipt is not None
    assert grown.client.scard(grown.keys.effect_index("run:5")) == 1
    assert next(iter(grown.client.smembers(grown.keys.effect_index("run:5")))).decode() == \
        grown.keys.effect("run:5", "x:5")
    assert grown.claim_effect(EffectReceipt(version=1, scope="run:5", key="x:6"),
                              epoch=2).stale  # the scope's fence moved with it
    held = grown.lease_holder("job-lock")
    assert held is not None and held.token == "tok" and held.ttl_ms > 500_000
    assert grown.get_agent("ag") is not None
    assert grown.purge("own", batch_size=9) == 3 * n  # the own: sets name the new keys
    assert grown.list_records(EventRecord) == [] and grown.read_journal("jr") == []
