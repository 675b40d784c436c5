"""`marbles-rq worker`: RQ workers that execute run deliveries.

By default each delivery runs in its own forked work-horse (RQ's Worker): a body that
crashes, leaks or corrupts its interpreter takes only its own delivery down. RQ's horse
calls setpgrp(), so a kill of the worker alone would leave it running; here the horse asks
the kernel to SIGKILL it when its parent dies (and fencing refuses its writes even if it
outlived it). ``--pool N`` runs N non-forking executors
(RQ's SimpleWorker) under a supervisor that restarts any that die, with a capped
exponential backoff for executors that keep dying young.

A worker listens on the RQ queues of its own deployment (``<prefix>.<queue>``) under a
name that is unique per start (``<host>.<random>.<pid>``): a worker restarted with the same
pid and hostname (a container) must not collide with its predecessor's registration, which
RQ keeps for minutes after a hard kill.

Each delivery takes RQ's lean path (transport/lean.py): its pop, one read of its job and its
cleanup, and none of RQ's per-job bookkeeping.

Redis errors (unreachable, LOADING, OOM, MISCONF, READONLY, NOPERM, script errors) never end
the process: each is one log line, then the worker is rebuilt after a capped exponential
backoff.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import os
import select
import signal
import socket
import sys
import time
import uuid
from typing import Any

import redis
from rq import SimpleWorker, Worker, worker_registration
from rq.utils import now as rq_now

from .. import metrics, tracing
from ..engine.execute import Engine, configure
from ..errors import RedisUnavailableError
from ..store.records import warm_decoders
from .dispatch import (
    MarblesJob,
    MarblesQueue,
    RefusedJobError,
    clean_registries,
    serve_prefix,
)
from .lanes import Lanes, as_lanes
from .lean import LeanConcurrentWorker, LeanForkingWorker, LeanSimpleWorker
from .liveness import beating
from .serializer import JSONSerializer
from .served import served_text

log = logging.getLogger("marbles_rq.transport.worker")

_PR_SET_PDEATHSIG = 1

BACKOFF_FIRST_S = 0.5
BACKOFF_CAP_S = 30.0
HEALTHY_S = 10.0  # a worker or executor that ran this long before failing starts afresh


class Backoff:
    """Capped exponential delays: first, 2 x first, ... up to cap; `reset` starts over."""

    def __init__(self, first: float = BACKOFF_FIRST_S, cap: float = BACKOFF_CAP_S) -> None:
        self.first, self.cap, self.failures = first, cap, 0

    def next(self) -> float:
        delay: float = min(self.first * 2.0 ** self.failures, self.cap)
        self.failures += 1
        return delay

    def reset(self) -> None:
        self.failures = 0


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux); exit now if it already has."""
    # Not Linux: fencing still refuses an orphan's writes.
    with contextlib.suppress(OSError, AttributeError):
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def worker_name() -> str:
    """Unique per start. The pid stays the last dotted part (operators and tests read it);
    the random part keeps a restart with the same hostname and pid from colliding."""
    return f"{socket.gethostname()}.{uuid.uuid4().hex[:8]}.{os.getpid()}"


class RedisTrouble(SystemExit):
    """A Redis error inside RQ's work loop. RQ logs any other exception there with a full
    traceback ("found an unhandled exception, quitting..."); a SystemExit it lets through,
    so this carries the error to `work`, which logs one line and backs off. It never
    escapes `work`."""

    def __init__(self, cause: redis.RedisError | RedisUnavailableError) -> None:
        super().__init__(1)
        self.cause = cause


class _RedisErrorsOut:
    """The Redis-touching steps of RQ's work loop, with Redis errors turned into
    RedisTrouble. (A connection lost in the blocking pop itself RQ reports in one line and
    retries; the heartbeat before its retry then ends the loop here if Redis is still
    away.)"""

    def check_for_suspension(self, burst: bool) -> None:
        try:
            super().check_for_suspension(burst)  # type: ignore[misc]
        except redis.RedisError as exc:
            raise RedisTrouble(exc) from exc

    def run_maintenance_tasks(self) -> None:
        try:
            super().run_maintenance_tasks()  # type: ignore[misc]
        except redis.RedisError as exc:
            raise RedisTrouble(exc) from exc

    def heartbeat(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().heartbeat(*args, **kwargs)  # type: ignore[misc]
        except redis.RedisError as exc:
            raise RedisTrouble(exc) from exc

    def dequeue_job_and_maintain_ttl(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().dequeue_job_and_maintain_ttl(*args, **kwargs)  # type: ignore[misc]
        except redis.RedisError as exc:
            raise RedisTrouble(exc) from exc

    def execute_job(self, job: Any, queue: Any) -> None:
        # A delivery interrupted by Redis or the store (transport/lean.py) ends up here too:
        # the worker backs off instead of taking the next one at once.
        try:
            super().execute_job(job, queue)  # type: ignore[misc]
        except (redis.RedisError, RedisUnavailableError) as exc:
            raise RedisTrouble(exc) from exc

    def handle_exception(self, job: Any, *exc_info: Any) -> None:
        """A refused job, or one that stopped on a Redis error, is one line; RQ would log a
        traceback for each (marbles-rq installs no exception handlers to call). (A delivery
        interrupted inside marbles-rq's entry point never gets here: transport/lean.py.)"""
        exc = exc_info[1]
        if isinstance(exc, RedisTrouble):
            exc = exc.cause
        if isinstance(exc, (redis.RedisError, RedisUnavailableError)):
            log.error("job %s stopped on a Redis error (%s); its run is redelivered once its "
                      "lease expires", job.id, _describe(exc))
        elif isinstance(exc, RefusedJobError):
            log.error("%s", exc)
        else:
            super().handle_exception(job, *exc_info)  # type: ignore[misc]


class _MarblesMaintenance:
    """RQ's registry maintenance (BaseWorker.clean_registries, same steps), except that an
    abandoned job found in a started registry is handled through a MarblesQueue, which
    never enqueues dependents (see dispatch.clean_registries)."""

    queues: list[Any]
    name: str
    log: logging.Logger
    _exc_handlers: list[Any]
    last_cleaned_at: Any

    def clean_registries(self) -> None:
        for queue in self.queues:
            if getattr(queue, "lane_prefix", None) is not None:
                continue  # a lane's keyspace: no registries are written there to clean
            if queue.acquire_maintenance_lock():  # one worker per queue at a time
                self.log.info("Worker %s: cleaning registries for queue: %s", self.name,
                              queue.name)
                clean_registries(queue, self._exc_handlers)
                worker_registration.clean_worker_registry(queue)
                queue.intermediate_queue.cleanup(self, queue)
                queue.release_maintenance_lock()
        self.last_cleaned_at = rq_now()


class _AbandonOnHorseDeath:
    """When a horse dies under us, expire its lease now: the controller redelivers on its
    next pass instead of waiting for the lease to run out."""

    name: str

    def handle_work_horse_killed(self, job: Any, retpid: int, ret_val: int, rusage: Any) -> None:
        from ..engine.execute import engine

        metrics.horse_died()
        try:
            run_id, attempt = job.args
            status = engine().runs.abandon(run_id, int(attempt), self.name)
            log.warning("work-horse of run %s attempt %s died (%s); lease %s", run_id, attempt,
                        ret_val, "expired for redelivery" if status == "ok" else "untouched")
        except Exception as exc:  # the lease will simply expire
            log.warning("could not expire the lease of a dead horse's run: %s", exc)


def _before_first_fork() -> None:
    """What every horse would otherwise do for itself: build the records' decoders, find
    libc; then move what the worker holds by now out of the garbage collector's reach
    (gc.freeze), so a collection in a horse does not walk, and copy, the worker's heap."""
    warm_decoders()
    with contextlib.suppress(OSError):
        _libc()
    gc.collect()
    gc.freeze()


class MarblesWorker(_RedisErrorsOut, _MarblesMaintenance, _AbandonOnHorseDeath,
                    LeanForkingWorker, Worker):
    """RQ's forking Worker on the lean path, whose horses die with it."""

    _marbles_forked = False

    def fork_work_horse(self, job: Any, queue: Any) -> None:
        if not self._marbles_forked:
            _before_first_fork()
            self._marbles_forked = True
        self._marbles_parent = os.getpid()
        super().fork_work_horse(job, queue)

    def main_work_horse(self, job: Any, queue: Any) -> None:
        die_with_parent(self._marbles_parent)
        # One horse at a time per worker: each takes over its predecessor's metric files.
        metrics.name_process(f"horse-{self._marbles_parent}")
        tracing.exit_after_each_delivery()
        super().main_work_horse(job, queue)


class MarblesSimpleWorker(_RedisErrorsOut, _MarblesMaintenance, LeanSimpleWorker,
                          SimpleWorker):
    """Executes deliveries in its own process (no fork per run), on the lean path."""


class MarblesConcurrentWorker(_RedisErrorsOut, _MarblesMaintenance, LeanConcurrentWorker,
                              SimpleWorker):
    """Executes up to `concurrency` deliveries at once in its own process (threads)."""


def concurrent(size: int) -> type[Any]:
    """The worker class that executes up to `size` deliveries at once in one process."""
    return type(f"MarblesConcurrentWorker{size}", (MarblesConcurrentWorker,),
                {"concurrency": size})


def build_worker(cls: type[Any], queues: list[str], lanes: Lanes, prefix: str,
                 name: str | None = None, *, serve: list[int] | None = None,
                 home: int | None = None) -> Any:
    """An RQ worker registered in RQ's own keyspace, popping from queues `queues` (priority
    order) of the lanes `serve` (default all): within one priority its `home` lane first
    (blocking there when idle), then the others, so an idle executor helps a busy lane."""
    served = serve if serve is not None else list(range(lanes.count))
    first = home if home is not None else served[0]
    order = [first, *(k for k in served if k != first)]
    worker = cls([lanes.lane(k).queue(prefix, q) for q in queues for k in order],
                 connection=lanes.registration, serializer=JSONSerializer,
                 job_class=MarblesJob, queue_class=MarblesQueue, name=name or worker_name())
    # RQ raises its own connection's socket timeout above its blocking pop's (Worker.
    # _set_connection); a lane on another connection blocks there too.
    for lane in {id(lane.conn): lane for lane in lanes.lanes}.values():
        options = lane.conn.connection_pool.connection_kwargs
        if (options.get("socket_timeout") or 0) < worker.connection_timeout:
            options["socket_timeout"] = worker.connection_timeout
    return worker


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _StopAsked(Exception):
    """SIGTERM/SIGINT while `work` waits between two runs of the worker loop."""


def _stop_asked(_signum: int, _frame: Any) -> None:
    raise _StopAsked


def _asked_to_stop(worker: Any) -> bool:
    # RQ sets _stop_requested only when it was busy; the shutdown date always.
    return bool(worker._stop_requested or worker._shutdown_requested_date is not None)


def work(engine: Engine, cls: type[Any], queues: list[str], rq: Lanes | redis.Redis, *,
         burst: bool, logging_level: str = "INFO", serve: list[int] | None = None,
         home: int | None = None) -> None:
    """Run one worker until asked to stop. A Redis error of any kind is one log line; the
    worker is rebuilt (under a new name) after a capped exponential backoff."""
    backoff = Backoff()
    prefix = engine.runs.keys.prefix
    if issubclass(cls, LeanConcurrentWorker):
        # A fenced execution must not end the process: the others executing here go on.
        engine.hard_exit = False
    lanes = as_lanes(rq, engine.runs.keys)
    while True:
        started = time.monotonic()
        name = worker_name()
        worker: Any = None
        try:
            engine.runs.client.ping()  # the store may be another Redis than RQ's
            worker = build_worker(cls, queues, lanes, prefix, name, serve=serve, home=home)
            engine.worker_name = name
            engine.deliver = lanes.enqueue
            configure(engine)
            serve_prefix(prefix)
            with beating(engine.runs, name, idle=functools.partial(_no_horse, worker),
                         lanes=serve, versions=served_text(engine.registry)):
                worker.work(burst=burst, logging_level=logging_level, with_scheduler=False)
        except _StopAsked:
            return  # asked before RQ's loop installed its own handlers
        except RedisTrouble as trouble:
            failure: BaseException | None = trouble.cause
            metrics.redis_error(trouble.cause)
        except (redis.RedisError, RedisUnavailableError) as exc:
            failure = exc
            metrics.redis_error(exc)
        else:
            if burst or _asked_to_stop(worker):
                return
            failure = None  # RQ logged why its loop ended
        if worker is not None and _asked_to_stop(worker):
            return
        if time.monotonic() - started >= HEALTHY_S:
            backoff.reset()
        delay = backoff.next()
        if failure is not None:
            log.error("Redis error in worker %s (%s); restarting it in %.1f s", name,
                      _describe(failure), delay)
        else:
            log.error("worker %s stopped on an error (see above); restarting it in %.1f s",
                      name, delay)
        # RQ's handlers stay installed after its loop ends, and talk to Redis: a stop asked
        # from here on ends `work` instead.
        signal.signal(signal.SIGTERM, _stop_asked)
        signal.signal(signal.SIGINT, _stop_asked)
        try:
            time.sleep(delay)
        except _StopAsked:
            if worker is not None:
                _kill_orphaned_horse(worker)
            return
        if worker is not None:
            _kill_orphaned_horse(worker)
            with contextlib.suppress(redis.RedisError):
                worker.register_death()  # its teardown may not have reached Redis


def _horse_pid(worker: Any) -> int:
    """The pid of the worker's live horse, 0 if none (always 0 for a SimpleWorker)."""
    return int(getattr(worker, "_horse_pid", 0) or 0)


def _no_horse(worker: Any) -> bool:
    return not _horse_pid(worker)


def _kill_orphaned_horse(worker: Any) -> None:
    """A worker whose loop broke mid-run may leave its horse running; it is fenced, but a
    restarted loop must not run beside it."""
    pid = _horse_pid(worker)
    if pid:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def run_pool(engine: Engine, queues: list[str], rq: Lanes | redis.Redis, *, size: int,
             burst: bool, logging_level: str = "INFO", serve: list[int] | None = None,
             concurrency: int = 1) -> None:
    """N non-forking executors under a supervisor that restarts any that die: at once if it
    had run for HEALTHY_S, else after a capped exponential backoff per slot, so executors
    that die at birth are not respawned in a tight loop. Executor i's home lane is the i-th
    of the served lanes, round robin; each helps the others when its own is empty. Each
    executes up to `concurrency` deliveries at once."""
    executor = MarblesSimpleWorker if concurrency <= 1 else concurrent(concurrency)
    served = serve if serve is not None else list(range(as_lanes(rq, engine.runs.keys).count))
    supervisor = os.getpid()
    children: dict[int, tuple[int, float]] = {}  # pid -> (slot, started)
    pending: dict[int, float] = {}  # slot -> when to respawn it (monotonic)
    backoffs = {slot: Backoff() for slot in range(size)}
    # Signal handlers only write a byte here (no locks: a handler may interrupt anything);
    # the loop sleeps on it until a child exits, a stop is asked, or a respawn is due.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    stopping = False

    def wake(*_args: Any) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(wake_w, b"\0")

    def spawn(slot: int) -> None:
        pid = os.fork()
        if pid == 0:
            die_with_parent(supervisor)
            # A slot is refilled only once its last process was reaped: one writer per name.
            metrics.name_process(f"pool-{supervisor}-{slot}")
            os.close(wake_r)
            os.close(wake_w)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            try:
                work(engine, executor, queues, rq, burst=burst,
                     logging_level=logging_level, serve=served,
                     home=served[slot % len(served)])
            except BaseException:
                logging.getLogger("marbles_rq.transport.worker").exception("pool executor crashed")
                os._exit(1)
            os._exit(0)
        children[pid] = (slot, time.monotonic())

    def exited(pid: int, status: int) -> None:
        if pid not in children:
            return
        slot, born = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if stopping or (burst and code == 0):
            return
        if time.monotonic() - born >= HEALTHY_S:
            delay = 0.0
            backoffs[slot].reset()
        else:
            delay = backoffs[slot].next()
        log.warning("pool executor %s (pid %s) exited with %s; restarting it%s", slot, pid,
                    code, f" in {delay:.1f} s" if delay else "")
        pending[slot] = time.monotonic() + delay

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        pending.clear()
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)
        wake()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGCHLD, wake)
    for slot in range(size):
        spawn(slot)
    while True:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            exited(pid, status)
        now = time.monotonic()
        for slot, due in sorted(pending.items()):  # a copy: `stop` may clear it meanwhile
            if due <= now and not stopping and pending.pop(slot, None) is not None:
                spawn(slot)
        dues = list(pending.values())
        if not children and not dues:
            break
        timeout = max(0.0, min(dues) - now) if dues else None
        if select.select([wake_r], [], [], timeout)[0]:
            os.read(wake_r, 4096)  # drained before reaping: a later exit writes again
    os.close(wake_r)
    os.close(wake_w)
    sys.stdout.flush()
