"""RQ as transport: one RQ job per delivery, carrying only (run id, attempt).

The job id is the delivery id ``<run id>-a<attempt>``. RQ allows only [A-Za-z0-9_-] in job
ids, so ``_``, ``.`` and ``:`` of a run id are escaped (``__``, ``_d``, ``_c``); run ids made
of letters, digits and ``-`` appear as they are.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue
from rq.exceptions import DuplicateJobError
from rq.job import Job

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


def deliveries_waiting(conn: redis.Redis, ids: list[tuple[str, str, int]]) -> list[bool]:
    """For (queue, run id, attempt): is the delivery's job in its queue or intermediate
    list, i.e. still on its way to a worker? (LPOS: linear in the queue length.)"""
    pipe = conn.pipeline(transaction=False)
    for queue_name, rid, attempt in ids:
        key, job_id = Queue(queue_name, connection=conn).key, delivery_id(rid, attempt)
        pipe.lpos(key, job_id)
        pipe.lpos(f"{key}:intermediate", job_id)
    found = pipe.execute()
    return [found[2 * i] is not None or found[2 * i + 1] is not None for i in range(len(ids))]


def deliveries_exist(conn: redis.Redis, ids: list[tuple[str, int]]) -> list[bool]:
    pipe = conn.pipeline(transaction=False)
    for rid, attempt in ids:
        pipe.exists(Job.key_for(delivery_id(rid, attempt)))
    return [bool(n) for n in pipe.execute()]
