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
something (callbacks, webhooks, dependencies, retries, repeats, rate limits).

A delivery is enqueued in one round trip: RQ builds the job (``Queue.create_job``,
``Job.to_dict``: the hash RQ's own enqueue writes and ``Job.fetch`` reads back) and a script
writes it, pushes its id on the queue list and registers the queue (``enqueue_delivery``).
When the store and RQ share one standalone Redis (`same_server`), recording a run enqueues
its first delivery in the same script call (``claim_run``; transport/first_delivery.py
chooses).
"""

from __future__ import annotations

import functools
import re
import time
import weakref
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue
from rq.exceptions import DequeueTimeout
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.registry import (
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    StartedJobRegistry,
)
from rq.utils import get_call_string, utcformat
from rq.utils import now as rq_now

from ..errors import ConfigError, MarblesError
from ..store.connection import NO_CLIENT_INFO, socket_timeout_from_env
from ..store.ids import ID_PATTERN
from ..store.replies import as_text
from ..store.scripts import JobPush, Scripts
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


class DeliveryInterrupted(Exception):
    """marbles-rq's entry point raised: the delivery stopped without an outcome (a Redis
    error, the store unavailable, a bug). Not a failure of the RQ job: the store knows the
    run's state, and the controller redelivers it (its lease expires, or its delivery is
    found in the intermediate list while the run is still queued)."""

    def __init__(self, job_id: str, cause: BaseException) -> None:
        super().__init__(f"delivery {job_id} stopped: {type(cause).__name__}: {cause}")
        self.cause = cause


# -- names ------------------------------------------------------------------------------------


_RUN_TABLE = str.maketrans(_RUN_ESCAPES)
_PREFIX_TABLE = str.maketrans(_PREFIX_ESCAPES)


def _escape(text: str, table: dict[int, str]) -> str:
    return text.translate(table)


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


def rq_worker_keys() -> tuple[str, str]:
    """RQ's set of worker keys, and the prefix of one worker's key (RQ_KEY_PREFIX applied)."""
    from rq.worker import Worker

    return Worker.redis_workers_keys, Worker.redis_worker_namespace_prefix


def rq_queue_name(prefix: str, queue: str) -> str:
    """The RQ queue that carries marbles queue `queue` of deployment `prefix`."""
    return f"{prefix}.{queue}"


_QUEUE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # engine.authoring.QUEUE_PATTERN


def queue_of(prefix: str, rq_name: str) -> str | None:
    """The marbles queue of deployment `prefix` that RQ queue `rq_name` carries, or None
    when it is another's. A prefix may hold a dot and a queue may not: `sec.x.default` is
    prefix `sec.x`'s, not a queue `x.default` of prefix `sec`."""
    queue = rq_name.removeprefix(rq_queue_name(prefix, ""))
    if queue == rq_name or not _QUEUE_NAME.fullmatch(queue):
        return None
    return queue


def delivery_id(prefix: str, run_id: str, attempt: int) -> str:
    """The RQ job id of delivery `attempt` of run `run_id` in deployment `prefix`."""
    return f"{_escape(prefix, _PREFIX_TABLE)}-{_escape(run_id, _RUN_TABLE)}-a{attempt}"


def parse_delivery_id(prefix: str, job_id: str) -> tuple[str, int] | None:
    """(run id, attempt) of a delivery id of deployment `prefix`; None for any other job
    id (another prefix's delivery, or not a delivery at all)."""
    head = _escape(prefix, _PREFIX_TABLE) + "-"
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
    "rate_limit_key", "rate_limit_concurrency",
)


# The deployment whose deliveries this process executes, set by the worker with the engine
# it configures: a job is checked against it before it runs. (The transport's job classes
# never reach into the engine for it: the engine enqueues through them.)
_SERVED_PREFIX: str | None = None


def serve_prefix(prefix: str) -> None:
    """Execute deliveries of deployment `prefix` only, in this process."""
    global _SERVED_PREFIX
    _SERVED_PREFIX = prefix


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
        self.rate_limit_key = self.rate_limit_concurrency = None
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
        prefix = _SERVED_PREFIX
        if prefix is None:
            raise MarblesError("no marbles-rq engine configured in this process: run "
                               "deliveries with 'marbles-rq worker'")
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
        try:
            return super()._execute()
        except Exception as exc:
            raise DeliveryInterrupted(self.id, exc) from exc


class MarblesIntermediateQueue(IntermediateQueue):
    """RQ's intermediate list of a queue, whose cleanup leaves this deployment's deliveries
    alone. A marbles-rq worker keeps a delivery there from its pop until it completed (see
    transport/lean.py), and the controller redelivers or forgets one a worker left behind
    (`InFlight`); RQ's cleanup would fail any that sits there a minute without a started
    registry entry, which a lean worker never writes. Other job ids get RQ's cleanup."""

    def cleanup(self, worker: Any, queue: Any) -> None:
        prefix = queue.name.rpartition(".")[0]
        for job_id in self.get_job_ids():
            if parse_delivery_id(prefix, job_id) is not None:
                continue
            job = queue.fetch_job(job_id)
            if job_id in queue.started_job_registry:
                continue
            if not job:
                self.remove(job_id)
            elif not self.set_first_seen(job_id) and self.should_be_cleaned_up(job_id):
                worker.handle_job_failure(job, queue, exc_string="Job was stuck in "
                                                                 "intermediate queue.")
                self.remove(job_id)


class MarblesQueue(Queue):
    """A queue whose jobs never enqueue dependents: a delivery has none, and a dependents set
    planted next to a delivery's job must not make the worker move or enqueue anything.
    Its intermediate list is a MarblesIntermediateQueue."""

    def enqueue_dependents(self, job: Any, exclude_job_id: Any = None,
                           refresh_job_status: bool = True, **_: Any) -> dict[str, list[str]]:
        return {}

    def move_dependents_to_ready(self, job: Any, pipeline: Any = None,
                                 exclude_job_id: Any = None,
                                 refresh_job_status: bool = True) -> dict[str, list[str]]:
        return {}

    def enqueue_ready_jobs_by_queue(self, job_ids_by_queue_name: Any) -> None:
        return None

    @property
    def intermediate_queue(self) -> MarblesIntermediateQueue:
        return MarblesIntermediateQueue(self.key, connection=self.connection)

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


@functools.cache
def lane_classes(rq_prefix: str | None) -> tuple[type[Any], type[Any]]:
    """(queue class, job class) of a lane keyspace: RQ's classes with the key prefixes RQ
    computes from RQ_KEY_PREFIX, computed from `rq_prefix` instead (None: RQ's own)."""
    if rq_prefix is None:
        return MarblesQueue, MarblesJob
    name = "".join(c for c in rq_prefix if c.isalnum())
    job = type(f"MarblesJob_{name}", (MarblesJob,),
               {"redis_job_namespace_prefix": f"{rq_prefix}:job:"})
    queue = type(f"MarblesQueue_{name}", (MarblesQueue,), {
        "redis_queue_namespace_prefix": f"{rq_prefix}:queue:",
        "redis_queues_keys": f"{rq_prefix}:queues",
        "lane_prefix": rq_prefix,
        "registry_cleaning_key": property(lambda self: f"{rq_prefix}:clean_registries:"
                                                       f"{self.name}"),
    })
    return queue, job


def clean_registries(queue: Queue, exception_handlers: list[Any] | None = None) -> None:
    """rq.registry.clean_registries, with MarblesStartedJobRegistry for the started one, and
    without the ready and rate-limit registries, whose cleanup enqueues jobs (a delivery
    never depends on a job nor has a rate limit)."""
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
        # RESP2 as the store's clients: no HELLO round trip on each new connection (a forked
        # horse opens its own).
        return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=2,
                                    socket_timeout=socket_timeout_from_env(), protocol=2,
                                    **NO_CLIENT_INFO)
    except ValueError as exc:
        raise ConfigError(f"invalid RQ Redis URL: {exc}") from None


def queue(conn: redis.Redis, prefix: str, name: str, rq_prefix: str | None = None) -> Queue:
    """The RQ queue of marbles queue `name`, in the lane keyspace `rq_prefix` (None: RQ's)."""
    queue_class, job_class = lane_classes(rq_prefix)
    return queue_class(rq_queue_name(prefix, name), connection=conn,  # type: ignore[no-any-return]
                       serializer=JSONSerializer, job_class=job_class)


def same_server(store_client: Any, conn: Any) -> bool:
    """True when the store's client and RQ's connection reach the same standalone Redis
    server and database (so one script can record a run and enqueue its delivery). Decided
    from their connection settings only: two spellings of one server read as two, which
    only costs the second round trip."""
    if type(store_client) is not redis.Redis or type(conn) is not redis.Redis:
        return False
    if store_client is conn:
        return True
    a = store_client.connection_pool.connection_kwargs
    b = conn.connection_pool.connection_kwargs
    return (store_client.connection_pool.connection_class
            is conn.connection_pool.connection_class
            and all(a.get(k) == b.get(k) for k in ("host", "port", "path", "db", "username")))


def _rq_built_push(conn: redis.Redis, prefix: str, queue_name: str, run_id: str,
                   attempt: int, rq_prefix: str | None = None) -> JobPush:
    """The delivery's job as RQ builds it: Queue.create_job (status queued, enqueued now),
    its hash as Job.to_dict gives it (what RQ's own enqueue writes, less its empty fields;
    Job.fetch reads back the same job), and RQ's key names. (`data` is zlib-compressed here;
    the template writes it uncompressed, which Job.restore reads alike.)"""
    q = queue(conn, prefix, queue_name, rq_prefix)
    job = q.create_job(ENTRY, args=(run_id, attempt), job_id=delivery_id(prefix, run_id, attempt),
                       timeout=-1, result_ttl=RESULT_TTL_S, failure_ttl=FAILURE_TTL_S,
                       status=JobStatus.QUEUED)
    job.enqueued_at = rq_now()
    fields: list[str | bytes] = []
    for name, value in job.to_dict().items():
        # As RQ's unique enqueue builds its HSET (rq.scripts), less the fields to_dict writes
        # empty: Job.restore reads an empty field and an absent one alike.
        if value is not None and value != "":
            fields += [name, value if isinstance(value, bytes | str) else str(value)]
    return JobPush(job_key=job.key, queue_key=q.key, queues_key=q.redis_queues_keys,
                   job_id=job.id, fields=tuple(fields))


# Fields of a delivery's job hash that differ between deliveries of one queue; the others are
# the same for all of them.
_PER_DELIVERY = ("created_at", "enqueued_at", "data", "description")


@dataclass(frozen=True)
class _Template:
    """The job hash RQ builds for a delivery of one queue, with the per-delivery fields left
    to fill in: building a Job per delivery costs more than the rest of an enqueue. `data`
    (the serialized call) is written uncompressed: Job.restore reads it as it reads RQ's
    zlib-compressed data (its fallback for uncompressed job data), and compressing 90 bytes
    would cost a tenth of an enqueue."""

    fields: tuple[str | bytes, ...]  # field, value, ...; a per-delivery field's value is ""
    slots: dict[str, int]  # per-delivery field -> index of its value in `fields`
    queue_key: str
    queues_key: str
    job_class: type[MarblesJob]

    def push(self, prefix: str, run_id: str, attempt: int) -> JobPush:
        args = (run_id, attempt)
        stamp = utcformat(rq_now())
        # What Job.create / Job.data / Job.to_dict compute, with RQ's own helpers.
        values: dict[str, str | bytes] = {
            "created_at": stamp, "enqueued_at": stamp,
            "data": JSONSerializer.dumps((ENTRY, None, args, {})),
            "description": get_call_string(ENTRY, args, {}, max_length=75) or ""}
        fields = list(self.fields)
        for name, index in self.slots.items():
            fields[index] = values[name]
        job_id = delivery_id(prefix, run_id, attempt)
        return JobPush(job_key=self.job_class.key_for(job_id), queue_key=self.queue_key,
                       queues_key=self.queues_key, job_id=job_id, fields=tuple(fields))


_TEMPLATES: dict[tuple[str, str, str | None], _Template | None] = {}


def _template(conn: redis.Redis, prefix: str, queue_name: str,
              rq_prefix: str | None = None) -> _Template | None:
    """The template of a queue's deliveries, checked once against a job RQ builds: if the
    two differ anywhere but in the timestamps and data's compression (another rq version),
    None, and every delivery is built by RQ."""
    key = (prefix, queue_name, rq_prefix)
    if key not in _TEMPLATES:
        built = _rq_built_push(conn, prefix, queue_name, "template-check", 1, rq_prefix)
        names = built.fields[0::2]
        slots = {n: 2 * names.index(n) + 1 for n in _PER_DELIVERY if n in names}
        fields = list(built.fields)
        for index in slots.values():
            fields[index] = ""
        found: _Template | None = _Template(tuple(fields), slots, built.queue_key,
                                            built.queues_key, lane_classes(rq_prefix)[1])
        assert found is not None
        fast = list(found.push(prefix, "template-check", 1).fields)
        expected = list(built.fields)
        for name in ("created_at", "enqueued_at"):
            if name in slots:
                fast[slots[name]] = expected[slots[name]]
        if "data" in slots:
            expected[slots["data"]] = _decompressed(expected[slots["data"]])
        if len(slots) != len(_PER_DELIVERY) or fast != expected:
            found = None
        _TEMPLATES[key] = found
    return _TEMPLATES[key]


def _decompressed(data: str | bytes) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    try:
        return zlib.decompress(raw)
    except zlib.error:
        return raw


def delivery_push(conn: redis.Redis, prefix: str, queue_name: str, run_id: str,
                  attempt: int, rq_prefix: str | None = None) -> JobPush:
    """Delivery `attempt` of run `run_id` as RQ enqueues it: the hash RQ's enqueue writes for
    the job Queue.create_job builds (Job.to_dict, less its empty fields, `data`
    uncompressed; Job.fetch reads back the same job), and RQ's key names; a script writes
    it. The queue's template (checked against a job RQ built) fills in the per-delivery
    fields; without one, RQ builds each job."""
    template = _template(conn, prefix, queue_name, rq_prefix)
    if template is None:
        return _rq_built_push(conn, prefix, queue_name, run_id, attempt, rq_prefix)
    return template.push(prefix, run_id, attempt)


_SCRIPTS: weakref.WeakKeyDictionary[redis.Redis, Scripts] = weakref.WeakKeyDictionary()


def _scripts(conn: redis.Redis) -> Scripts:
    found = _SCRIPTS.get(conn)
    if found is None:
        found = _SCRIPTS[conn] = Scripts(conn)
    return found


def enqueue_delivery(conn: redis.Redis, prefix: str, queue_name: str, run_id: str,
                     attempt: int, *, rq_prefix: str | None = None) -> bool:
    """Enqueue one delivery in one round trip on `conn`, in the lane keyspace `rq_prefix`
    (None: RQ's own); False if RQ already holds a job with its id."""
    return _scripts(conn).enqueue_delivery(delivery_push(conn, prefix, queue_name, run_id,
                                                         attempt, rq_prefix))


def enqueue_deliveries(conn: redis.Redis, prefix: str, queue_name: str,
                       runs: list[tuple[str, int]], *, rq_prefix: str | None = None) -> None:
    """Enqueue many deliveries in one round trip (a job id RQ holds already is left alone)."""
    if runs:
        _scripts(conn).enqueue_deliveries([
            delivery_push(conn, prefix, queue_name, rid, attempt, rq_prefix)
            for rid, attempt in runs])


def deliveries_exist(conn: redis.Redis, prefix: str, ids: list[tuple[str, int]], *,
                     rq_prefix: str | None = None) -> list[bool]:
    job_class = lane_classes(rq_prefix)[1]
    pipe = conn.pipeline(transaction=False)
    for rid, attempt in ids:
        pipe.exists(job_class.key_for(delivery_id(prefix, rid, attempt)))
    return [bool(n) for n in pipe.execute()]


def queue_depths(conn: redis.Redis, prefix: str,
                 rq_prefix: str | None = None) -> dict[str, tuple[int, int]]:
    """{marbles queue: (deliveries queued, deliveries popped and not completed)} of every RQ
    queue of deployment `prefix` that RQ knows (its set of queues) in the lane keyspace
    `rq_prefix` (None: RQ's own), in two round trips."""
    queue_class = lane_classes(rq_prefix)[0]
    space = queue_class.redis_queue_namespace_prefix
    named = {k: queue_of(prefix, k.removeprefix(space))
             for k in map(as_text, conn.smembers(queue_class.redis_queues_keys))
             if k.startswith(space)}
    keys = sorted(k for k, queue in named.items() if queue is not None)
    if not keys:
        return {}
    pipe = conn.pipeline(transaction=False)
    for key in keys:
        pipe.llen(key)
        pipe.llen(IntermediateQueue.get_intermediate_queue_key(key))
    lengths = pipe.execute()
    return {str(named[key]): (int(lengths[2 * i]), int(lengths[2 * i + 1]))
            for i, key in enumerate(keys)}


@dataclass
class InFlight:
    """Reads the deliveries RQ holds between a worker's pop and the run's start: the
    intermediate lists, the started registries and the failed registries' newest entries.
    What a pass reads is bounded by what is in flight, never by the length of a queue.

    A marbles-rq worker keeps a delivery in its queue's intermediate list from the pop until
    the delivery completed, and takes it out with its next pop (transport/lean.py); it writes
    no started registry entry. So the intermediate lists hold every delivery popped and not
    completed, including one whose worker died before the run started; the started
    registries are read for entries of workers of earlier versions. `forget` takes out what
    a worker left behind once its run has moved on."""

    conn: redis.Redis
    prefix: str
    rq_prefix: str | None = None  # the lane keyspace (None: RQ's own)
    failed_seen: dict[str, float] = field(default_factory=dict)  # failed key -> last score
    # popped job id -> the intermediate list it was read from (None: a started registry)
    popped_from: dict[str, str | None] = field(default_factory=dict)

    def job_ids(self, lookback_s: float = 3600.0) -> tuple[set[str], set[str]]:
        """Job ids of this deployment's queues: (popped and maybe not started, failed since
        the last call). A failed job is reported once; the caller keeps what it must."""
        queue_class = lane_classes(self.rq_prefix)[0]
        namespace = queue_class.redis_queue_namespace_prefix
        mine = namespace + rq_queue_name(self.prefix, "")
        queues = sorted(k for k in map(as_text, self.conn.smembers(queue_class.redis_queues_keys))
                        if k.startswith(mine))
        self.popped_from = {}
        if not queues:
            return set(), set()
        now = time.time()
        pipe = self.conn.pipeline(transaction=False)
        for key in queues:
            name = key.removeprefix(namespace)
            failed = self._registry("failed", name)
            # A failed entry scores its expiry (fail time + failure_ttl): newer fails score higher.
            since = self.failed_seen.get(failed, now + FAILURE_TTL_S - lookback_s)
            pipe.lrange(IntermediateQueue.get_intermediate_queue_key(key), 0, -1)
            pipe.zrange(self._registry("wip", name), 0, -1)
            pipe.zrangebyscore(failed, f"({since}", "+inf", withscores=True)
        replies = pipe.execute(raise_on_error=False)
        newly_failed: set[str] = set()
        for i, key in enumerate(queues):
            intermediate, started, failed = replies[3 * i: 3 * i + 3]
            name = key.removeprefix(namespace)
            if not isinstance(started, Exception):
                for member in started:
                    self.popped_from.setdefault(as_text(member).rsplit(":", 1)[0], None)
            if not isinstance(intermediate, Exception):
                inter = IntermediateQueue.get_intermediate_queue_key(key)
                self.popped_from.update((as_text(j), inter) for j in intermediate)
            if not isinstance(failed, Exception) and failed:
                newly_failed.update(as_text(j) for j, _ in failed)
                self.failed_seen[self._registry("failed", name)] = max(
                    score for _, score in failed)
        return set(self.popped_from), newly_failed

    def _registry(self, kind: str, name: str) -> str:
        """The key of RQ's `kind` registry (wip: started, failed) of queue `name`."""
        if self.rq_prefix is None:
            template = {"wip": StartedJobRegistry, "failed": FailedJobRegistry}[kind]
            return template.key_template.format(name)
        return f"{self.rq_prefix}:{kind}:{name}"

    def forget(self, job_ids: Iterable[str]) -> int:
        """Take deliveries whose runs have moved on (started again under a newer delivery,
        settled, waiting, gone) out of the intermediate lists the last `job_ids` read them
        from, and delete their job hashes: what the lean worker that popped them does when
        it completes them, left undone because it died or was interrupted. Returns how many
        entries it removed."""
        targets = [(j, inter) for j in job_ids if (inter := self.popped_from.get(j))]
        if not targets:
            return 0
        job_class = lane_classes(self.rq_prefix)[1]
        pipe = self.conn.pipeline(transaction=False)
        for job_id, inter in targets:
            pipe.lrem(inter, 0, job_id)
            pipe.delete(job_class.key_for(job_id))
        replies = pipe.execute(raise_on_error=False)
        return sum(r for r in replies[0::2] if isinstance(r, int))
