"""Worker liveness: a worker beats once a second into ``{P}:workers``; the controller
redelivers the runs of a worker that stopped beating without waiting for their leases.
Real ``marbles-rq worker`` / ``controller`` processes at their default settings (lease
10 s, controller interval 0.5 s), real signals, a real durable redis-server. The tests
assert the mechanism (the worker's liveness lapsed, the controller reaped its run as "worker
lost"), not a wall-clock bound: bench/redelivery.py measures the time."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest

import marbles_rq as mr
from marbles_rq.controller import Controller
from marbles_rq.controller.loop import LIVENESS_GRACE_S
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.execute import execute
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import DEFAULT_LEASE_MS, OutputEvent, RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.transport.liveness import WORKER_TTL_MS
from tests.procs import Procs, pid_alive, wait_for

DEFAULT_INTERVAL_S = 0.5  # marbles-rq controller's default --interval
CHAIN_RECEIPTS = "chain:receipts"
STOP_STEPS = 20


def _redelivered(events: list[OutputEvent]) -> list[OutputEvent]:
    return [e for e in events if e.type == "redelivered"]


def _exactly_once(procs: Procs, run_id: str, steps: int) -> None:
    obs = procs.observer
    final = obs.wait_final(run_id, timeout=90)
    assert final.data["status"] == "succeeded", obs.dump(run_id)
    view = obs.view(run_id)
    assert view is not None and [s.status for s in view.steps] == ["succeeded"] * steps
    counts = Counter(obs.lrange(CHAIN_RECEIPTS))
    assert sorted(counts) == sorted(f"{run_id}:chain.link#{i}" for i in range(steps))
    assert set(counts.values()) == {1}, counts


def _beating(procs: Procs, name: str) -> float | None:
    return procs.observer.client.zscore(procs.observer.runs.keys.workers, name)


def test_kill9_of_a_worker_is_redelivered_when_its_liveness_lapses(procs: Procs) -> None:
    obs = procs.observer
    procs.start(workers=2, lease_ms=DEFAULT_LEASE_MS, interval=DEFAULT_INTERVAL_S)
    procs.enqueue("chain", {"steps": 6, "sleep_s": 0.7}, "live-kill")
    obs.wait_step_started("live-kill", "chain.link#1", attempt=1)
    view = obs.view("live-kill")
    assert view is not None
    victim = procs.by_name(view.worker)
    lapses_at = _beating(procs, victim.name)
    assert lapses_at is not None, "the worker does not beat"
    horse = victim.horse()
    victim.kill9()
    wait_for(lambda: not pid_alive(horse), timeout=10, what="the horse to die with its worker")

    event = obs.wait_event("live-kill", lambda e: e.type == "redelivered", timeout=60,
                           what="the redelivery")
    # The controller reaped it because the worker stopped beating, not because the lease
    # (10 s, extended by every commit) ran out; and it took the lost worker off the index.
    assert event.data == {"previous": 1, "attempt": 2, "reason": "worker lost",
                          "worker": victim.name}, obs.dump("live-kill")
    lease = obs.client.zscore(obs.runs.keys.run_keys("live-kill").leases, "live-kill")
    assert lease is None or event.at_ms >= lapses_at  # a beat's time had passed
    # Its name goes once its runs are reaped (the same pass, after their redeliveries).
    wait_for(lambda: _beating(procs, victim.name) is None or None, timeout=30,
             what="the lost worker to be taken off the index")
    obs.wait_attempt("live-kill", 2)
    _exactly_once(procs, "live-kill", 6)
    assert obs.view("live-kill").worker != victim.name  # type: ignore[union-attr]


def test_a_frozen_worker_is_redelivered_and_fenced_when_it_continues(procs: Procs) -> None:
    """SIGSTOP of a forking worker: it stops beating while its horse runs on. The run is
    redelivered to another worker; the old horse's writes are refused from then on, and
    when the worker continues nothing it sends is accepted."""
    obs = procs.observer
    procs.start(workers=2, lease_ms=DEFAULT_LEASE_MS, interval=DEFAULT_INTERVAL_S)
    # long enough that the horse, which runs on, is still at it when the run is redelivered
    procs.enqueue("chain", {"steps": STOP_STEPS, "sleep_s": 0.7}, "live-stop")
    obs.wait_step_started("live-stop", "chain.link#1", attempt=1)
    view = obs.view("live-stop")
    assert view is not None
    frozen = procs.by_name(view.worker)
    horse = frozen.horse()
    frozen.signal(signal.SIGSTOP)
    try:
        event = obs.wait_event("live-stop", lambda e: e.type == "redelivered", timeout=60,
                               what="the redelivery")
        assert (event.data["reason"], event.data["worker"]) == ("worker lost", frozen.name)
        obs.wait_attempt("live-stop", 2)
        assert obs.view("live-stop").worker != frozen.name  # type: ignore[union-attr]
        # the old horse, still running, is fenced: it ends itself at its next write
        wait_for(lambda: not pid_alive(horse), timeout=30, what="the fenced horse to end")
    finally:
        frozen.signal(signal.SIGCONT)
    _exactly_once(procs, "live-stop", STOP_STEPS)
    events = obs.events("live-stop")
    assert not [e for e in events if e.attempt == 1 and e.id > event.id], obs.dump("live-stop")
    wait_for(lambda: _beating(procs, frozen.name), timeout=10,
             what="the continued worker to beat again")
    assert frozen.alive()


def test_kill9_of_a_pool_executor_is_redelivered_when_its_liveness_lapses(
        procs: Procs) -> None:
    obs = procs.observer
    pool = procs.worker(lease_ms=DEFAULT_LEASE_MS, pool=2)
    procs.controller(interval=DEFAULT_INTERVAL_S)
    procs.enqueue("chain", {"steps": 6, "sleep_s": 0.7}, "live-pool")
    obs.wait_step_started("live-pool", "chain.link#1", attempt=1)
    view = obs.view("live-pool")
    assert view is not None and view.worker is not None
    executor = int(view.worker.rsplit(".", 1)[1])
    assert executor in pool.children()
    os.kill(executor, signal.SIGKILL)
    event = obs.wait_event("live-pool", lambda e: e.type == "redelivered", timeout=60,
                           what="the redelivery")
    assert (event.data["reason"], event.data["worker"]) == ("worker lost", view.worker)
    _exactly_once(procs, "live-pool", 6)
    assert pool.alive()


# -- the controller's side, in this process -----------------------------------------------


@mr.workflow("lv_noop")
def lv_noop(ctx: mr.RunContext) -> None:
    return None


@pytest.fixture
def runs(redis_url: str) -> RunStore:
    return RunStore(open_store(redis_url))


def test_the_controller_reaps_only_the_runs_of_lost_workers(runs: RunStore,
                                                            redis_url: str) -> None:
    workers = runs.keys.workers
    for run_id, worker in (("on-lost", "w-lost"), ("on-live", "w-live"),
                           ("on-back", "w-back")):
        runs.record(prepare(RunRequest("lv_noop", b"null", run_id)))
        assert runs.start(run_id, 1, ttl_ms=60_000, worker=worker).status == "ok"
    now = runs.scripts.beat_worker(workers_key=workers, worker="w-live", ttl_ms=WORKER_TTL_MS)
    runs.client.zadd(workers, {"w-lost": 1, "w-back": 2, "w-idle": 3})
    ctl = Controller(runs, rq_connection(redis_url))
    assert ctl.lead()
    assert ctl.reap() == 0  # no lease has expired
    assert ctl.reap_lost_workers() == 2  # w-lost and w-back (w-idle ran nothing)
    for run_id, worker in (("on-lost", "w-lost"), ("on-back", "w-back")):
        view = runs.get(run_id)
        assert view is not None and (view.status, view.attempt) == ("queued", 2)
        assert [e.data for e in runs.output(run_id) if e.type == "redelivered"] == [
            {"previous": 1, "attempt": 2, "reason": "worker lost", "worker": worker}]
    view = runs.get("on-live")
    assert view is not None and (view.status, view.attempt) == ("running", 1)
    assert runs.client.zrange(workers, 0, -1) == [b"w-live"]
    assert now > 0
    # the lost worker's execution is fenced: its late writes are refused
    assert execute(runs, REGISTRY, "on-lost", 1, worker="w-lost", lease_ms=60_000,
                   hard_exit=False) == "stale_attempt"
    assert ctl.reap_lost_workers() == 0


def test_a_worker_that_beats_again_before_the_cutoff_is_kept(runs: RunStore) -> None:
    workers = runs.keys.workers
    runs.client.zadd(workers, {"w-a": 10, "w-b": 10})
    runs.scripts.beat_worker(workers_key=workers, worker="w-b", ttl_ms=WORKER_TTL_MS)
    assert runs.scripts.forget_workers(workers_key=workers, workers=["w-a", "w-b", "w-c"],
                                       cutoff_ms=100) == ["ok", "kept", "kept"]
    assert runs.client.zrange(workers, 0, -1) == [b"w-b"]
    assert runs.scripts.forget_workers(workers_key=workers, workers=["w-b"],
                                       cutoff_ms=None) == ["ok"]


def test_lapsed_beats_are_believed_only_after_steady_contact(runs: RunStore,
                                                            redis_url: str) -> None:
    """A controller that has just started, won the lease or come through an outage (which
    kept every worker's beats from landing too) waits LIVENESS_GRACE_S before it takes a
    worker whose beats lapsed for lost."""
    runs.record(prepare(RunRequest("lv_noop", b"null", "on-quiet")))
    assert runs.start("on-quiet", 1, ttl_ms=60_000, worker="w-quiet").status == "ok"
    runs.client.zadd(runs.keys.workers, {"w-quiet": 1})
    ctl = Controller(runs, rq_connection(redis_url))
    assert ctl.lead()
    ctl.pass_once()  # no contact yet: not believed
    view = runs.get("on-quiet")
    assert view is not None and (view.status, view.attempt) == ("running", 1)
    ctl._in_contact_since = time.monotonic() - LIVENESS_GRACE_S  # steady for long enough
    ctl.pass_once()
    view = runs.get("on-quiet")
    assert view is not None and (view.status, view.attempt) == ("queued", 2)
