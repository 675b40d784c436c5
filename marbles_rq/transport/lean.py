"""RQ as a lean transport: RQ's queues, workers and registries, without the per-delivery
bookkeeping that marbles-rq's store makes redundant (the store, not RQ, knows a run's state).

What one delivery costs RQ's Redis in a marbles-rq worker:

* its pop: ``LMOVE`` from the queue list into the queue's intermediate list (``BLMOVE`` when
  the queues are empty), sent in the same round trip as the cleanup of the delivery before;
* one ``HGETALL`` of its job hash (`Job.fetch`);
* once it completed: ``LREM`` from the intermediate list and ``DEL`` of its job hash, sent
  with the next pop (or when the worker stops).

Nothing else per delivery: no execution records, no started or finished registry entries,
no job or execution heartbeats, no job status, result or counters, no dependents check, no
worker state or current-job writes. The worker's registration (RQ's worker hash, which
``rq info``, rq-dashboard and ``marbles-rq health worker`` read) is renewed at most every
HEARTBEAT_EVERY_S, with the queues it serves added to RQ's set of queues, and the suspension
flag (``rq suspend``) read at most every SUSPENSION_CHECK_EVERY_S. RQ's queues, ``rq info``
and rq-dashboard still see the queues, their lengths and the workers; a delivery that
completed leaves no job behind.

A delivery's outcome:

* completed (the entry point returned: the run settled, parked, was handed back, or the
  delivery was stale): cleaned up as above;
* refused (not a delivery of this deployment, or a planted field; MarblesJob): RQ's own
  failure path (failed registry, job status and result), then taken out of the
  intermediate list; in a lane's keyspace (transport/lanes.py), logged and deleted;
* interrupted (the entry point raised: a Redis error, the store unavailable, a bug; or the
  horse died): logged, and nothing is written to RQ. It never shows up as a failure in RQ's
  registries, and its entry stays in the intermediate list: the controller redelivers a run
  still queued under that delivery after a few seconds, reaps a running one whose lease
  expires, and takes the entry out once the run has moved on
  (``Controller.find_lost``, ``dispatch.InFlight``).

A forked horse tells its worker the outcome by its exit code (EXIT_CODES); any other exit
(a signal, a crash, a fenced horse's EXIT_FENCED) is an interruption, except EXIT_FENCED,
whose run has moved on: it is cleaned up as completed.
"""

from __future__ import annotations

import errno
import logging
import os
import queue as queues
import random
import sys
import threading
import time
from typing import Any

import redis
from rq.exceptions import NoSuchJobError
from rq.job_lifecycle import format_exc_info
from rq.timeouts import HorseMonitorTimeoutException, JobTimeoutException
from rq.utils import as_text
from rq.utils import now as rq_now
from rq.worker import WorkerStatus

from ..engine.execute import EXIT_FENCED
from ..errors import RedisUnavailableError
from .dispatch import MULTI_QUEUE_BLOCK_S, DeliveryInterrupted

log = logging.getLogger("marbles_rq.transport.worker")

HEARTBEAT_EVERY_S = 15.0  # RQ's worker hash lives worker_ttl + 60 s (480 s by default)
# How often a worker reads which priority bands of its queues exist (RQ's queues sets; see
# flow/limits.py): a band that appears is popped from within this long, and an idle
# worker blocks at most this long before it looks again.
BAND_REFRESH_S = 2.0
SUSPENSION_CHECK_EVERY_S = 1.0

DONE, FAILED, INTERRUPTED, REFUSED = "done", "failed", "interrupted", "refused"
EXIT_CODES = {DONE: 0, FAILED: 70, INTERRUPTED: 71, REFUSED: 72}  # a forked horse's outcome


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class LeanWorker:
    """The per-delivery path of a marbles-rq worker, mixed in before RQ's worker class (it
    overrides RQ's documented worker methods: dequeue_job_and_maintain_ttl, execute_job,
    main_work_horse, heartbeat, check_for_suspension, teardown)."""

    # RQ's, set by its worker
    connection: redis.Redis
    name: str
    log: logging.Logger
    queues: list[Any]
    _ordered_queues: list[Any]
    job_class: Any
    serializer: Any
    death_penalty_class: Any
    queue_class: Any

    # deliveries completed, cleaned up with the next pop on their lane's connection:
    # (queue, job id, delete); under _lean_lock (a concurrent worker's executor threads add)
    _lean_done: list[tuple[Any, str, bool]] | None = None
    _lean_flushing: tuple[tuple[Any, str, bool], ...] = ()
    _lean_lock = threading.Lock()
    _lean_next_beat = 0.0
    _lean_next_suspension_check = 0.0
    _lean_idle = False
    _lean_busy = False
    # The pop order with the priority bands found (None: _ordered_queues, no bands), when it
    # is read again (monotonic), and the band queues built so far: (base key, priority).
    _lean_order: list[Any] | None = None
    _lean_bands_due = 0.0
    _lean_band_queues: dict[tuple[str, int], Any] | None = None

    def get_state(self) -> str:
        """Busy while a delivery runs, in this process only (RQ's state field is not written
        per job): RQ's warm shutdown (SIGTERM) waits for a busy worker's delivery to end."""
        if self._lean_busy:
            return WorkerStatus.BUSY
        return super().get_state()  # type: ignore[misc,no-any-return]

    # -- what RQ does per job, here per interval ------------------------------------------

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's worker heartbeat (worker hash TTL and last_heartbeat), at most every
        HEARTBEAT_EVERY_S unless a timeout is asked for, in one round trip."""
        if pipeline is not None:
            super().heartbeat(timeout, pipeline=pipeline)  # type: ignore[misc]
            return
        now = time.monotonic()
        if timeout is None and now < self._lean_next_beat:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            super().heartbeat(timeout, pipeline=pipe)  # type: ignore[misc]
            self._lean_register_queues(pipe, self.connection)
            pipe.execute()
        self._lean_next_beat = now + HEARTBEAT_EVERY_S
        for conn in {id(q.connection): q.connection for q in self.queues
                     if q.connection is not self.connection}.values():
            try:  # a lane's queues, in its keyspace on its node
                with conn.pipeline(transaction=False) as pipe:
                    self._lean_register_queues(pipe, conn)
                    pipe.execute()
            except redis.RedisError as exc:  # the next renewal registers them
                log.debug("worker %s: cannot register its queues (%s)", self.name,
                          _describe(exc))

    def _lean_register_queues(self, pipe: Any, conn: Any) -> None:
        """The queues served on `conn` in their RQ set of queues, as RQ's enqueue adds them:
        a delivery's enqueue adds its queue only when the list was empty (claim_run,
        enqueue_delivery), and the controller finds the deliveries in flight through that
        set."""
        for queue in self.queues:
            if queue.connection is conn:
                pipe.sadd(queue.redis_queues_keys, queue.key)

    def check_for_suspension(self, burst: bool) -> None:
        now = time.monotonic()
        if now < self._lean_next_suspension_check:
            return
        super().check_for_suspension(burst)  # type: ignore[misc]
        self._lean_next_suspension_check = time.monotonic() + SUSPENSION_CHECK_EVERY_S

    # -- the pop ----------------------------------------------------------------------------

    def dequeue_job_and_maintain_ttl(self, timeout: int | None,
                                     max_idle_time: int | None = None) -> Any:
        """The next delivery as (job, queue), or None: in burst mode when the queues are
        empty, else when idle for max_idle_time. The job id stays in its queue's
        intermediate list until the delivery completed."""
        if not self._lean_idle:
            self.set_state(WorkerStatus.IDLE)  # type: ignore[attr-defined]
            self._lean_idle = True
        self.procline("Listening on " + ",".join(self.queue_names()))  # type: ignore[attr-defined]
        idle_since = time.monotonic()
        while True:
            if getattr(self, "_stop_requested", False):
                return None  # a warm shutdown asked while runs execute (LeanConcurrentWorker)
            self.heartbeat()
            if self.should_run_maintenance_tasks:  # type: ignore[attr-defined]
                self.run_maintenance_tasks()  # type: ignore[attr-defined]
            block: float | None = timeout
            if timeout is not None and max_idle_time is not None:
                left = max_idle_time - (time.monotonic() - idle_since)
                if left <= 0:
                    return None
                block = min(timeout, left)
            popped = self._lean_pop(block)
            if popped is None:
                if timeout is None:
                    return None
                continue
            queue, job_id = popped
            try:
                # The queue's own job class and connection: a queue of another lane lives in
                # that lane's keyspace, maybe on another node.
                job = queue.job_class.fetch(job_id, connection=queue.connection,
                                            serializer=self.serializer)
            except NoSuchJobError:  # gone meanwhile (RQ skips it too)
                self._lean_cleanup(queue, job_id, delete=False)
                continue
            except Exception as exc:  # as RQ's dequeue: the job id and queue for the log
                exc.job_id = job_id  # type: ignore[attr-defined]
                exc.queue = queue  # type: ignore[attr-defined]
                raise
            self.reorder_queues(reference_queue=queue)  # type: ignore[attr-defined]
            self.log.debug("Worker %s: dequeued %s from %s", self.name, job_id, queue.name)
            return job, queue

    def _lean_pop(self, block: float | None) -> tuple[Any, str] | None:
        """Move one job id from the first non-empty queue (priority order; the worker's own
        lane first within a priority) into its intermediate list; the cleanups of completed
        deliveries go with the first LMOVE on their connection. `block` None: do not wait;
        else wait up to that long (BLMOVE on the first queue; for several queues at most
        MULTI_QUEUE_BLOCK_S, then the caller sweeps again)."""
        queues = self._lean_queues()
        for queue in queues:
            pipe = queue.connection.pipeline(transaction=False)
            self._lean_flush(pipe, queue.connection)
            pipe.lmove(queue.key, queue.intermediate_queue_key)
            replies = pipe.execute()
            self._lean_flushed(queue.connection)
            if replies[-1] is not None:
                return queue, as_text(replies[-1])
        if block is None:
            return None
        # Block on the first queue's own band (home lane): where most runs arrive. Bands are
        # for backlogs, which the sweep above orders; an idle worker has none.
        first = self._ordered_queues[0]
        wait = block if len(queues) == 1 else min(block, MULTI_QUEUE_BLOCK_S)
        wait = min(wait, BAND_REFRESH_S)  # and look for new bands now and then
        found = first.connection.blmove(first.key, first.intermediate_queue_key,
                                        max(wait, 0.01))  # a float is fine
        return None if found is None else (first, as_text(found))

    def _lean_queues(self) -> list[Any]:
        """The queues to pop, in order: each of the worker's queues in its priority order,
        and within one its bands from the highest priority to the lowest (the queue's own,
        priority 0, among them), each on the home lane first. Which bands exist is read
        from RQ's queues set of each lane at most every BAND_REFRESH_S (one SMEMBERS per
        lane): not per pop, and no band is swept that was never used."""
        now = time.monotonic()
        if now >= self._lean_bands_due:
            self._lean_bands_due = now + BAND_REFRESH_S
            self._lean_order = self._lean_read_bands()
        return self._lean_order or self._ordered_queues

    def _lean_read_bands(self) -> list[Any] | None:
        from ..flow.limit_specs import band_queue, parse_band

        base = self._ordered_queues
        sets: dict[str, Any] = {}  # RQ queues-set key -> its connection
        for queue in base:
            sets.setdefault(queue.redis_queues_keys, queue.connection)
        members: dict[str, set[str]] = {}
        for conn in {id(c): c for c in sets.values()}.values():
            names = [k for k, c in sets.items() if c is conn]
            pipe = conn.pipeline(transaction=False)
            for key in names:
                pipe.smembers(key)
            for key, found in zip(names, pipe.execute(), strict=True):
                members[key] = {as_text(m) for m in found}
        bands: dict[int, set[int]] = {}  # id(base queue) -> its bands besides 0
        for queue in base:
            found_bands = set()
            for member in members.get(queue.redis_queues_keys, ()):
                name, priority = parse_band(member)
                if priority and name == queue.key:
                    found_bands.add(priority)
            bands[id(queue)] = found_bands
        if not any(bands.values()):
            return None
        built = self._lean_band_queues if self._lean_band_queues is not None else {}
        self._lean_band_queues = built
        order: list[Any] = []
        for name in dict.fromkeys(q.name for q in base):
            group = [q for q in base if q.name == name]  # its lanes, the home lane first
            for priority in sorted({p for q in group for p in bands[id(q)]} | {0},
                                   reverse=True):
                for queue in group:
                    if priority == 0:
                        order.append(queue)
                    elif priority in bands[id(queue)]:
                        band = (queue.key, priority)
                        if band not in built:
                            built[band] = type(queue)(
                                band_queue(queue.name, priority), connection=queue.connection,
                                serializer=queue.serializer, job_class=queue.job_class)
                        order.append(built[band])
        return order

    def _lean_cleanup(self, queue: Any, job_id: str, *, delete: bool) -> None:
        with self._lean_lock:
            if self._lean_done is None:
                self._lean_done = []
            self._lean_done.append((queue, job_id, delete))

    def _lean_flush(self, pipe: Any, conn: Any) -> None:
        """Queue on `pipe` the cleanups of completed deliveries whose queue lives on `conn`
        (taken off the list once the pipe succeeded: `_lean_flushed`)."""
        with self._lean_lock:
            self._lean_flushing = tuple(d for d in self._lean_done or ()
                                        if d[0].connection is conn)
        for queue, job_id, delete in self._lean_flushing:
            pipe.lrem(queue.intermediate_queue_key, 1, job_id)
            if delete:
                pipe.delete(queue.job_class.key_for(job_id))

    def _lean_flushed(self, conn: Any) -> None:
        with self._lean_lock:
            if self._lean_done and self._lean_flushing:
                sent = {id(d) for d in self._lean_flushing}
                self._lean_done = [d for d in self._lean_done if id(d) not in sent]
            self._lean_flushing = ()

    def teardown(self) -> None:
        """Clean up what completed before RQ's teardown (the worker stops)."""
        if self._lean_done and not self.is_horse:  # type: ignore[attr-defined]
            try:
                for conn in {id(q.connection): q.connection
                             for q, _, _ in self._lean_done}.values():
                    with conn.pipeline(transaction=False) as pipe:
                        self._lean_flush(pipe, conn)
                        pipe.execute()
                    self._lean_flushed(conn)
                self._lean_done = []
            except redis.RedisError as exc:  # the controller takes the entries out later
                log.warning("worker %s: could not clean up %s completed deliveries (%s)",
                            self.name, len(self._lean_done), _describe(exc))
        super().teardown()  # type: ignore[misc]

    # -- executing --------------------------------------------------------------------------

    def _lean_perform(self, job: Any, queue: Any) -> tuple[str, BaseException | None]:
        """Run the job in this process: DONE, FAILED (RQ's failure path was taken: refused,
        not a delivery) or INTERRUPTED (the entry point raised; logged, and returned)."""
        job.started_at = rq_now()
        job.worker_name = self.name
        self.procline(f"Processing {job.id} from {queue.name} since {time.time()}")  # type: ignore[attr-defined]
        try:
            if job.timeout is not None and job.timeout > 0:  # never a delivery's (-1)
                with self.death_penalty_class(job.timeout, JobTimeoutException, job_id=job.id):
                    job.perform()
            else:
                job.perform()
        except DeliveryInterrupted as stop:
            _log_interrupted(job.id, stop.cause)
            return INTERRUPTED, stop.cause
        except Exception:
            exc_info = sys.exc_info()
            job.ended_at = rq_now()
            self.handle_exception(job, *exc_info)  # type: ignore[attr-defined]
            if getattr(queue, "lane_prefix", None) is not None:
                # RQ's failure path writes its registries in RQ's own keyspace, another slot
                # than this lane's on a cluster: a refused job of a lane is logged (above)
                # and dropped.
                return REFUSED, None
            self.handle_job_failure(job, queue=queue,  # type: ignore[attr-defined]
                                    exc_string=format_exc_info(exc_info))
            return FAILED, None
        self.log.debug("Worker %s: %s done", self.name, job.id)
        return DONE, None

    def _lean_completed(self, job: Any, queue: Any, outcome: str) -> None:
        if outcome in (DONE, FAILED, REFUSED):
            self._lean_cleanup(queue, job.id, delete=outcome != FAILED)


def _log_interrupted(job_id: str, cause: BaseException) -> None:
    if isinstance(cause, redis.RedisError | RedisUnavailableError):
        log.error("job %s stopped on a Redis error (%s); its run is redelivered once its "
                  "lease expires", job_id, _describe(cause))
    else:
        log.error("job %s stopped on an unexpected error; its run is redelivered", job_id,
                  exc_info=(type(cause), cause, cause.__traceback__))


class LeanSimpleWorker(LeanWorker):
    """Executes each delivery in the worker's own process (RQ's SimpleWorker)."""

    def execute_job(self, job: Any, queue: Any) -> None:
        """Run the delivery here. One interrupted by Redis or the store raises its error on
        (after its line is logged), so the worker's loop backs off rather than take, and
        interrupt, every queued delivery while Redis or the store is failing."""
        self._lean_busy = True
        try:
            outcome, cause = self._lean_perform(job, queue)
        finally:
            self._lean_busy = False
        self._lean_completed(job, queue, outcome)
        if outcome == INTERRUPTED and isinstance(cause, redis.RedisError | RedisUnavailableError):
            raise cause


class LeanForkingWorker(LeanWorker):
    """Executes each delivery in a forked horse (RQ's Worker); the horse's exit code is the
    delivery's outcome."""

    _horse_pid: int
    job_monitoring_interval: int

    def execute_job(self, job: Any, queue: Any) -> None:
        self._lean_busy = True
        try:
            self.fork_work_horse(job, queue)  # type: ignore[attr-defined]
            outcome = self._lean_monitor(job, queue)
        finally:
            self._lean_busy = False
        self._lean_completed(job, queue, outcome)

    def main_work_horse(self, job: Any, queue: Any) -> None:
        """The horse: run the delivery, exit with its outcome (RQ's horse bookkeeping,
        execution records and job status, is not done)."""
        random.seed()
        self.setup_work_horse_signals()  # type: ignore[attr-defined]
        self._is_horse = True
        try:
            outcome, _ = self._lean_perform(job, queue)
        except BaseException:
            os._exit(1)
        os._exit(EXIT_CODES[outcome])

    def _lean_monitor(self, job: Any, queue: Any) -> str:
        """Wait for the horse (renewing the worker's registration meanwhile); its outcome."""
        retpid = ret_val = rusage = None
        while True:
            try:
                with self.death_penalty_class(self.job_monitoring_interval,
                                              HorseMonitorTimeoutException):
                    retpid, ret_val, rusage = self.wait_for_horse()  # type: ignore[attr-defined]
                break
            except HorseMonitorTimeoutException:
                self.heartbeat()
            except OSError as exc:
                if exc.errno != errno.EINTR:
                    raise
                self.heartbeat()
        self._horse_pid = 0
        if ret_val is not None and os.WIFEXITED(ret_val):
            code = os.WEXITSTATUS(ret_val)
            if code == EXIT_CODES[DONE] or code == EXIT_FENCED:
                return DONE  # EXIT_FENCED: the run has moved on; this delivery is over
            if code == EXIT_CODES[FAILED]:
                return FAILED
            if code == EXIT_CODES[REFUSED]:
                return REFUSED
            if code == EXIT_CODES[INTERRUPTED]:
                return INTERRUPTED
        # Killed, or crashed outside the delivery's code: nothing wrote an outcome.
        self.handle_work_horse_killed(job, retpid, ret_val, rusage)  # type: ignore[attr-defined]
        return INTERRUPTED


class LeanConcurrentWorker(LeanWorker):
    """Executes up to `concurrency` deliveries at once in this process, each in one of as
    many executor threads (an async body on that thread's event loop: engine/async_run.py).
    The main thread pops while a thread is free; the process's one watchdog thread renews
    every execution's lease (engine/watchdog_hub.py). A warm shutdown (SIGTERM) stops
    popping and waits for the deliveries executing; a cold one ends them with the process,
    and they are redelivered as after a kill -9."""

    concurrency = 1
    _lean_active = 0
    _lean_cv: threading.Condition | None = None
    _lean_jobs: queues.SimpleQueue[tuple[Any, Any] | None] | None = None
    _lean_trouble: BaseException | None = None  # a Redis error that interrupted a delivery
    _lean_cold = False  # a second SIGTERM/SIGINT: the deliveries end with the process

    def _lean_threads(self) -> tuple[threading.Condition,
                                     queues.SimpleQueue[tuple[Any, Any] | None]]:
        if self._lean_cv is None or self._lean_jobs is None:
            self._lean_cv = threading.Condition()
            self._lean_jobs = queues.SimpleQueue()
            for i in range(self.concurrency):
                # Daemons: a cold shutdown must not wait for the bodies executing.
                threading.Thread(target=self._lean_executor, name=f"marbles-exec-{i}",
                                 daemon=True).start()
        return self._lean_cv, self._lean_jobs

    def execute_job(self, job: Any, queue: Any) -> None:
        """Hand the delivery to a free executor thread; return once another is free (or
        raise the Redis error that interrupted a delivery, so the worker backs off)."""
        cv, jobs = self._lean_threads()
        with cv:
            self._lean_active += 1
            self._lean_busy = True
        jobs.put((job, queue))
        with cv:
            cv.wait_for(lambda: self._lean_active < self.concurrency
                        or self._lean_trouble is not None)
            trouble, self._lean_trouble = self._lean_trouble, None
        if trouble is not None:
            raise trouble

    def _lean_executor(self) -> None:
        assert self._lean_cv is not None and self._lean_jobs is not None
        cv, jobs = self._lean_cv, self._lean_jobs
        while True:
            item = jobs.get()
            if item is None:
                return  # the worker tore down: a rebuilt one starts threads of its own
            job, queue = item
            outcome, cause = INTERRUPTED, None
            try:
                outcome, cause = self._lean_perform(job, queue)
            except BaseException as exc:  # a bug in the transport: logged, redelivered
                log.exception("job %s: the executor failed", job.id)
                cause = exc
            finally:
                self._lean_completed(job, queue, outcome)
                with cv:
                    self._lean_active -= 1
                    self._lean_busy = self._lean_active > 0
                    if outcome == INTERRUPTED and isinstance(
                            cause, redis.RedisError | RedisUnavailableError):
                        self._lean_trouble = cause
                    cv.notify_all()

    def dequeue_job_and_maintain_ttl(self, timeout: int | None,
                                     max_idle_time: int | None = None) -> Any:
        """As LeanWorker's; in burst mode, an empty queue ends the worker only once nothing
        executes here (a run executing may still enqueue a child or a wake)."""
        while True:
            found = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            if found is not None or timeout is not None or not self._lean_active:
                return found
            cv, _ = self._lean_threads()
            with cv:
                cv.wait(0.2)

    def request_force_stop(self, signum: int, frame: Any) -> None:
        try:
            super().request_force_stop(signum, frame)  # type: ignore[misc]
        except SystemExit:
            self._lean_cold = True
            raise

    def teardown(self) -> None:
        """Wait for the deliveries executing (a warm shutdown), then clean up. A cold one
        ends the process once cleaned up, its deliveries with it (they are redelivered):
        the interpreter's exit would wait for the sync steps' pool threads, and the
        executor threads would go on executing meanwhile."""
        if self._lean_cold:
            super().teardown()
            logging.shutdown()
            os._exit(0)
        if self._lean_cv is not None and self._lean_jobs is not None:
            with self._lean_cv:
                self._lean_cv.wait_for(lambda: self._lean_active == 0)
            # `work` rebuilds the worker after a Redis error: without this, each rebuild
            # would leave `concurrency` idle threads behind.
            for _ in range(self.concurrency):
                self._lean_jobs.put(None)
        super().teardown()
