"""Retention never prunes a finished child its parent has not gathered yet (issue 16, item
2): children with a 1 s retention, a parent that gathers them after an answer given well
past it, a real controller pruning every few seconds. The parent finishes with the
children's results, and once it has finished the children are pruned (nothing leaks)."""

from __future__ import annotations

import json
from pathlib import Path

from redis.cluster import RedisCluster

from marbles_rq.store import open_store
from tests.procs import REPO_ROOT, Procs, wait_for
from tests.redis_procs import RedisServer

PROCS_SOURCES = (REPO_ROOT / "tests" / "rerun_workflows.py",)


def test_a_child_outlives_its_retention_until_its_parent_has_finished(procs: Procs) -> None:
    _scenario(procs)


def test_on_a_cluster_where_parent_and_children_sit_on_other_masters(
        cluster_url: str, redis_server: RedisServer, tmp_path: Path) -> None:
    procs = Procs(cluster_url, tmp_path / "procs", sources=PROCS_SOURCES)
    procs.env["MARBLES_RQ_URL"] = redis_server.url  # RQ on a standalone Redis (README)
    procs.env["MARBLES_TEST_EFFECTS_URL"] = redis_server.url  # the observer's plain client
    try:
        _scenario(procs)
    finally:
        procs.stop_all()
        print(procs.report(lines=60))


def _scenario(procs: Procs) -> None:
    procs.start(workers=1)
    store = open_store(procs.url, read_only=True)
    keys, r = store.keys, store.client
    procs.enqueue("gathering", 3, "parent")
    procs.observer.wait_status("parent", "waiting")  # on its question, children started
    view = procs.observer.view("parent")
    assert view is not None
    children = [s.result for s in view.steps if s.name == "|child"]
    ids = [str(json.loads(bytes(c))["id"]) for c in children]
    assert len(ids) == 3
    if isinstance(r, RedisCluster):  # the parent's records and a child's on other masters
        nodes = {r.get_node_from_key(keys.run(rid)).name for rid in ["parent", *ids]}
        assert len(nodes) > 1, nodes
    for cid in ids:
        assert procs.observer.wait_final(cid).data["status"] == "succeeded"

    def looked_at() -> bool:
        """Every child's retention has passed and the pruner has been over it: pruned (what
        it did before), or held for its parent (its prune moved past its retention)."""
        for cid in ids:
            fields = r.hmget(keys.run(cid), "finished_ms", "retention_ms")
            if fields[0] is None:
                continue  # pruned
            due = r.zscore(keys.run_finished(keys.bucket_of(cid)), cid)
            if due is None or due <= int(fields[0]) + int(fields[1]):
                return False
        return True

    wait_for(looked_at, timeout=60, what="the pruner to pass the children", interval=0.2,
             context=procs.report)
    gone = [cid for cid in ids if procs.observer.view(cid) is None]
    assert gone == [], f"children pruned while their parent waits: {gone}"

    done = procs.cli("approve", "parent", "go")
    assert done.returncode == 0, done.stderr
    final = procs.observer.wait_final("parent")
    assert final.data["status"] == "succeeded", final.data
    assert final.data["result"] == [0, 2, 4]

    # The parent has finished: nothing needs the children any more, and they are pruned.
    wait_for(lambda: all(procs.observer.view(cid) is None for cid in ids), timeout=60,
             what="the children to be pruned once their parent finished", interval=0.2,
             context=procs.report)
    assert procs.observer.view("parent") is not None  # its own retention: 7 days
