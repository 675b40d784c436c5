"""Workers against a misbehaving Redis and against their own restarts: real redis-server
(fresh per test), real `marbles-rq worker` processes, forking and ``--pool``.

* a worker restarted with the same hostname and pid (a container) starts at once: worker
  names are unique per start;
* Redis refusing writes (OOM under ``noeviction``) or restarting never ends a worker, each
  event is one log line (no tracebacks), the worker retries with a capped exponential
  backoff and resumes when Redis does;
* the pool supervisor respawns executors that keep dying with a backoff, not in a loop.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from collections import defaultdict
from datetime import datetime

import pytest
import redis

from tests.procs import Proc, Procs, descendants, pid_alive, wait_for
from tests.redis_procs import RedisServer, free_port

ERROR_LINE = re.compile(r"^(\S+ \S+) ERROR marbles_rq\.transport\.worker: Redis error in worker "
                        r"\S+\.(\d+) \((\w+): .*\); restarting it in ([\d.]+) s$", re.M)
RESPAWN_LINE = re.compile(r"^(\S+ \S+) WARNING marbles_rq\.transport\.worker: pool executor (\d+) "
                          r"\(pid (\d+)\) exited with (-?\d+); restarting it(?: in ([\d.]+) s)?$",
                          re.M)


PROCS_REPORT_LINES = 80


def _at(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _no_tracebacks(*procs: Proc) -> None:
    for proc in procs:
        text = proc.text()
        assert "Traceback" not in text and "unhandled exception" not in text, proc.tail(80)


def _backoffs(proc: Proc, error: str) -> dict[str, list[tuple[float, float]]]:
    """pid -> [(when, announced delay)] of the worker's one-line Redis error reports."""
    found: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for stamp, pid, kind, delay in ERROR_LINE.findall(proc.text()):
        if kind == error:
            found[pid].append((_at(stamp), float(delay)))
    return found


def _check_backoff(reports: list[tuple[float, float]]) -> None:
    """Each retry waited at least the announced delay; delays double up to the cap."""
    for (when, delay), (later, next_delay) in itertools.pairwise(reports):
        assert later - when >= delay - 0.02, reports
        assert next_delay == min(delay * 2, 30.0), reports


# --------------------------------------------------------------------------------------------
# 13: unique worker names


def test_a_worker_restarted_with_the_same_host_and_pid_starts_at_once(procs: Procs,
                                                                       redis_server: RedisServer
                                                                       ) -> None:
    """Each worker runs as pid 1 of its own pid namespace, like a container's main process.
    The first is killed -9, so its RQ registration stays behind (RQ keeps it for minutes);
    the second, same hostname and same pid, must start and work at once."""
    argv = ["unshare", "--pid", "--kill-child", "--mount-proc", *procs.base_argv(),
            "worker", "--lease-ms", "2000"]
    conn = redis_server.client()

    def start(n: int) -> Proc:
        proc = Proc("worker", argv, procs.dir / f"ns-worker-{n}.log", procs.env)
        procs.procs.append(proc)
        proc.wait_log("*** Listening on")
        return proc

    first = start(0)
    inner = descendants(first.pid)
    first.kill9()
    wait_for(lambda: not any(pid_alive(p) for p in inner), timeout=10,
             what="the first worker to die with its namespace")
    assert conn.sismember("rq:workers", f"rq:worker:{first.name}")  # left behind

    second = start(1)
    assert first.name.rsplit(".", 1)[1] == second.name.rsplit(".", 1)[1] == "1"
    assert second.name != first.name
    procs.enqueue("chain", {"steps": 1}, "after-restart")
    view = procs.observer.wait_status("after-restart", "succeeded")
    assert view.worker == second.name
    assert second.alive()


# --------------------------------------------------------------------------------------------
# 12: Redis refuses writes (OOM, READONLY, NOPERM)


def _refuse(admin: redis.Redis, how: str) -> None:
    if how == "oom":
        assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        admin.config_set("maxmemory", 1)  # every write is refused
    elif how == "readonly":
        admin.replicaof("127.0.0.1", free_port())  # a replica of nothing: writes refused
    else:
        admin.acl_setuser("default", enabled=True, nopass=True,
                          categories=["+@all", "-@write"])  # pub/sub, scripts, reads stay


def _allow(admin: redis.Redis, how: str) -> None:
    if how == "oom":
        admin.config_set("maxmemory", 0)
    elif how == "readonly":
        admin.replicaof("NO", "ONE")
    else:
        admin.acl_setuser("default", enabled=True, nopass=True, categories=["+@all"])


@pytest.mark.parametrize("how,error", [("oom", "OutOfMemoryError"),
                                       ("readonly", "ReadOnlyError"),
                                       ("noperm", "NoPermissionError")])
def test_refused_writes_are_one_line_per_event_backoff_and_resume(
        procs: Procs, redis_server: RedisServer, how: str, error: str) -> None:
    forking, pool = procs.start(workers=1, controller=False), procs.start(
        workers=1, pool=2, controller=False)
    (forking,), (pool,) = forking, pool
    executors = wait_for(lambda: pool.children() if len(pool.children()) == 2 else None,
                         timeout=15, what="2 pool executors")
    # Three long runs keep the three executors (the worker and two in the pool) busy, so
    # each one meets the refused writes.
    busy = [f"busy-{i}" for i in range(3)]
    for run_id in busy:
        procs.enqueue("chain", {"steps": 3, "sleep_s": 1.0}, run_id)
    for run_id in busy:
        procs.observer.wait_attempt(run_id, 1)
    admin = redis_server.client()
    _refuse(admin, how)
    try:
        # At least 3 loop restarts of the forking worker and 2 of each pool executor.
        wait_for(lambda: sum(map(len, _backoffs(forking, error).values())) >= 3 or None,
                 timeout=60, what=f"3 {error} reports of the forking worker")
        wait_for(lambda: (len(found := _backoffs(pool, error)) == 2
                          and min(map(len, found.values())) >= 2) or None,
                 timeout=60, what=f"2 {error} reports of each pool executor")
    finally:
        _allow(admin, how)

    reports = _backoffs(forking, error)
    assert list(reports) == [str(forking.pid)], forking.tail(80)
    pooled = _backoffs(pool, error)
    assert sorted(pooled) == sorted(str(p) for p in executors), pool.tail(80)
    for found in [*reports.values(), *pooled.values()]:
        _check_backoff(found)
    assert RESPAWN_LINE.findall(pool.text()) == []  # no executor died
    assert pool.children() == executors

    # Memory is back: each loop restarts under a new name (same pid) and works again.
    forking.wait_log("*** Listening on", count=2, timeout=60)
    pool.wait_log("*** Listening on", count=4, timeout=60)
    names = forking.names()
    assert len(set(names)) == len(names) and {n.rsplit(".", 1)[1] for n in names} == {
        str(forking.pid)}
    procs.controller()  # redelivers the runs whose executions the OOM ended
    fresh = [f"after-{i}" for i in range(3)]
    for run_id in fresh:
        procs.enqueue("chain", {"steps": 1}, run_id)
    for run_id in busy + fresh:
        procs.observer.wait_status(run_id, "succeeded", timeout=60)
    _no_tracebacks(forking, pool)
    assert forking.alive() and pool.alive()


def test_sigterm_while_backing_off_stops_the_worker(procs: Procs,
                                                    redis_server: RedisServer) -> None:
    """Between two runs of its loop a worker still stops on SIGTERM, at once and cleanly
    (RQ's own handler, still installed then, would talk to the refusing Redis)."""
    (forking,) = procs.start(workers=1, controller=False)
    procs.enqueue("chain", {"steps": 2, "sleep_s": 1.0}, "busy")
    procs.observer.wait_attempt("busy", 1)
    admin = redis_server.client()
    _refuse(admin, "noperm")
    try:
        forking.wait_log("(NoPermissionError: ", count=2)
        forking.signal(signal.SIGTERM)
        code = forking.wait_exit(10)
    finally:
        _allow(admin, "noperm")
    assert code == 0, forking.tail(80)
    _no_tracebacks(forking)


# --------------------------------------------------------------------------------------------
# 23: Redis restarts under running workers


def test_redis_restart_leaves_no_tracebacks(procs: Procs, redis_server: RedisServer) -> None:
    forking, pool = procs.start(workers=1, controller=False), procs.start(
        workers=1, pool=2, controller=True)
    (forking,), (pool,) = forking, pool
    runs = [f"restart-{i}" for i in range(3)]
    for run_id in runs:
        procs.enqueue("chain", {"steps": 4, "sleep_s": 0.5}, run_id)
    for run_id in runs:
        procs.observer.wait_step_started(run_id, "chain.link#1", attempt=1)
    redis_server.kill9()
    time.sleep(2.0)  # the outage itself: what the workers must ride out
    redis_server.restart()
    for run_id in runs:
        procs.observer.wait_status(run_id, "succeeded", timeout=90)
    fresh = [f"fresh-{i}" for i in range(3)]
    for run_id in fresh:
        procs.enqueue("chain", {"steps": 1}, run_id)
    for run_id in fresh:
        procs.observer.wait_status(run_id, "succeeded", timeout=60)
    _no_tracebacks(forking, pool)
    assert forking.alive() and pool.alive()
    assert RESPAWN_LINE.findall(pool.text()) == []


# --------------------------------------------------------------------------------------------
# the pool supervisor's own backoff


def test_pool_supervisor_respawns_dying_executors_with_backoff(procs: Procs) -> None:
    """An executor killed as soon as it appears, four times: each respawn waits at least
    the announced delay, and the delays double (0.5, 1, 2, 4 s)."""
    (pool,) = procs.start(workers=1, pool=1, controller=False)
    killed: list[tuple[int, float]] = []
    for _ in range(4):
        (victim,) = wait_for(lambda: [p for p in pool.children()
                                      if p not in [k for k, _ in killed]] or None,
                             timeout=30, what="a new executor", context=procs.report)
        os.kill(victim, signal.SIGKILL)
        killed.append((victim, time.monotonic()))
    pool.wait_log("exited with -9; restarting it", count=4)
    respawns = RESPAWN_LINE.findall(pool.text())
    assert [int(pid) for _, _, pid, _, _ in respawns] == [k for k, _ in killed]
    delays = [float(d or 0) for *_, d in respawns]
    assert delays == [0.5, 1.0, 2.0, 4.0], respawns
    # The next executor appeared no sooner than the announced delay after each kill.
    for (_, at), (_, next_at), delay in zip(killed, killed[1:], delays, strict=False):
        assert next_at - at >= delay, (killed, delays)
    assert pool.alive()
