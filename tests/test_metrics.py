"""Prometheus metrics from real processes: a controller, a forking worker and a ``--pool 2``
worker, each with its own ``--metrics-port``, run workflows that succeed, fail, sleep on a
timer, are fired by a schedule, and are redelivered after a kill -9 (of a horse, of a pool
executor); each endpoint is scraped over HTTP and its values are awaited by a bounded poll.
Exact counts where the test controls what happens; bounds where a process races a clock
(which cause the controller sees first for a killed executor)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from marbles_rq.metrics import REDELIVERY_CAUSES
from marbles_rq.store.keys import Keyspace
from tests.procs import CHAIN_SOURCE, KILL_SOURCE, REPO_ROOT, Procs, wait_for
from tests.redis_procs import free_port

PROCS_SOURCES = (CHAIN_SOURCE, KILL_SOURCE, Path(__file__).with_name("metrics_workflows.py"))

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample the endpoint serves, keyed by (sample name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 when the endpoint has no such series (nothing counted yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def await_metric(port: int, check: Callable[[Samples], bool], what: str,
                 timeout: float = 30.0) -> Samples:
    """Poll the endpoint until `check` holds; the last scrape in the failure message."""
    last: dict[str, Samples] = {}

    def probe() -> Samples | None:
        last["s"] = scrape(port)
        return last["s"] if check(last["s"]) else None

    def context() -> str:
        seen = last.get("s", {})
        return "\n".join(f"{n}{dict(lbl)} {v}" for (n, lbl), v in sorted(
            seen.items(), key=lambda kv: kv[0][0]) if n.startswith("marbles_rq_"))

    return wait_for(probe, timeout=timeout, what=what, interval=0.1, context=context)


def _enqueue(procs: Procs, name: str, run_id: str, queue: str, input: object = None) -> None:
    done = procs.cli("enqueue", name, "--input", json.dumps(input), "--id", run_id,
                     "--queue", queue)
    assert done.returncode == 0, done.stderr


def _sleeping_pid(procs: Procs, run_id: str) -> int:
    """The pid of the process executing zchain run `run_id`'s step, once it sleeps there."""
    def find() -> int | None:
        for raw in procs.observer.lrange("zchain:sleeping"):
            me = json.loads(raw)
            if me["key"].startswith(f"{run_id}:"):
                return int(me["pid"])
        return None

    return wait_for(find, timeout=30, what=f"run {run_id} sleeping in its step")


def test_endpoints_count_what_the_processes_do(procs: Procs) -> None:
    obs = procs.observer
    ctl_port, fork_port, pool_port = free_port(), free_port(), free_port()
    forking = procs.worker(ready=False, extra=["--queues", "default",
                                               "--metrics-port", str(fork_port)])
    pool = procs.worker(pool=2, ready=False, extra=["--queues", "pool",
                                                    "--metrics-port", str(pool_port)])
    procs.controller(extra=["--metrics-port", str(ctl_port)])
    forking.wait_log("*** Listening on")
    pool.wait_log("*** Listening on", count=2)

    # Each worker executes what is on its queue: 3 that succeed, 2 that fail, 2 that sleep.
    for queue in ("default", "pool"):
        for i in range(3):
            _enqueue(procs, "mok", f"ok-{queue}-{i}", queue)
        for i in range(2):
            _enqueue(procs, "mfail", f"fail-{queue}-{i}", queue)
            _enqueue(procs, "mnap", f"nap-{queue}-{i}", queue)
    # Nobody listens on "idle": its depth is what the controller's gauge must show.
    for i in range(4):
        _enqueue(procs, "mok", f"idle-{i}", "idle")

    for port, where in ((fork_port, "forking"), (pool_port, "pool")):
        s = await_metric(port, lambda s: value(
            s, "marbles_rq_runs_finished_total", workflow="mnap", status="succeeded") == 2,
            f"the {where} worker to finish its runs")
        assert value(s, "marbles_rq_runs_finished_total", workflow="mok",
                     status="succeeded") == 3, where
        assert value(s, "marbles_rq_runs_finished_total", workflow="mfail",
                     status="failed") == 2, where
        assert value(s, "marbles_rq_runs_started_total", workflow="mok", kind="first") == 3, \
            where
        # A run that slept was started twice: before its timer and when woken (a resumption,
        # not a redelivery).
        assert value(s, "marbles_rq_runs_started_total", workflow="mnap", kind="first") == 2, \
            where
        assert value(s, "marbles_rq_runs_started_total", workflow="mnap",
                     kind="resumption") == 2, where
        assert value(s, "marbles_rq_runs_started_total", workflow="mnap",
                     kind="redelivery") == 0, where
        assert value(s, "marbles_rq_run_duration_seconds_count", workflow="mok",
                     status="succeeded") == 3, where
        assert value(s, "marbles_rq_run_duration_seconds_count", workflow="mnap",
                     status="succeeded") == 2, where
        # A run that slept lasted at least its 0.3 s timer: no bucket below holds one.
        assert value(s, "marbles_rq_run_duration_seconds_bucket", workflow="mnap",
                     status="succeeded", le="0.25") == 0, where
        assert value(s, "marbles_rq_step_duration_seconds_count", workflow="mok",
                     outcome="succeeded") == 3, where
        assert value(s, "marbles_rq_step_duration_seconds_count", workflow="mfail",
                     outcome="failed") == 2, where

    ctl = await_metric(ctl_port, lambda s: (
        value(s, "marbles_rq_timer_lateness_seconds_count") >= 4
        and value(s, "marbles_rq_schedule_lateness_seconds_count", workflow="mtick") >= 1
        and value(s, "marbles_rq_queue_depth", queue="idle", lane="0") == 4),
        "timers, a schedule and the idle queue on the controller's endpoint")
    assert value(ctl, "marbles_rq_runs_enqueued_total", workflow="mtick", queue="default") >= 1
    assert value(ctl, "marbles_rq_queue_in_flight", queue="idle", lane="0") == 0
    assert value(ctl, "marbles_rq_controller_pass_seconds_count") >= 1
    assert value(ctl, "marbles_rq_waiting_runs") >= 0

    # kill -9 of a horse in the middle of a step: the worker expires the lease, the
    # controller redelivers the run; the killed horse's counts (its start) are not lost.
    _enqueue(procs, "zchain", "kill-fork", "default", {"steps": 2, "sleep_s": 1.0})
    os.kill(_sleeping_pid(procs, "kill-fork"), signal.SIGKILL)
    obs.wait_final("kill-fork")
    s = await_metric(fork_port, lambda s: value(
        s, "marbles_rq_runs_finished_total", workflow="zchain", status="succeeded") == 1,
        "the killed run to finish on the forking worker")
    assert value(s, "marbles_rq_horse_deaths_total") == 1
    assert value(s, "marbles_rq_runs_started_total", workflow="zchain", kind="first") == 1
    assert value(s, "marbles_rq_runs_started_total", workflow="zchain",
                 kind="redelivery") == 1
    await_metric(ctl_port, lambda s: value(
        s, "marbles_rq_redeliveries_total", queue="default", cause="lease_expired") == 1,
        "the controller to count the horse's redelivery")
    ctl = scrape(ctl_port)
    assert value(ctl, "marbles_rq_lease_expirations_total", outcome="redelivered") == 1

    # kill -9 of a pool executor: its slot is refilled; the run is redelivered (by its lease
    # or by the executor's lapsed liveness, whichever the controller sees first).
    _enqueue(procs, "zchain", "kill-pool", "pool", {"steps": 2, "sleep_s": 1.0})
    os.kill(_sleeping_pid(procs, "kill-pool"), signal.SIGKILL)
    obs.wait_final("kill-pool")
    s = await_metric(pool_port, lambda s: value(
        s, "marbles_rq_runs_finished_total", workflow="zchain", status="succeeded") == 1,
        "the killed run to finish on the pool")
    assert value(s, "marbles_rq_runs_started_total", workflow="zchain", kind="first") == 1
    assert value(s, "marbles_rq_runs_started_total", workflow="zchain",
                 kind="redelivery") == 1
    assert value(s, "marbles_rq_runs_finished_total", workflow="mok", status="succeeded") == 3
    ctl = await_metric(ctl_port, lambda s: sum(
        value(s, "marbles_rq_redeliveries_total", queue="pool", cause=c)
        for c in REDELIVERY_CAUSES) == 1, "the controller to count the pool's redelivery")
    assert value(ctl, "marbles_rq_redeliveries_total", queue="pool",
                  cause="worker_lost") + value(ctl, "marbles_rq_redeliveries_total",
                                               queue="pool", cause="lease_expired") == 1

    # Redis refuses writes (OOM under noeviction): the liveness beats of both workers (a
    # forking worker's own thread, the pool's executors) and the controller's schedule
    # writes are refused, and each endpoint counts the kind.
    admin = redis.Redis.from_url(procs.url)
    before = {port: value(scrape(port), "marbles_rq_redis_errors_total", kind="oom")
              for port in (ctl_port, fork_port, pool_port)}
    assert before == {ctl_port: 0, fork_port: 0, pool_port: 0}
    admin.config_set("maxmemory", 1)
    try:
        for port in (ctl_port, fork_port, pool_port):
            await_metric(port, lambda s: value(
                s, "marbles_rq_redis_errors_total", kind="oom") >= 1,
                f"OOM errors counted on port {port}")
    finally:
        admin.config_set("maxmemory", 0)


@pytest.mark.parametrize("command", ["worker", "controller", "web"])
def test_a_bad_metrics_port_is_one_line_and_exit_2(procs: Procs, command: str) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        for bad, says in ((str(port), "in use"), ("70000", "70000"), ("nope", "nope")):
            done = subprocess.run(procs.cli_argv(command, "--metrics-port", bad), cwd=REPO_ROOT,
                                  env=procs.env, capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
            assert done.returncode == 2, (bad, done.stderr)
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (
                bad, done.stderr)
    finally:
        taken.close()



HOOKS = """
import asyncio, sys, urllib.request
from marbles_rq import metrics

server = metrics.serve_metrics(int(sys.argv[1]), "127.0.0.1")
metrics.run_enqueued("mok", "default")
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5) as reply:
    served = reply.read().decode()

async def scrape_asgi() -> str:
    sent = []
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}
    async def send(message):
        sent.append(message)
    scope = {"type": "http", "method": "GET", "path": "/", "query_string": b"",
             "headers": [], "http_version": "1.1"}
    await metrics.asgi_app()(scope, receive, send)
    return b"".join(m.get("body", b"") for m in sent).decode()

mounted = asyncio.run(scrape_asgi())
line = 'marbles_rq_runs_enqueued_total{queue="default",workflow="mok"} 1.0'
print(line in served, line in mounted)
"""


def test_the_web_command_hooks_serve_the_same_registry(tmp_path: Path) -> None:
    # In a process of its own: turning metrics on is for the life of a process.
    done = subprocess.run([sys.executable, "-c", HOOKS, str(free_port())], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"], done.stdout


def test_queue_depth_per_lane(redis_server: Any, tmp_path: Path) -> None:
    """Three lanes, no worker: each lane's queue holds the runs of its buckets, and the
    controller's gauge shows each lane's depth."""
    lanes = 3
    procs = Procs(redis_server.url, tmp_path / "procs", sources=PROCS_SOURCES)
    procs.env.update(MARBLES_LANE_COUNT=str(lanes))
    keys = Keyspace("mrq", lanes=lanes)  # the default 1,024 buckets, layout 2
    try:
        port = free_port()
        procs.controller(extra=["--metrics-port", str(port)])
        wanted = {lane: lane + 1 for lane in range(lanes)}  # 1, 2 and 3 runs
        placed = dict.fromkeys(range(lanes), 0)
        i = 0
        while placed != wanted:
            rid, i = f"lane-run-{i}", i + 1
            lane = keys.lane_of(rid)
            if placed[lane] < wanted[lane]:
                _enqueue(procs, "mok", rid, "held")  # no worker; mtick's runs go to default
                placed[lane] += 1
        await_metric(port, lambda s: all(
            value(s, "marbles_rq_queue_depth", queue="held", lane=str(lane)) == n
            for lane, n in wanted.items()), "each lane's depth")
    finally:
        procs.stop_all()
        print(procs.report())
