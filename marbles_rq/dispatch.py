"""RQ as transport: one RQ job per delivery, carrying only (run id, attempt).

The job id is the delivery id ``<run id>-a<attempt>``. RQ allows only [A-Za-z0-9_-] in job
ids, so ``_``, ``.`` and ``:`` of a run id are escaped (``__``, ``_d``, ``_c``); run ids made
of letters, digits and ``-`` appear as they are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue
from rq.exceptions import DuplicateJobError
from rq.job import Job
from rq.registry import FailedJobRegistry, StartedJobRegistry

from .errors import ConfigError, MarblesError
from .serializer import JSONSerializer

ENTRY = "marbles_rq.execute.execute_delivery"
RESULT_TTL_S = 300
FAILURE_TTL_S = 7 * 24 * 3600


class RefusedJobError(MarblesError):
    """An RQ job that is not a marbles-rq delivery reached a marbles-rq worker."""

    code = "refused_job"


class MarblesJob(Job):
    """Runs only marbles-rq's entry point, with (run id: str, attempt: int)."""

    def _execute(self) -> Any:
        args = self.args
        if self.func_name != ENTRY or self.kwargs or len(args) != 2 or not isinstance(
                args[0], str) or not isinstance(args[1], int):
            raise RefusedJobError(f"refusing job {self.id}: {self.func_name!r} is not a "
                                  f"marbles-rq delivery")
        return super()._execute()


def delivery_id(run_id: str, attempt: int) -> str:
    escaped = run_id.replace("_", "__").replace(".", "_d").replace(":", "_c")
    return f"{escaped}-a{attempt}"


def parse_delivery_id(prefix: str, job_id: str) -> tuple[str, int] | None:
    """The (run id, attempt) of a delivery id; None if `job_id` is not one."""
    escaped, sep, attempt = job_id.rpartition("-a")
    if not sep or not attempt.isdigit() or not escaped:
        return None
    out, i = [], 0
    while i < len(escaped):
        ch = escaped[i]
        if ch != "_":
            out.append(ch)
            i += 1
            continue
        nxt = escaped[i + 1: i + 2]
        if nxt not in ("_", "d", "c"):
            return None
        out.append({"_": "_", "d": ".", "c": ":"}[nxt])
        i += 2
    return "".join(out), int(attempt)


def rq_connection(url: str) -> redis.Redis:
    if "+cluster" in url.split("://", 1)[0]:
        raise ConfigError("RQ cannot use a Redis Cluster; give --rq-url (MARBLES_RQ_URL) a "
                          "standalone Redis")
    try:
        return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=2)
    except ValueError as exc:
        raise ConfigError(f"invalid RQ Redis URL: {exc}") from None


def queue(conn: redis.Redis, name: str) -> Queue:
    return Queue(name, connection=conn, serializer=JSONSerializer, job_class=MarblesJob)


def enqueue_delivery(conn: redis.Redis, queue_name: str, run_id: str, attempt: int) -> bool:
    """Enqueue one delivery; False if RQ already holds a job with its id."""
    try:
        queue(conn, queue_name).enqueue_call(
            ENTRY, args=(run_id, attempt), job_id=delivery_id(run_id, attempt), timeout=-1,
            result_ttl=RESULT_TTL_S, failure_ttl=FAILURE_TTL_S, unique=True)
    except DuplicateJobError:
        return False
    return True


def enqueue_deliveries(conn: redis.Redis, queue_name: str, runs: list[tuple[str, int]]) -> None:
    """Enqueue many fresh deliveries in one pipeline (no uniqueness check: they are new)."""
    q = queue(conn, queue_name)
    datas = [Queue.prepare_data(ENTRY, args=(rid, attempt), job_id=delivery_id(rid, attempt),
                                timeout=-1, result_ttl=RESULT_TTL_S, failure_ttl=FAILURE_TTL_S)
             for rid, attempt in runs]
    with conn.pipeline() as pipe:
        q.enqueue_many(datas, pipeline=pipe)
        pipe.execute()


def deliveries_exist(conn: redis.Redis, ids: list[tuple[str, int]]) -> list[bool]:
    pipe = conn.pipeline(transaction=False)
    for rid, attempt in ids:
        pipe.exists(Job.key_for(delivery_id(rid, attempt)))
    return [bool(n) for n in pipe.execute()]


@dataclass
class InFlight:
    """Reads the deliveries RQ holds between a worker's pop and the run's start: the
    intermediate lists, the started registries and the failed registries' newest entries.
    What a pass reads is bounded by what is in flight, never by the length of a queue."""

    conn: redis.Redis
    failed_seen: dict[str, float] = field(default_factory=dict)  # failed key -> last score

    def job_ids(self, lookback_s: float = 3600.0) -> set[str]:
        queues = sorted(_s(k) for k in self.conn.smembers(Queue.redis_queues_keys))
        if not queues:
            return set()
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
        for i, key in enumerate(queues):
            intermediate, started, failed = replies[3 * i: 3 * i + 3]
            name = key.removeprefix(Queue.redis_queue_namespace_prefix)
            if not isinstance(intermediate, Exception):
                found.update(_s(j) for j in intermediate)
            if not isinstance(started, Exception):
                found.update(_s(m).rsplit(":", 1)[0] for m in started)
            if not isinstance(failed, Exception) and failed:
                found.update(_s(j) for j, _ in failed)
                self.failed_seen[FailedJobRegistry.key_template.format(name)] = max(
                    score for _, score in failed)
        return found


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
