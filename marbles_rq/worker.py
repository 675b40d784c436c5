"""`marbles-rq worker`: RQ workers that execute run deliveries.

By default each delivery runs in its own forked work-horse (RQ's Worker), like Foundry's
process per run. RQ's horse calls setpgrp(), so a kill of the worker alone would leave it
running; here the horse asks the kernel to SIGKILL it when its parent dies (and fencing
refuses its writes even if it outlived it). ``--pool N`` runs N non-forking executors
(RQ's SimpleWorker) under a supervisor that restarts any that die.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

import redis
from rq import SimpleWorker, Worker

from .dispatch import MarblesJob
from .execute import Engine, configure
from .serializer import JSONSerializer

log = logging.getLogger("marbles_rq.worker")

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux); exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: fencing still refuses an orphan's writes
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


class _AbandonOnHorseDeath:
    """When a horse dies under us, expire its lease now: the controller redelivers on its
    next pass instead of waiting for the lease to run out."""

    name: str

    def handle_work_horse_killed(self, job: Any, retpid: int, ret_val: int, rusage: Any) -> None:
        from .execute import engine

        try:
            run_id, attempt = job.args
            status = engine().runs.abandon(run_id, int(attempt), self.name)
            log.warning("work-horse of run %s attempt %s died (%s); lease %s", run_id, attempt,
                        ret_val, "expired for redelivery" if status == "ok" else "untouched")
        except Exception as exc:  # the lease will simply expire
            log.warning("could not expire the lease of a dead horse's run: %s", exc)


class MarblesWorker(_AbandonOnHorseDeath, Worker):
    """RQ's forking Worker whose horses die with it."""

    def fork_work_horse(self, job: Any, queue: Any) -> None:
        self._marbles_parent = os.getpid()
        super().fork_work_horse(job, queue)

    def main_work_horse(self, job: Any, queue: Any) -> None:
        die_with_parent(self._marbles_parent)
        super().main_work_horse(job, queue)


class MarblesSimpleWorker(SimpleWorker):
    """Executes deliveries in its own process (no fork per run)."""


def build_worker(cls: type[Any], queues: list[str], conn: redis.Redis) -> Any:
    return cls(queues, connection=conn, serializer=JSONSerializer, job_class=MarblesJob,
               name=f"{socket.gethostname()}.{os.getpid()}")


def work(engine: Engine, cls: type[Any], queues: list[str], conn: redis.Redis, *,
         burst: bool, logging_level: str = "INFO") -> None:
    """Run one worker until asked to stop; ride out Redis outages with a clear message."""
    delay = 1.0
    while True:
        worker = build_worker(cls, queues, conn)
        engine.worker_name = worker.name
        configure(engine)
        try:
            worker.work(burst=burst, logging_level=logging_level, with_scheduler=False)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.error("Redis unavailable (%s)", exc)
        else:
            if burst or worker._stop_requested or worker._shutdown_requested_date is not None:
                return  # SIGTERM/SIGINT: RQ sets _stop_requested only when it was busy
            log.error("worker %s stopped on an error (see above)", worker.name)
        while True:
            try:
                conn.ping()
                engine.runs.client.ping()
                break
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.error("waiting for Redis (%s); retrying in %.0f s; runs in flight are "
                          "redelivered once their leases expire", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 30.0)
        delay = 1.0
        _kill_orphaned_horse(worker)
        with contextlib.suppress(redis.RedisError):
            worker.register_death()  # its teardown may not have reached Redis; free the name
        log.info("Redis is back; restarting the worker")


def _kill_orphaned_horse(worker: Any) -> None:
    """A worker whose loop broke mid-run may leave its horse running; it is fenced, but a
    restarted loop must not run beside it."""
    pid = getattr(worker, "_horse_pid", 0)
    if pid:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def run_pool(engine: Engine, queues: list[str], conn: redis.Redis, *, size: int, burst: bool,
             logging_level: str = "INFO") -> None:
    """N non-forking executors under a supervisor that restarts any that die."""
    supervisor = os.getpid()
    children: dict[int, int] = {}  # pid -> slot
    stopping = False

    def spawn(slot: int) -> None:
        pid = os.fork()
        if pid == 0:
            die_with_parent(supervisor)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            try:
                work(engine, MarblesSimpleWorker, queues, conn, burst=burst,
                     logging_level=logging_level)
            except BaseException:
                logging.getLogger("marbles_rq.worker").exception("pool executor crashed")
                os._exit(1)
            os._exit(0)
        children[pid] = slot

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for slot in range(size):
        spawn(slot)
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid not in children:
            continue
        slot = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if stopping or (burst and code == 0):
            continue
        log.warning("pool executor %s (pid %s) exited with %s; restarting it", slot, pid, code)
        spawn(slot)
    sys.stdout.flush()
