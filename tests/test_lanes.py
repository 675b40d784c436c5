"""Lanes: each lane its own RQ keyspace; a run's lane follows from its bucket, is recorded with
the run, and every delivery of it goes through that lane. Real ``marbles-rq worker`` and
``controller`` processes, real signals, a real durable redis-server, and a real 3-master
Redis Cluster (with a replica per master for the failover)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from marbles_rq.engine.runs import OutputEvent, RunStore
from marbles_rq.store import open_store
from marbles_rq.store.keys import Keyspace
from tests.procs import Proc, Procs, wait_for
from tests.redis_procs import RedisCluster

HERE = Path(__file__).parent
PROCS_SOURCES = (HERE / "lane_workflows.py",)
LANES = 3
RQ_PREFIX = "{mrq:rq}"  # RQ's own keyspace in one slot: what a cluster needs
KEYS = Keyspace("mrq", lanes=LANES)  # the default 1,024 buckets, layout 2


def _lane_procs(url: str, dir: Path) -> Procs:
    procs = Procs(url, dir, sources=PROCS_SOURCES)
    procs.env.update(MARBLES_LANE_COUNT=str(LANES), RQ_KEY_PREFIX=RQ_PREFIX)
    return procs


def _ids_per_lane(n: int, prefix: str) -> dict[int, list[str]]:
    """`n` run ids for each lane (the lane follows from the id's bucket)."""
    out: dict[int, list[str]] = {k: [] for k in range(LANES)}
    i = 0
    while any(len(v) < n for v in out.values()):
        rid = f"{prefix}{i}"
        lane = KEYS.lane_of(rid)
        if len(out[lane]) < n:
            out[lane].append(rid)
        i += 1
    return out


def _enqueue(procs: Procs, run_id: str, steps: int = 1, sleep_s: float = 0.0) -> None:
    done = procs.cli("enqueue", "ln_steps", "--id", run_id, "--input",
                     json.dumps({"steps": steps, "sleep_s": sleep_s}))
    assert done.returncode == 0, done.stderr


def _events(runs: RunStore, run_id: str) -> list[OutputEvent]:
    return runs.output(run_id, after="0-0", count=10_000)


def _written(runs: RunStore, run_id: str) -> list[dict[str, object]]:
    """What the run's steps wrote (stream.write of a dict)."""
    return [e.data["value"] for e in _events(runs, run_id)
            if e.type == "output" and isinstance(e.data.get("value"), dict)]


def _final(runs: RunStore, run_id: str, timeout: float = 90.0) -> OutputEvent:
    def find() -> OutputEvent | None:
        return next((e for e in _events(runs, run_id) if e.type == "final"), None)

    return wait_for(find, timeout=timeout, what=f"run {run_id} to finish")


def _exactly_once(runs: RunStore, run_id: str, steps: int) -> None:
    """The run succeeded, and each step's effect was won by exactly one delivery."""
    final = _final(runs, run_id)
    assert final.data["status"] == "succeeded", [e.data for e in _events(runs, run_id)]
    won = Counter(v["key"] for v in _written(runs, run_id) if v.get("won"))
    assert len(won) == steps and set(won.values()) == {1}, won


def _diagnosis(cluster: RedisCluster, runs: RunStore, ids: list[str]) -> str:
    """What a stuck cluster test needs to be understood: each run's status, and the RQ
    lists and sorted sets of each master with their lengths."""
    lines = [f"runs: {[(r, getattr(runs.get(r), 'status', None)) for r in ids]}"]
    for node in cluster.nodes:
        conn = redis.Redis(port=node.port, decode_responses=True, socket_timeout=5)
        try:
            role = conn.info("replication")["role"]
            sizes = {}
            for key in conn.scan_iter(match=f"*{RQ_PREFIX.strip('{}')}*", count=1000):
                kind = conn.type(key)
                if kind == "list":
                    sizes[key] = conn.llen(key)
                elif kind == "zset":
                    sizes[key] = conn.zcard(key)
            lines.append(f"node {node.port} ({role}): {sizes}")
        except redis.RedisError as exc:
            lines.append(f"node {node.port}: {exc}")
    return "\n".join(lines)


def _worker(procs: Procs, lanes: str, *extra: str) -> Proc:
    return procs.worker(extra=["--lanes", lanes, *extra])


def _served_by(procs: Procs, runs: RunStore, run_id: str) -> Proc:
    view = runs.get(run_id)
    assert view is not None and view.worker is not None
    return procs.by_name(view.worker)


# -- one server, three lanes ------------------------------------------------------------------


def test_runs_go_through_their_lanes_and_doctor_reports_a_lane_without_worker(
        redis_server: object, tmp_path: Path) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    procs = _lane_procs(url, tmp_path / "procs")
    runs = RunStore(open_store(url, lanes=LANES))
    try:
        workers = {k: _worker(procs, str(k)) for k in (0, 1)}
        procs.controller()
        ids = _ids_per_lane(3, "sa")
        for lane_ids in ids.values():
            for rid in lane_ids:
                _enqueue(procs, rid)
        for lane in (0, 1):
            for rid in ids[lane]:
                _exactly_once(runs, rid, 1)
                assert _served_by(procs, runs, rid) is workers[lane]
        # Lane 2 has no worker: its runs wait in lane 2's queue, and doctor says so.
        raw = redis.Redis.from_url(url)
        queue = f"{KEYS.lane_rq_prefix(2)}:queue:mrq.default"
        assert raw.llen(queue) == 3
        assert {runs.client.hget(runs.keys.run(rid), "lane") for rid in ids[2]} == {b"2"}
        doctor = procs.cli("doctor")
        assert "warning: lane 2 has no live worker" in doctor.stderr, doctor.stderr
        assert "lane 0 has no live worker" not in doctor.stderr
        late = _worker(procs, "2")
        for rid in ids[2]:
            _exactly_once(runs, rid, 1)
            assert _served_by(procs, runs, rid) is late
        assert raw.llen(queue) == 0
        # Nothing of this deployment went to RQ's own keyspace: every delivery had a lane.
        assert not [k for k in raw.scan_iter(match=f"{RQ_PREFIX}:queue:*")]
    finally:
        procs.stop_all()
        print(procs.report(lines=40))


def test_an_idle_worker_helps_a_busy_lane(redis_server: object, tmp_path: Path) -> None:
    """A worker serving all lanes takes lane 2's runs, though its own lane (0) comes first."""
    url = redis_server.url  # type: ignore[attr-defined]
    procs = _lane_procs(url, tmp_path / "procs")
    runs = RunStore(open_store(url, lanes=LANES))
    try:
        helper = _worker(procs, "all")
        procs.controller()
        for rid in _ids_per_lane(2, "help")[2]:
            _enqueue(procs, rid)
            _exactly_once(runs, rid, 1)
            assert _served_by(procs, runs, rid) is helper
    finally:
        procs.stop_all()
        print(procs.report(lines=40))


def test_worker_lanes_option_is_checked(redis_server: object, tmp_path: Path) -> None:
    procs = _lane_procs(redis_server.url, tmp_path / "procs")  # type: ignore[attr-defined]
    for bad in ("3", "x", "", "0,-1"):
        done = procs.cli("worker", "--lanes", bad, "--burst")
        assert done.returncode == 2, done
        assert "invalid --lanes" in done.stderr and len(done.stderr.strip().splitlines()) == 1


# -- a Redis Cluster ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """3 masters, each with a replica (for CLUSTER FAILOVER)."""
    cluster = RedisCluster.start(dir=tmp_path_factory.mktemp("lane-cluster"), replicas=1)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def lane_cluster(replicated_cluster: RedisCluster) -> RedisCluster:
    for node in replicated_cluster.nodes:
        if not node.is_running():
            node.restart()
    replicated_cluster.wait_ready()
    replicated_cluster.flushall()
    return replicated_cluster


def _replication(port: int) -> dict[str, object]:
    return redis.Redis(port=port, decode_responses=True).info("replication")


def _lane_master_port(cluster: RedisCluster, lane: int) -> int:
    prefix = KEYS.lane_rq_prefix(lane)
    assert prefix is not None
    return cluster.master_of_slot(key_slot(prefix.encode())).port


def test_cluster_lanes_each_on_their_master_and_kill9_redelivers_in_the_lane(
        lane_cluster: RedisCluster, tmp_path: Path) -> None:
    url = lane_cluster.url
    procs = _lane_procs(url, tmp_path / "procs")
    runs = RunStore(open_store(url, lanes=LANES))
    try:
        workers = {k: _worker(procs, str(k)) for k in range(LANES)}
        procs.controller()
        ids = _ids_per_lane(2, "cl")
        for lane_ids in ids.values():
            for rid in lane_ids:
                _enqueue(procs, rid, steps=2)
        for lane, lane_ids in ids.items():
            for rid in lane_ids:
                _exactly_once(runs, rid, 2)
                assert _served_by(procs, runs, rid) is workers[lane]
        # Each lane's RQ keyspace lives on the master serving its tag's slot.
        for lane in range(LANES):
            port = _lane_master_port(lane_cluster, lane)
            node = redis.Redis(port=port)
            assert node.exists(f"{KEYS.lane_rq_prefix(lane)}:queues"), (lane, port)

        # kill -9 of the worker serving lane 1 mid-run: the run is redelivered on lane 1.
        victim_id = _ids_per_lane(1, "victim")[1][0]
        _enqueue(procs, victim_id, steps=4, sleep_s=0.5)
        wait_for(lambda: any(v.get("sleeping") == 1 for v in _written(runs, victim_id)),
                 timeout=60, what="the victim to reach its second step")
        assert _served_by(procs, runs, victim_id) is workers[1]
        workers[1].kill9()
        wait_for(lambda: any(e.type == "redelivered" for e in _events(runs, victim_id)),
                 timeout=60, what="the redelivery")
        # Once its liveness beat lapses (3 s), doctor says lane 1 has no worker.
        wait_for(lambda: "warning: lane 1 has no live worker" in procs.cli("doctor").stderr,
                 timeout=30, what="doctor to report lane 1 without a worker")
        replacement = _worker(procs, "1")
        _exactly_once(runs, victim_id, 4)
        assert _served_by(procs, runs, victim_id) is replacement
        assert runs.get(victim_id).attempt == 2  # type: ignore[union-attr]
    finally:
        procs.stop_all()
        print(procs.report(lines=60))


def test_cluster_failover_during_runs_loses_nothing(lane_cluster: RedisCluster,
                                                   tmp_path: Path) -> None:
    """CLUSTER FAILOVER on the replica of the master serving lane 1 (and every other master,
    one after the other) while runs execute: the lane clients follow the new masters, the
    store's client too, and every run finishes with each effect won exactly once."""
    url = lane_cluster.url
    procs = _lane_procs(url, tmp_path / "procs")
    runs = RunStore(open_store(url, lanes=LANES))
    try:
        _worker(procs, "all", "--pool", "3")
        procs.controller()
        ids = [rid for lane_ids in _ids_per_lane(4, "fo").values() for rid in lane_ids]
        # One batch (twelve CLI calls took longer than the runs on a loaded machine: they
        # had all finished before the failovers began), of runs long enough to span them.
        batch = tmp_path / "runs.jsonl"
        batch.write_text("".join(json.dumps({"id": rid, "input": {"steps": 6, "sleep_s": 0.5}})
                                 + "\n" for rid in ids))
        done = procs.cli("enqueue", "ln_steps", "--batch", str(batch))
        assert done.returncode == 0, done.stderr
        wait_for(lambda: any(getattr(runs.get(r), "status", None) in ("running", "succeeded")
                             for r in ids), timeout=60, what="runs to be running",
                 context=lambda: _diagnosis(lane_cluster, runs, ids))
        before = {lane: _lane_master_port(lane_cluster, lane) for lane in range(LANES)}
        for port in dict.fromkeys(before[k] for k in (1, 0, 2)):  # lane 1's master first
            master = next(n for n in lane_cluster.nodes if n.port == port)
            replica = lane_cluster.replica_of(master)
            wait_for(lambda r=replica: _replication(r.port).get("master_link_status") == "up",
                     timeout=30, what="the replica to be in sync")
            assert redis.Redis(port=replica.port).execute_command("CLUSTER", "FAILOVER")
            wait_for(lambda r=replica: _replication(r.port).get("role") == "master",
                     timeout=30, what=f"replica {replica.port} to take over from {port}")
            lane_cluster.wait_ready()  # every node's slot map shows the new master
        after = {lane: _lane_master_port(lane_cluster, lane) for lane in range(LANES)}
        assert all(after[k] != before[k] for k in range(LANES)), (before, after)
        for rid in ids:
            _exactly_once(runs, rid, 6)
        # The transport follows: new runs on every lane after the failovers finish too.
        fresh = [rid for lane_ids in _ids_per_lane(1, "post").values() for rid in lane_ids]
        for rid in fresh:
            _enqueue(procs, rid)
        for rid in fresh:
            _exactly_once(runs, rid, 1)
    finally:
        procs.stop_all()
        print(procs.report(lines=80))


def test_cluster_needs_a_hash_tagged_rq_prefix(lane_cluster: RedisCluster) -> None:
    code = ("from marbles_rq.transport.lanes import open_lanes\n"
            "from marbles_rq.store.keys import Keyspace\n"
            f"open_lanes({lane_cluster.url!r}, Keyspace('mrq', 64, 3))\n")
    env = {k: v for k, v in os.environ.items() if k != "RQ_KEY_PREFIX"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "hash-tagged prefix" in done.stderr
