"""RQ as a lean transport (issue 10, items 1 and 3), against real redis-server processes and
real worker and controller processes:

* a delivery enqueued by a script (one round trip; with the run's record when the store and
  RQ share a server) is exactly the job hash RQ's own enqueue writes: RQ reads it back, `rq
  info` counts it, a stock RQ worker runs it;
* a marbles-rq worker writes none of RQ's per-job bookkeeping, and leaves nothing in RQ once
  a delivery completed;
* an interrupted delivery never shows up as a failure in RQ's registries;
* the controller still sees a delivery popped and never started (the intermediate list),
  redelivers it, and takes out what a worker left behind once its run has moved on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.connection import AbstractConnection
from rq import Queue, SimpleWorker
from rq.job import Job

from marbles_rq.controller import Controller
from marbles_rq.engine import execute as execute_module
from marbles_rq.engine import ops
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.execute import Engine, configure
from marbles_rq.engine.ops import RunRequest
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import (
    ENTRY,
    FAILURE_TTL_S,
    RESULT_TTL_S,
    MarblesJob,
    delivery_id,
    enqueue_delivery,
    rq_connection,
    rq_queue_name,
    same_server,
)
from marbles_rq.transport.serializer import JSONSerializer
from tests import lean_workflows
from tests.procs import CHAIN_SOURCE, Procs, pid_alive, wait_for
from tests.redis_procs import RedisServer

PROCS_SOURCES = (CHAIN_SOURCE, Path(lean_workflows.__file__))
QUEUE = rq_queue_name("mrq", "default")
Q = Queue.redis_queue_namespace_prefix + QUEUE
INTERMEDIATE = f"{Q}:intermediate"
FAILED = f"rq:failed:{QUEUE}"
# Keys RQ writes per job that a marbles-rq worker never writes.
BOOKKEEPING = ("rq:wip:*", "rq:finished:*", "rq:execution:*", "rq:executions:*",
               "rq:results:*", "rq:worker:*:executions")
TIMESTAMPS = {b"created_at", b"enqueued_at"}


@pytest.fixture
def engine_reset() -> Iterator[None]:
    saved = execute_module._ENGINE
    try:
        yield
    finally:
        execute_module._ENGINE = saved


def _stores(url: str) -> tuple[RunStore, redis.Redis]:
    return RunStore(open_store(url)), rq_connection(url)


def _reads(client: redis.Redis) -> int:
    return int(client.info("stats")["total_reads_processed"])


def _round_trips(client: redis.Redis, action: object) -> int:
    """Requests the server read while `action` ran, less what measuring costs."""
    _reads(client)  # connected
    before = _reads(client)
    baseline = _reads(client) - before  # one INFO
    before = _reads(client)
    action()  # type: ignore[operator]
    return _reads(client) - before - baseline


# --------------------------------------------------------------------------------------------
# enqueue: RQ's own job hash, in one round trip


def test_a_script_enqueued_delivery_is_the_job_rq_writes_and_reads(redis_url: str) -> None:
    runs, rq = _stores(redis_url)
    assert same_server(runs.client, rq)
    done = ops.enqueue(runs, rq, RunRequest("lt_noop", b"null", "same-1"))
    assert done.created and done.dispatched
    job_id = delivery_id("mrq", "same-1", 1)
    assert rq.lrange(Q, 0, -1) == [job_id.encode()]
    assert rq.sismember(Queue.redis_queues_keys, Q)

    # The same job enqueued by RQ itself, under another id: every field but the timestamps
    # is the same, byte for byte (the fields RQ writes empty are left out, and the call is
    # not compressed: Job.restore reads an empty field and an absent one alike, and
    # uncompressed data as compressed), and RQ reads back the same job.
    Queue(QUEUE, connection=rq, serializer=JSONSerializer).enqueue_call(
        ENTRY, args=("same-1", 1), job_id="reference", timeout=-1, result_ttl=RESULT_TTL_S,
        failure_ttl=FAILURE_TTL_S)
    ours, theirs = rq.hgetall(Job.key_for(job_id)), rq.hgetall(Job.key_for("reference"))
    theirs[b"data"] = zlib.decompress(theirs[b"data"])
    assert {k: v for k, v in ours.items() if k not in TIMESTAMPS} == {
        k: v for k, v in theirs.items() if k not in TIMESTAMPS and v != b""}
    assert ours.keys() >= TIMESTAMPS
    assert rq.ttl(Job.key_for(job_id)) == rq.ttl(Job.key_for("reference")) == -1
    read = [{k: v for k, v in Job.fetch(j, connection=rq, serializer=JSONSerializer)
             .to_dict().items() if k not in ("created_at", "enqueued_at")}
            for j in (job_id, "reference")]
    assert read[0] == read[1]

    for cls in (Job, MarblesJob):
        job = cls.fetch(job_id, connection=rq, serializer=JSONSerializer)
        assert (job.func_name, list(job.args), job.kwargs) == (ENTRY, ["same-1", 1], {})
        assert job.get_status() == "queued" and job.origin == QUEUE
        assert (job.timeout, job.result_ttl, job.failure_ttl) == (-1, RESULT_TTL_S,
                                                                  FAILURE_TTL_S)
        assert job.enqueued_at is not None and job.created_at is not None
    assert Queue(QUEUE, connection=rq).job_ids == [job_id, "reference"]


def _sends(monkeypatch: pytest.MonkeyPatch, action: Callable[[], object]) -> int:
    """Requests this process sent (a pipeline is one) while `action` ran."""
    sent: list[int] = []
    original = AbstractConnection.send_packed_command

    def counted(self: AbstractConnection, *args: Any, **kwargs: Any) -> None:
        sent.append(1)
        original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(AbstractConnection, "send_packed_command", counted)
        action()
    return len(sent)


def test_enqueue_is_one_round_trip_single_and_batch(redis_url: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    runs, rq = _stores(redis_url)
    ops.enqueue(runs, rq, RunRequest("lt_noop", b"null", "warm"))  # connections, scripts
    ops.enqueue_many(runs, rq, [RunRequest("lt_noop", b"null", f"warm-{i}") for i in range(2)])
    admin = redis.Redis.from_url(redis_url)
    assert _round_trips(admin, lambda: ops.enqueue(
        runs, rq, RunRequest("lt_noop", b"null", "one-1"))) == 1
    assert _sends(monkeypatch, lambda: ops.enqueue(
        runs, rq, RunRequest("lt_noop", b"null", "one-2"))) == 1
    requests = [RunRequest("lt_noop", b"null", f"many-{i}") for i in range(50)]
    assert _sends(monkeypatch, lambda: ops.enqueue_many(runs, rq, requests)) == 1
    queued = {j.decode() for j in rq.lrange(Q, 0, -1)}
    assert {delivery_id("mrq", f"many-{i}", 1) for i in range(50)} <= queued
    # The same id again records and enqueues nothing.
    again = ops.enqueue(runs, rq, RunRequest("lt_noop", b"null", "one-1"))
    assert not again.created and not again.dispatched
    assert rq.lrange(Q, 0, -1).count(delivery_id("mrq", "one-1", 1).encode()) == 1


def test_store_and_rq_on_two_servers_record_then_enqueue(redis_url: str,
                                                         redis_server: RedisServer) -> None:
    runs, rq = RunStore(open_store(redis_url)), rq_connection(redis_server.url)
    assert not same_server(runs.client, rq)
    done = ops.enqueue(runs, rq, RunRequest("lt_noop", b"null", "two-1"))
    many = ops.enqueue_many(runs, rq, [RunRequest("lt_noop", b"null", f"two-m{i}")
                                       for i in range(3)])
    assert done.dispatched and all(m.dispatched for m in many)
    job_ids = [delivery_id("mrq", r, 1) for r in ("two-1", "two-m0", "two-m1", "two-m2")]
    assert [j.decode() for j in rq.lrange(Q, 0, -1)] == job_ids
    store = redis.Redis.from_url(redis_url)
    assert store.llen(Q) == 0 and not store.exists(Job.key_for(job_ids[0]))
    assert runs.get("two-1") is not None


def test_a_queue_key_of_another_type_records_the_run_and_enqueues_nothing(
        redis_url: str) -> None:
    runs, rq = _stores(redis_url)
    rq.set(Q, "not a list")
    done = ops.enqueue(runs, rq, RunRequest("lt_noop", b"null", "wrongtype-1"))
    assert done.created and not done.dispatched  # journal first; the controller tries later
    view = runs.get("wrongtype-1")
    assert view is not None and view.status == "queued"
    assert not rq.exists(Job.key_for(delivery_id("mrq", "wrongtype-1", 1)))
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        enqueue_delivery(rq, "mrq", "default", "wrongtype-1", 2)
    assert not rq.exists(Job.key_for(delivery_id("mrq", "wrongtype-1", 2)))
    assert rq.get(Q) == b"not a list"


def test_rq_info_and_a_stock_rq_worker_see_and_run_it(redis_url: str,
                                                      engine_reset: None) -> None:
    runs, rq = _stores(redis_url)
    for run_id in ("stock-1", "stock-2"):
        assert ops.enqueue(runs, rq, RunRequest("lt_noop", b"null", run_id)).dispatched
    rq_cli = Path(sys.executable).parent / "rq"
    info = subprocess.run([str(rq_cli), "info", "-u", redis_url, "-Q", "-r"],
                          capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    assert f"queue {QUEUE} 2" in info.stdout, info.stdout

    # RQ's own SimpleWorker (no marbles-rq class anywhere) reads the jobs and calls the entry
    # point with their arguments.
    configure(Engine(runs, REGISTRY, worker_name="stock", lease_ms=10_000, hard_exit=False))
    worker = SimpleWorker([Queue(QUEUE, connection=rq, serializer=JSONSerializer)],
                          connection=rq, serializer=JSONSerializer)
    assert worker.work(burst=True)
    for run_id in ("stock-1", "stock-2"):
        view = runs.get(run_id)
        assert view is not None and view.status == "succeeded", view
        job = Job.fetch(delivery_id("mrq", run_id, 1), connection=rq, serializer=JSONSerializer)
        assert job.get_status() == "finished" and job.return_value() == "succeeded"


# --------------------------------------------------------------------------------------------
# the lean worker


def _burst(procs: Procs, *args: str) -> None:
    done = subprocess.run(procs.cli_argv("worker", "--burst", "--lease-ms", "10000", *args),
                          capture_output=True, text=True, timeout=300, env=procs.env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def _per_burst(procs: Procs, n: int, *args: str) -> dict[str, int]:
    admin = redis.Redis.from_url(procs.url)
    runs = [f"lean-{n}-{i}" for i in range(n)]
    store, rq = _stores(procs.url)
    ops.enqueue_many(store, rq, [RunRequest("lt_noop", b"null", r) for r in runs])
    admin.config_resetstat()
    _burst(procs, *args)
    stats = {k.removeprefix("cmdstat_"): int(v["calls"])
             for k, v in admin.info("commandstats").items()}
    for run_id in runs:
        assert procs.observer.status(run_id) == "succeeded"
    return stats


@pytest.mark.parametrize("mode", [["--pool", "1"], []], ids=["pool", "fork"])
def test_the_worker_writes_no_per_job_bookkeeping_and_leaves_nothing(
        procs: Procs, mode: list[str]) -> None:
    admin = redis.Redis.from_url(procs.url)
    small, large = _per_burst(procs, 2, *mode), _per_burst(procs, 12, *mode)
    # Commands of RQ's per-job bookkeeping that no marbles-rq script runs (INFO commandstats
    # counts those run by scripts too): as many in a burst of 12 runs as in a burst of 2
    # (worker start and stop), not more.
    for command in ("multi", "exec", "watch", "persist", "hincrbyfloat", "expire",
                    "smembers"):
        assert large.get(command, 0) <= small.get(command, 0) + 1, (command, small, large)
    # One pop, one read of the job and one cleanup (LREM, DEL) per delivery.
    assert large["lmove"] - small["lmove"] == 10
    assert large["lrem"] - small["lrem"] == 10
    assert large["del"] - small["del"] == 10
    for pattern in BOOKKEEPING:
        assert admin.keys(pattern) == [], pattern
    assert admin.keys("rq:job:*") == []
    assert admin.llen(INTERMEDIATE) == 0 and admin.llen(Q) == 0
    assert admin.zcard(FAILED) == 0


def test_a_multi_queue_worker_leaves_nothing_behind(procs: Procs) -> None:
    admin = redis.Redis.from_url(procs.url)
    procs.worker(extra=["--queues", "hi,lo"])
    procs.enqueue("chain", {"steps": 1}, "mq-lo", "--queue", "lo")
    procs.enqueue("chain", {"steps": 1}, "mq-hi", "--queue", "hi")
    for run_id in ("mq-lo", "mq-hi"):
        assert procs.observer.wait_status(run_id, "succeeded", timeout=30).attempt == 1
    wait_for(lambda: admin.keys("rq:job:*") == [], timeout=10,
             what="the completed deliveries' jobs to be cleaned up", context=procs.report)
    for queue in ("hi", "lo"):
        assert admin.llen(f"rq:queue:mrq.{queue}:intermediate") == 0


def test_a_refused_job_fails_in_rq_and_leaves_the_intermediate_list(procs: Procs) -> None:
    admin = redis.Redis.from_url(procs.url)
    job = Queue(QUEUE, connection=admin, serializer=JSONSerializer).enqueue_call(
        "os.getcwd", job_id="not-a-delivery")
    procs.enqueue("chain", {"steps": 1}, "after-refused")
    worker = procs.worker()
    procs.observer.wait_status("after-refused", "succeeded")
    wait_for(lambda: admin.llen(INTERMEDIATE) == 0, timeout=10,
             what="the intermediate list to empty", context=procs.report)
    assert admin.zrange(FAILED, 0, -1) == [job.id.encode()]
    assert Job.fetch(job.id, connection=admin, serializer=JSONSerializer).get_status() == (
        "failed")
    assert worker.alive()


def test_a_killed_horse_is_no_failure_in_rq_and_its_leftovers_are_taken_out(
        procs: Procs) -> None:
    """kill -9 of the horse mid-step: the run is redelivered and succeeds; nothing is in
    RQ's failed registry; the first delivery's entry and job, which its worker left, are
    taken out by the controller once the run has moved on."""
    admin = redis.Redis.from_url(procs.url)
    (worker,) = procs.start(workers=1, lease_ms=2000)
    procs.enqueue("lt_naps", {"steps": 3, "sleep_s": 0.5}, "horse-1")
    procs.observer.wait_step_started("horse-1", "lt_naps.lt_nap#1", attempt=1)
    horse = worker.horse()
    assert admin.lrange(INTERMEDIATE, 0, -1) == [delivery_id("mrq", "horse-1", 1).encode()]
    os.kill(horse, signal.SIGKILL)
    wait_for(lambda: not pid_alive(horse), timeout=10, what="the horse to die")
    view = procs.observer.wait_status("horse-1", "succeeded", timeout=60)
    assert view.attempt == 2
    wait_for(lambda: admin.llen(INTERMEDIATE) == 0 and admin.keys("rq:job:*") == [],
             timeout=20, what="the leftovers of both deliveries to be taken out",
             context=procs.report)
    assert admin.zcard(FAILED) == 0
    assert worker.alive()


@pytest.mark.parametrize("pool", [None, 1], ids=["fork", "pool"])
def test_sigterm_during_a_delivery_waits_for_it(procs: Procs, pool: int | None) -> None:
    """RQ's warm shutdown waits for a busy worker's job; a lean worker is busy while a
    delivery runs (in its process; RQ's state field is not written per job)."""
    worker = procs.worker(pool=pool)
    procs.enqueue("lt_naps", {"steps": 3, "sleep_s": 0.4}, "warm-1")
    procs.observer.wait_step_started("warm-1", "lt_naps.lt_nap#0", attempt=1)
    target = worker.pid if pool is None else worker.children()[0]
    os.kill(target, signal.SIGTERM)
    view = procs.observer.wait_status("warm-1", "succeeded", "failed", timeout=30)
    assert (view.status, view.attempt) == ("succeeded", 1), procs.observer.dump("warm-1")
    wait_for(lambda: not pid_alive(target), timeout=30,
             what="the worker to stop after its delivery", context=procs.report)
    if pool is None:
        assert worker.wait_exit(30) == 0, worker.tail()


# --------------------------------------------------------------------------------------------
# the controller: popped, never started; popped, over


def test_the_controller_redelivers_the_never_started_and_forgets_the_over(
        redis_url: str) -> None:
    from marbles_rq.engine.execute import execute

    runs, rq = _stores(redis_url)
    for run_id in ("done-1", "live-1", "lost-1"):
        assert ops.enqueue(runs, rq, RunRequest("lt_noop", b"null", run_id)).dispatched
    # A worker popped all three (what the lean pop leaves until the delivery completed),
    # completed done-1 and died before its cleanup, is running live-1, never started lost-1.
    for _ in range(3):
        assert rq.lmove(Q, INTERMEDIATE) is not None
    assert execute(runs, REGISTRY, "done-1", 1, worker="w", lease_ms=60_000,
                   hard_exit=False) == "succeeded"
    assert runs.start("live-1", 1, ttl_ms=60_000, worker="w").status == "ok"
    ids = {r: delivery_id("mrq", r, 1) for r in ("done-1", "live-1", "lost-1")}

    ctl = Controller(runs, rq, lost_after_s=0.0)
    assert ctl.lead()
    assert ctl.find_lost() == 1  # lost-1, as delivery 2
    assert {j.decode() for j in rq.lrange(INTERMEDIATE, 0, -1)} == {ids["live-1"],
                                                                     ids["lost-1"]}
    assert not rq.exists(Job.key_for(ids["done-1"]))
    assert rq.lrange(Q, 0, -1) == [delivery_id("mrq", "lost-1", 2).encode()]
    assert ctl.find_lost() == 0  # lost-1 has moved on: its first delivery is over
    assert rq.lrange(INTERMEDIATE, 0, -1) == [ids["live-1"].encode()]
    assert not rq.exists(Job.key_for(ids["lost-1"]))
    assert rq.exists(Job.key_for(ids["live-1"]))  # still running under it: left alone
    assert rq.zcard(FAILED) == 0
