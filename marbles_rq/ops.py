"""What the CLI's run commands do, as a Python API: enqueue (single and batch), cancel."""

from __future__ import annotations

import os
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass

import msgspec
import redis

from . import dispatch
from .authoring import REGISTRY, InputError, Registry
from .ids import check_id
from .records import RunRecord
from .runs import Recorded, RunStore

MAX_PAYLOAD_ENV = "MARBLES_MAX_PAYLOAD"
DEFAULT_MAX_PAYLOAD = 1 << 20


class PayloadTooLargeError(InputError):
    code = "payload_too_large"


def max_payload() -> int:
    return int(os.environ.get(MAX_PAYLOAD_ENV) or DEFAULT_MAX_PAYLOAD)


@dataclass(frozen=True)
class RunRequest:
    name: str
    input: bytes = b"null"
    run_id: str | None = None
    queue: str | None = None


@dataclass(frozen=True)
class Enqueued:
    run_id: str
    created: bool  # False: a run with this id existed; it was returned, not run again
    status: str
    record: RunRecord
    dispatched: bool  # False: recorded, and the controller will enqueue it


def prepare(request: RunRequest, registry: Registry = REGISTRY,
            limit: int | None = None) -> RunRecord:
    """Validate a request completely before anything is written."""
    limit = max_payload() if limit is None else limit
    if len(request.input) > limit:
        raise PayloadTooLargeError(f"input is {len(request.input)} bytes; the limit is {limit} "
                                   f"(set {MAX_PAYLOAD_ENV} to change it)")
    definition = registry.workflow(request.name)
    _, recorded_input = definition.parse_input(request.input)
    run_id = check_id(request.run_id, "run id") if request.run_id else uuid.uuid4().hex
    return RunRecord(version=1, id=run_id, name=definition.name,
                     queue=request.queue or definition.queue,
                     input=msgspec.Raw(recorded_input), requested_at_ms=int(time.time() * 1000),
                     timeout_s=definition.timeout_s, max_deliveries=definition.max_deliveries)


def enqueue(runs: RunStore, rq: redis.Redis, request: RunRequest,
            registry: Registry = REGISTRY) -> Enqueued:
    """Record the run (journal first), then enqueue its first delivery. The same run id
    again returns the existing run and enqueues nothing."""
    record = prepare(request, registry)
    recorded = runs.record(record)
    if not recorded.created:
        return _result(recorded, dispatched=False)
    try:
        dispatch.enqueue_delivery(rq, runs.keys.prefix, record.queue, record.id, 1)
    except redis.RedisError:
        return _result(recorded, dispatched=False)  # the controller dispatches it
    return _result(recorded, dispatched=True)


def enqueue_many(runs: RunStore, rq: redis.Redis, requests: list[RunRequest],
                 registry: Registry = REGISTRY) -> list[Enqueued]:
    """Validate all, record each, then enqueue the new ones in one RQ pipeline per queue."""
    records = [prepare(r, registry) for r in requests]
    recorded = runs.record_many(records)
    fresh: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for rec in recorded:
        if rec.created:
            fresh[rec.record.queue].append((rec.record.id, 1))
    dispatched = True
    try:
        for queue_name, batch in fresh.items():
            dispatch.enqueue_deliveries(rq, runs.keys.prefix, queue_name, batch)
    except redis.RedisError:
        dispatched = False
    return [_result(r, dispatched=r.created and dispatched) for r in recorded]


def _result(recorded: Recorded, *, dispatched: bool) -> Enqueued:
    return Enqueued(recorded.record.id, recorded.created, recorded.status, recorded.record,
                    dispatched)
