"""RQ as transport: one RQ job per delivery, carrying only (run id, attempt).

Everything marbles-rq puts into RQ carries the deployment's key prefix, so two deployments
on one Redis never see each other's deliveries:

* the RQ queue of marbles queue ``q`` under prefix ``P`` is ``P.q`` (queue names are
  ``[A-Za-z0-9_-]``, so the last ``.`` separates them);
* the job id of a delivery is ``<prefix>-<run id>-a<attempt>``. RQ allows only
  ``[A-Za-z0-9_-]`` in job ids, so ``_``, ``.`` and ``:`` are escaped (``__``, ``_d``,
  ``_c``) in both parts, and ``-`` too in the prefix (``_h``): the first ``-`` ends the
  prefix and the last ``-a`` starts the attempt, so :func:`parse_delivery_id` is the exact
  inverse of :func:`delivery_id`.

:class:`MarblesJob` runs nothing but marbles-rq's entry point with ``(run id, attempt)``
under that id, and ignores every other job field that would make RQ import or call
something (callbacks, webhooks, dependencies, retries, repeats).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue
from rq.exceptions import DequeueTimeout, DuplicateJobError
from rq.job import Job
from rq.registry import (
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    StartedJobRegistry,
)

from ..errors import ConfigError, MarblesError
from ..store.connection import socket_timeout_from_env
from ..store.ids import ID_PATTERN
from .serializer import JSONSerializer

ENTRY = "marbles_rq.engine.execute.execute_delivery"
# A worker serving several queues blocks this long on its first queue between sweeps: the
# most a job on a lower-priority queue waits when the worker is idle.
MULTI_QUEUE_BLOCK_S = 0.5
RESULT_TTL_S = 300
FAILURE_TTL_S = 7 * 24 * 3600

_RUN_ESCAPES = {"_": "__", ".": "_d", ":": "_c"}
_PREFIX_ESCAPES = {**_RUN_ESCAPES, "-": "_h"}
_UNESCAPE = {"_": "_", "d": ".", "c": ":", "h": "-"}
_ATTEMPT = re.compile(r"[1-9][0-9]{0,17}")


class RefusedJobError(MarblesError):
    """An RQ job that is not a marbles-rq delivery reached a marbles-rq worker."""

    code = "refused_job"


# -- names ------------------------------------------------------------------------------------


def _escape(text: str, table: dict[str, str]) -> str:
    return "".join(table.get(ch, ch) for ch in text)


def _unescape(text: str, allowed: str) -> str | None:
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "_":
            code = text[i + 1:i + 2]
            if code == "" or code not in allowed:
                return None
            out.append(_UNESCAPE[code])
            i += 2
            continue
        if not (ch.isascii() and (ch.isalnum() or ch == "-")):
            return None
        out.append(ch)
        i += 1
    return "".join(out)


def rq_queue_name(prefix: str, queue: str) -> str:
    """The RQ queue that carries marbles queue `queue` of deployment `prefix`."""
    return f"{prefix}.{queue}"


def delivery_id(prefix: str, run_id: str, attempt: int) -> str:
    """The RQ job id of delivery `attempt` of run `run_id` in deployment `prefix`."""
    return f"{_escape(prefix, _PREFIX_ESCAPES)}-{_escape(run_id, _RUN_ESCAPES)}-a{attempt}"


def parse_delivery_id(prefix: str, job_id: str) -> tuple[str, int] | None:
    """(run id, attempt) of a delivery id of deployment `prefix`; None for any other job
    id (another prefix's delivery, or not a delivery at all)."""
    head = _escape(prefix, _PREFIX_ESCAPES) + "-"
    if not job_id.startswith(head):
        return None
    body, sep, attempt = job_id[len(head):].rpartition("-a")
    if not sep or not _ATTEMPT.fullmatch(attempt):
        return None
    run_id = _unescape(body, "_dc")
    if run_id is None or not ID_PATTERN.fullmatch(run_id):
        return None
    parsed = (run_id, int(attempt))
    # The id must be the one delivery_id spells: no second spelling of the same delivery.
    return parsed if delivery_id(prefix, *parsed) == job_id else None


# -- the job ----------------------------------------------------------------------------------

# Job hash fields that make RQ import, call, request or enqueue something besides the job's
# function. A delivery never has them; a job that does was planted, and is refused.
FORBIDDEN_FIELDS = (
    "success_callback_name", "failure_callback_name", "stopped_callback_name", "webhooks",
    "dependency_ids", "dependency_id", "retries_left",
    "retry_intervals", "repeats_left", "repeat_intervals", "group_id",
)


class MarblesJob(Job):
    """Runs only marbles-rq's entry point, with (run id: str, attempt: int), under the job id
    that delivery has in this worker's deployment.

    RQ resolves callbacks by name (``import_attribute``), sends webhooks, enqueues
    dependents, retries and repeats from fields of the job hash, in code paths outside
    ``_execute`` (the worker, registry cleanup). Here those fields are dropped when the job
    is read, the callback properties never import, and a job that carried any of them is
    refused at ``_execute``."""

    _marbles_planted: tuple[str, ...] = ()

    def restore(self, raw_data: Any) -> Any:
        # RQ writes some of these fields empty on every job; only a value means something.
        present = {(k.decode() if isinstance(k, bytes) else str(k))
                   for k, v in raw_data.items() if v not in (None, b"", "")}
        self._marbles_planted = tuple(f for f in FORBIDDEN_FIELDS if f in present)
        result = super().restore(raw_data)
        self._success_callback_name = self._failure_callback_name = None
        self._stopped_callback_name = None
        self.webhooks = []
        self._dependency_ids = []
        self.retries_left = self.retry_intervals = None
        self.repeats_left = self.repeat_intervals = None
        self.group_id = None
        return result

    # Never import a callback, whatever the hash says (restore clears the names as well).
    @property
    def success_callback(self) -> None:
        return None

    @property
    def failure_callback(self) -> None:
        return None

    @property
    def stopped_callback(self) -> None:
        return None

    @property
    def should_retry(self) -> bool:
        return False

    def send_webhooks(self, status: Any, *, exc_string: str | None = None) -> None:
        return None

    def _execute(self) -> Any:
        from ..engine.execute import engine

        prefix = engine().runs.keys.prefix
        args = self.args
        if self._marbles_planted:
            raise RefusedJobError(f"refusing job {self.id}: it carries "
                                  f"{', '.join(self._marbles_planted)}, which no marbles-rq "
                                  f"delivery has")
        if (self.func_name != ENTRY or self.instance is not None or self.kwargs
                or len(args) != 2 or not isinstance(args[0], str)
                or type(args[1]) is not int):
            raise RefusedJobError(f"refusing job {self.id}: {self.func_name!r} is not a "
                                  f"marbles-rq delivery")
        if parse_delivery_id(prefix, self.id) != (args[0], args[1]):
            raise RefusedJobError(f"refusing job {self.id}: not the id of delivery "
                                  f"{args[1]} of run {args[0]!r} under prefix {prefix!r}")
        return super()._execute()


class MarblesQueue(Queue):
    """A queue whose jobs never enqueue dependents: a delivery has none, and a dependents set
    planted next to a delivery's job must not make the worker enqueue anything."""

    def enqueue_dependents(self, job: Any, pipeline: Any = None, exclude_job_id: Any = None,
                           refresh_job_status: bool = True) -> None:
        return None

    @classmethod
    def lpop(cls, queue_keys: Any, timeout: int | None, connection: Any = None) -> Any:
        """The pop of a worker serving several queues. RQ's BLPOP leaves no trace of a job
        between the pop and the worker's bookkeeping, so a kill there loses the delivery
        where nobody can see it. Move it into the queue's intermediate list instead (as RQ
        does for one queue), where the controller finds a delivery lost before its run
        started: sweep the queues in priority order, then block briefly on the first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for key in queue_keys:
                popped = cls.lmove(connection, key, None)
                if popped is not None:
                    return popped
            if deadline is None:
                return None  # burst mode: the queues are empty
            if time.monotonic() >= deadline:
                raise DequeueTimeout(timeout, queue_keys)
            found = connection.blmove(queue_keys[0], f"{queue_keys[0]}:intermediate",
                                      MULTI_QUEUE_BLOCK_S)
            if found is not None:
                return queue_keys[0], found


class MarblesStartedJobRegistry(StartedJobRegistry):
    """RQ's started registry, whose cleanup of an expired (abandoned) job hands it to a
    MarblesQueue. RQ's own uses a plain Queue, which enqueues the job's dependents."""

    def get_queue(self) -> Queue:
        return MarblesQueue(self.name, connection=self.connection, serializer=self.serializer,
                            job_class=self.job_class)


def clean_registries(queue: Queue, exception_handlers: list[Any] | None = None) -> None:
    """rq.registry.clean_registries, with MarblesStartedJobRegistry for the started one."""
    options: dict[str, Any] = dict(connection=queue.connection, job_class=queue.job_class,
                                   serializer=queue.serializer)
    FinishedJobRegistry(queue.name, **options).cleanup()
    MarblesStartedJobRegistry(queue.name, **options).cleanup(
        exception_handlers=exception_handlers)
    FailedJobRegistry(queue.name, **options).cleanup()
    DeferredJobRegistry(queue.name, **options).cleanup()


# -- connection and enqueueing ---------------------------------------------------------------


def rq_connection(url: str) -> redis.Redis:
    if "+cluster" in url.split("://", 1)[0]:
        raise ConfigError("RQ cannot use a Redis Cluster; give --rq-url (MARBLES_RQ_URL) a "
                          "standalone Redis")
    try:
        # A socket timeout, so a hung Redis is a clear error, not a hang (the controller's
        # calls); RQ's worker raises it above its own blocking pop's timeout.
        return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=2,
                                    socket_timeout=socket_timeout_from_env())
    except ValueError as exc:
        raise ConfigError(f"invalid RQ Redis URL: {exc}") from None


def queue(conn: redis.Redis, prefix: str, name: str) -> Queue:
    return MarblesQueue(rq_queue_name(prefix, name), connection=conn, serializer=JSONSerializer,
                        job_class=MarblesJob)


def enqueue_delivery(conn: redis.Redis, prefix: str, queue_name: str, run_id: str,
                     attempt: int) -> bool:
    """Enqueue one delivery; False if RQ already holds a job with its id."""
    try:
        queue(conn, prefix, queue_name).enqueue_call(
            ENTRY, args=(run_id, attempt), job_id=delivery_id(prefix, run_id, attempt),
            timeout=-1, result_ttl=RESULT_TTL_S, failure_ttl=FAILURE_TTL_S, unique=True)
    except DuplicateJobError:
        return False
    return True


def enqueue_deliveries(conn: redis.Redis, prefix: str, queue_name: str,
                       runs: list[tuple[str, int]]) -> None:
    """Enqueue many fresh deliveries in one pipeline (no uniqueness check: they are new)."""
    q = queue(conn, prefix, queue_name)
    datas = [Queue.prepare_data(ENTRY, args=(rid, attempt),
                                job_id=delivery_id(prefix, rid, attempt), timeout=-1,
                                result_ttl=RESULT_TTL_S, failure_ttl=FAILURE_TTL_S)
             for rid, attempt in runs]
    with conn.pipeline() as pipe:
        q.enqueue_many(datas, pipeline=pipe)
        pipe.execute()


def deliveries_exist(conn: redis.Redis, prefix: str, ids: list[tuple[str, int]]) -> list[bool]:
    pipe = conn.pipeline(transaction=False)
    for rid, attempt in ids:
        pipe.exists(Job.key_for(delivery_id(prefix, rid, attempt)))
    return [bool(n) for n in pipe.execute()]


@dataclass
class InFlight:
    """Reads the deliveries RQ holds between a worker's pop and the run's start: the
    intermediate lists, the started registries and the failed registries' newest entries.
    What a pass reads is bounded by what is in flight, never by the length of a queue."""

    conn: redis.Redis
    prefix: str
    failed_seen: dict[str, float] = field(default_factory=dict)  # failed key -> last score

    def job_ids(self, lookback_s: float = 3600.0) -> tuple[set[str], set[str]]:
        """Job ids of this deployment's queues: (popped and maybe not started, failed since
        the last call). A failed job is reported once; the caller keeps what it must."""
        mine = Queue.redis_queue_namespace_prefix + rq_queue_name(self.prefix, "")
        queues = sorted(k for k in map(_s, self.conn.smembers(Queue.redis_queues_keys))
                        if k.startswith(mine))
        if not queues:
            return set(), set()
        now = time.time()
        pipe = self.conn.pipeline(transaction=False)
        for key in queues:
            name = key.removeprefix(Queue.redis_queue_namespace_prefix)
            failed = FailedJobRegistry.key_template.format(name)
            # A failed entry scores its expiry (fail time + failure_ttl): newer fails score higher.
            since = self.failed_seen.get(failed, now + FAILURE_TTL_S - lookback_s)
            pipe.lrange(f"{key}:intermediate", 0, -1)
            pipe.zrange(StartedJobRegistry.key_template.format(name), 0, -1)
            pipe.zrangebyscore(failed, f"({since}", "+inf", withscores=True)
        replies = pipe.execute(raise_on_error=False)
        found: set[str] = set()
        newly_failed: set[str] = set()
        for i, key in enumerate(queues):
            intermediate, started, failed = replies[3 * i: 3 * i + 3]
            name = key.removeprefix(Queue.redis_queue_namespace_prefix)
            if not isinstance(intermediate, Exception):
                found.update(_s(j) for j in intermediate)
            if not isinstance(started, Exception):
                found.update(_s(m).rsplit(":", 1)[0] for m in started)
            if not isinstance(failed, Exception) and failed:
                newly_failed.update(_s(j) for j, _ in failed)
                self.failed_seen[FailedJobRegistry.key_template.format(name)] = max(
                    score for _, score in failed)
        return found, newly_failed


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
