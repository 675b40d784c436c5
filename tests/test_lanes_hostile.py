"""Lanes attacked by a careless operator: a process started with another --lane-count (or
another RQ_KEY_PREFIX) than the deployment's. Its deliveries must never go, silently, to a
keyspace no worker reads.

Since the lane count is recorded in the meta hash (main, layout 2), a process given another
count is refused; RQ_KEY_PREFIX is not recorded, so a process with another one is not: that
case is a strict xfail, to turn into a plain test once it is. Real redis-server, real
`marbles-rq` processes, real kill -9."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.store.keys import DEFAULT_BUCKETS, Keyspace
from tests.procs import Procs, wait_for
from tests.redis_procs import RedisCluster

HERE = Path(__file__).parent
SOURCES = (HERE / "lane_workflows.py",)
NOT_RECORDED = ("RQ_KEY_PREFIX (the RQ keyspace of a one-lane deployment) is not recorded in "
                "the meta hash, so a process with another one is not refused")


def _procs(url: str, dir: Path, lanes: int) -> Procs:
    procs = Procs(url, dir, sources=SOURCES)
    procs.env.update(MARBLES_LANE_COUNT=str(lanes))
    return procs


def _run_id(lanes: int, lane: int, prefix: str) -> str:
    keys = Keyspace("mrq", DEFAULT_BUCKETS, lanes)
    return next(f"{prefix}{i}" for i in range(10_000) if keys.lane_of(f"{prefix}{i}") == lane)


def _refused(done: subprocess.CompletedProcess[str]) -> bool:
    return done.returncode == 2 and "lane" in done.stderr.lower()


@pytest.mark.parametrize("created, other", [(3, 1), (1, 3)])
def test_enqueue_with_another_lane_count_is_refused(redis_server: object, tmp_path: Path,
                                                    created: int, other: int) -> None:
    """Created with `created` lanes; `enqueue --lane-count <other>` put its delivery in the
    other count's RQ keyspace (3 -> 1: `rq:queue:mrq.default`, read by no 3-lane worker;
    1 -> 3: `{mrq:lane00k}:queue:...`, read by no 1-lane worker). It must be refused
    (exit 2, one line naming the lane count), leaving no delivery anywhere."""
    url = redis_server.url  # type: ignore[attr-defined]
    procs = _procs(url, tmp_path / "procs", created)
    first = procs.cli("enqueue", "ln_steps", "--id", "made-1", "--input", "{}")
    assert first.returncode == 0, first.stderr
    raw = redis.Redis.from_url(url)
    before = sorted(raw.scan_iter(match="*queue:*"))
    procs.env["MARBLES_LANE_COUNT"] = str(other)
    wrong = procs.cli("enqueue", "ln_steps", "--id", _run_id(other, other - 1, "wr-"),
                      "--input", "{}")
    assert _refused(wrong), (wrong.returncode, wrong.stderr)
    assert sorted(raw.scan_iter(match="*queue:*")) == before
    raw.close()


@pytest.mark.parametrize("lanes, controller_env", [
    pytest.param(3, {"MARBLES_LANE_COUNT": "1"}, id="lane-count"),  # a stale unit file
    pytest.param(1, {"RQ_KEY_PREFIX": "{other}"}, id="rq-key-prefix",  # another deployment's
                 marks=pytest.mark.xfail(strict=True, reason=NOT_RECORDED)),
])
def test_a_controller_configured_otherwise_never_strands_a_redelivery(
        redis_server: object, tmp_path: Path, lanes: int,
        controller_env: dict[str, str]) -> None:
    """The deployment's worker killed (-9) mid-run, and the only controller started with
    another lane count (or another RQ_KEY_PREFIX on a one-lane deployment). It redelivered
    the run into a keyspace no worker of the deployment reads, then found that delivery
    present and waited: the run never finished, while a fresh worker sat idle (and doctor
    saw every lane served). Either that controller is refused at start, or the run
    finishes."""
    url = redis_server.url  # type: ignore[attr-defined]
    procs = _procs(url, tmp_path / "procs", lanes)
    try:
        victim = procs.worker(lease_ms=1500)
        rid = _run_id(lanes, lanes - 1, "strand-")
        done = procs.cli("enqueue", "ln_steps", "--id", rid, "--input",
                         json.dumps({"steps": 2, "sleep_s": 3.0}))
        assert done.returncode == 0, done.stderr
        procs.observer.wait_status(rid, "running", timeout=30)
        victim.kill9()
        procs.worker(lease_ms=1500)
        procs.env.update(controller_env)
        ctl = procs.controller(ready=False)
        try:
            ctl.wait_log("elected controller", timeout=30)
        except AssertionError:
            if not ctl.alive() and ctl.returncode == 2:
                return  # refused at start: nothing can be stranded
            raise
        procs.observer.wait_status(rid, "succeeded", timeout=60)
    finally:
        procs.stop_all()
        print(procs.report(lines=30))


def test_worker_lanes_typos_are_refused_not_misread(redis_server: object,
                                                    tmp_path: Path) -> None:
    """`--lanes 0_1` (a typo for 0,1) was read by int() as lane 1 alone, so lane 0 went
    unserved; `+1`, `-0` and other scripts' digits were accepted too. Only ASCII lane
    numbers are read now (and `all` in any case)."""
    url = redis_server.url  # type: ignore[attr-defined]
    procs = _procs(url, tmp_path / "procs", 3)
    for bad in ("0_1", "+1", "-0", "\u0662", "0 1", "1;2"):
        done = procs.cli("worker", "--lanes", bad, "--burst")
        assert done.returncode == 2, (bad, done)
        assert "invalid --lanes" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    done = procs.cli("worker", "--lanes", "ALL", "--burst")
    assert done.returncode == 0, done.stderr


def test_a_lane_master_killed_and_restarted_loses_nothing(redis_cluster: RedisCluster,
                                                          cluster_url: str,
                                                          tmp_path: Path) -> None:
    """The master serving lane 1's slot killed (-9), not failed over (no replica): the
    cluster goes down for everyone after its node timeout. The worker and the controller
    ride it out (no crash, no exit), and once that master restarts from its AOF every run
    of every lane finishes, each effect won exactly once, and new runs go through."""
    from tests.test_lanes import _enqueue, _exactly_once, _ids_per_lane, _lane_procs

    procs = _lane_procs(cluster_url, tmp_path / "procs")
    runs = RunStore(open_store(cluster_url, lanes=3))
    try:
        worker = procs.worker(extra=["--lanes", "all", "--pool", "3"])
        ctl = procs.controller()
        ids = [rid for lane_ids in _ids_per_lane(2, "mk").values() for rid in lane_ids]
        for rid in ids:
            _enqueue(procs, rid, steps=3, sleep_s=0.5)
        wait_for(lambda: any((v := runs.get(r)) is not None and v.status == "running"
                             for r in ids), timeout=60, what="runs to be running")
        lane1 = Keyspace("mrq", 64, 3).lane_rq_prefix(1)
        assert lane1 is not None
        victim = redis_cluster.master_of_slot(key_slot(lane1.encode() + b":queues"))
        victim.kill9()
        time.sleep(9)  # past the node timeout (5 s): the cluster is down
        assert worker.alive() and ctl.alive(), procs.report(lines=40)
        victim.restart()
        redis_cluster.wait_ready()
        for rid in ids:
            _exactly_once(runs, rid, 3)
        fresh = [rid for lane_ids in _ids_per_lane(1, "mk-post").values() for rid in lane_ids]
        for rid in fresh:
            _enqueue(procs, rid)
        for rid in fresh:
            _exactly_once(runs, rid, 1)
        assert worker.alive() and ctl.alive()
    finally:
        procs.stop_all()
        print(procs.report(lines=80))
