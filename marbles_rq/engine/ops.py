"""What the CLI's run commands do, as a Python API: enqueue (single and batch), cancel."""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from ..envvars import env_int
from ..errors import InvalidIdError
from ..flow import limit_specs, limits
from ..store.ids import check_id
from ..store.records import RunRecord
from ..transport.first_delivery import FirstDelivery
from ..transport.lanes import RQLike
from .authoring import REGISTRY, InputError, Registry, queue_problem
from .runs import Recorded, RunStore, delayed

MAX_PAYLOAD_ENV = "MARBLES_MAX_PAYLOAD"
DEFAULT_MAX_PAYLOAD = 1 << 20
ENQUEUE_CHUNK = 500
MAX_START_DELAY_MS = 10 * 366 * 86_400_000
# Deeper input is refused at enqueue: decoders recurse per level, and a document that one
# accepts (msgspec, ~990 levels) another refuses later, in the worker, after it is recorded.
MAX_DEPTH = 64
_JSON_STRUCTURE = re.compile(rb'[][{}"\\]')


# The ids the engine's triggers derive from what they start (an event's key, a schedule's
# slot, a monitor's launch): predictable, so nobody else may take one first and have the
# trigger find a foreign run there.
RESERVED_IDS = {
    "event": (re.compile(r"ev-[0-9a-f]{32}"), "ev-<32 hex digits>"),
    "schedule": (re.compile(r"sched:.*"), "sched:<schedule>:<ms>"),
    "monitor": (re.compile(r"mon\..*"), "mon.<monitor>.<n>"),
    "batch": (re.compile(r"evb-[0-9a-f]{24}-[0-9]+"), "evb-<24 hex digits>-<n>"),
}
TRIGGER_ORIGINS = tuple(RESERVED_IDS)


def reserved_for(run_id: str) -> str | None:
    """The trigger whose namespace `run_id` is in, or None."""
    return next((origin for origin, (pattern, _) in RESERVED_IDS.items()
                 if pattern.fullmatch(run_id)), None)


def check_origin(run_id: str, origin: str) -> None:
    """Refuse an id of a trigger's namespace asked for by anyone but that trigger."""
    owner = reserved_for(run_id)
    if owner is not None and origin not in (owner, "child"):
        raise InvalidIdError(f"run id {run_id!r} is reserved for {owner} runs (ids "
                             f"{RESERVED_IDS[owner][1]} are made by marbles-rq); choose "
                             f"another id")


def owned_by(existing: RunRecord, origin: str, wanted: RunRecord) -> bool:
    """Whether a run found under a trigger's id (`wanted`'s) is that trigger's own."""
    if existing.origin:
        return existing.origin == origin
    # Recorded before runs carried their origin: the trigger's if it is the same run.
    return existing.name == wanted.name and bytes(existing.input) == bytes(wanted.input)


class PayloadTooLargeError(InputError):
    code = "payload_too_large"


class InputTooDeepError(InputError):
    code = "input_too_deep"


def max_payload() -> int:
    return env_int(MAX_PAYLOAD_ENV, DEFAULT_MAX_PAYLOAD, unit="bytes")


def json_depth_exceeds(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """True when `raw` nests arrays and objects deeper than `limit`. A scan of brackets
    outside strings, without decoding: it must stay cheap on input of any depth."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # the common case, at C speed
    depth = 0
    in_string = False
    skip_to = -1  # the character after a backslash inside a string is escaped
    for match in _JSON_STRUCTURE.finditer(raw):
        pos = match.start()
        if pos < skip_to:
            continue
        char = raw[pos]
        if in_string:
            if char == 0x5C:  # backslash
                skip_to = pos + 2
            elif char == 0x22:  # quote
                in_string = False
        elif char == 0x22:
            in_string = True
        elif char in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif char in (0x5D, 0x7D):  # ] }
            depth -= 1
    return False


@dataclass(frozen=True)
class RunRequest:
    name: str
    input: bytes = b"null"
    run_id: str | None = None
    queue: str | None = None
    # Refuse input fields the workflow does not declare (the CLI and bulk enqueue), rather
    # than dropping them silently as msgspec does by default. Engine-made runs (events,
    # schedules, monitors) keep msgspec's default.
    strict: bool = False
    # Higher runs first within the queue, PRIORITY_MIN..PRIORITY_MAX (flow/limit_specs.py);
    # None: the workflow's default.
    priority: int | None = None
    # Who asks: "" an enqueuer; a trigger (event | schedule | monitor), the only one that may
    # use an id of its namespace (RESERVED_IDS); "child" for start_child, whose ids extend
    # its parent's and may look like one.
    origin: str = ""
    # Start no earlier than this (epoch ms); 0: at once.
    not_before_ms: int = 0


@dataclass(frozen=True)
class Enqueued:
    run_id: str
    created: bool  # False: a run with this id existed; it was returned, not run again
    status: str
    record: RunRecord
    dispatched: bool  # False: recorded, and the controller will enqueue it


def omitted_input(name: str, registry: Registry = REGISTRY) -> bytes:
    """The input of a run asked for without one (WorkflowDef.omitted_input)."""
    return registry.workflow(name).omitted_input("give --input")


def prepare(request: RunRequest, registry: Registry = REGISTRY,
            limit: int | None = None) -> RunRecord:
    """Validate a request completely before anything is written."""
    limit = max_payload() if limit is None else limit
    if len(request.input) > limit:
        raise PayloadTooLargeError(f"input is {len(request.input)} bytes; the limit is {limit} "
                                   f"(set {MAX_PAYLOAD_ENV} to change it)")
    if json_depth_exceeds(request.input):
        raise InputTooDeepError(f"input nests arrays or objects deeper than {MAX_DEPTH} levels")
    # An empty id is a mistake (an unset variable), not a request for a random one.
    run_id = uuid.uuid4().hex if request.run_id is None else check_id(request.run_id, "run id")
    check_origin(run_id, request.origin)
    if request.queue is not None and (problem := queue_problem(request.queue)) is not None:
        raise InvalidIdError(problem)
    if request.priority is not None and (
            problem := limit_specs.priority_problem(request.priority)) is not None:
        raise InputError(problem)
    definition = registry.workflow(request.name)
    value, recorded_input = definition.parse_input(request.input, strict=request.strict)
    concurrency, label = limits.limit_of(definition, recorded_input)
    if definition.rate_limit is not None and isinstance(definition.rate_key, str):
        from ..flow.rate_limits import limit_name

        limit_name(definition, value)  # an input without its rate key is refused here
    return RunRecord(version=1, id=run_id, name=definition.name,
                     queue=request.queue or definition.queue,
                     input=msgspec.Raw(recorded_input), requested_at_ms=int(time.time() * 1000),
                     timeout_s=definition.timeout_s, max_deliveries=definition.max_deliveries,
                     retention_s=definition.retention_s,
                     priority=definition.priority if request.priority is None
                     else request.priority,
                     concurrency=concurrency, concurrency_label=label,
                     origin=request.origin if request.origin in TRIGGER_ORIGINS else "",
                     not_before_ms=_start(request.not_before_ms),
                     wf_version=definition.version)


def _start(not_before_ms: int) -> int:
    if not_before_ms and not 0 < not_before_ms - int(time.time() * 1000) <= MAX_START_DELAY_MS:
        if not_before_ms <= int(time.time() * 1000):
            return 0  # a start in the past is a start now
        raise InputError("a run's start may be at most ten years away")
    return not_before_ms


def enqueue(runs: RunStore, rq: RQLike, request: RunRequest,
            registry: Registry = REGISTRY) -> Enqueued:
    """Record the run (journal first), then enqueue its first delivery: in one script call
    when the store and RQ share one standalone Redis, else in two round trips. The same run
    id again returns the existing run and enqueues nothing."""
    return enqueue_record(runs, rq, prepare(request, registry))


def enqueue_record(runs: RunStore, rq: RQLike, record: RunRecord) -> Enqueued:
    """`enqueue` of a request `prepare` has made into `record`."""
    if delayed(record):  # the controller enqueues its first delivery at its start
        return _tagged(runs, [_result(runs.record(record), dispatched=False)])[0]
    recorded, dispatched = FirstDelivery(rq, runs.keys, runs.client).record(
        lambda push: runs.record(record, push), limit_specs.delivery_queue(record), record.id)
    return _tagged(runs, [_result(recorded, dispatched=dispatched)])[0]


def _tagged(runs: RunStore, done: list[Enqueued]) -> list[Enqueued]:
    """Record the declared tags (`@mr.workflow(tags=...)`) of the new runs among `done`, so
    a queued run is found by tag before it starts. A second call after the run is recorded:
    if it is lost, the run records them when it first executes."""
    from .execution import RunNotFoundError
    from .tags import tag_run

    for d in done:
        definition = REGISTRY.workflows.get(d.record.name)
        if d.created and definition is not None and definition.tags:
            # A run finished and pruned already (a retention of 0) has nothing to find.
            with contextlib.suppress(RunNotFoundError):
                tag_run(runs, d.run_id, definition.tags)
    return done


def enqueue_many(runs: RunStore, rq: RQLike, requests: list[RunRequest],
                 registry: Registry = REGISTRY) -> list[Enqueued]:
    """Validate all, then per chunk of 500: record it and enqueue its new runs, in one round
    trip when the store and RQ share one standalone Redis, else recorded in one and enqueued
    in one per queue. Each chunk reaches RQ right after it is recorded, well inside the
    controller's grace, so the controller never enqueues a delivery a second time."""
    records = [prepare(r, registry) for r in requests]
    out: list[Enqueued] = []
    for start in range(0, len(records), ENQUEUE_CHUNK):
        out += enqueue_records(runs, rq, records[start:start + ENQUEUE_CHUNK])
    return out


def enqueue_records_later(runs: RunStore, rq: RQLike,
                          records: list[RunRecord]) -> Callable[[], list[Enqueued]]:
    """`enqueue_records` in two halves: on one shared standalone Redis the chunk's call is
    built now and the returned function sends it (a batch builds the next chunk while the
    server writes this one); otherwise the returned function does all of it."""
    first = FirstDelivery(rq, runs.keys, runs.client)
    if first.shared is None or any(delayed(r) for r in records):
        return lambda: enqueue_records(runs, rq, records)
    pushes = first.pushes([(limit_specs.delivery_queue(r), r.id) for r in records])
    send = runs.record_chunk_later(records, pushes)
    return lambda: _tagged(runs, [_result(recorded, dispatched=recorded.enqueued)
                                  for recorded in send()])


def enqueue_records(runs: RunStore, rq: RQLike, records: list[RunRecord]) -> list[Enqueued]:
    """Record one chunk of prepared runs and enqueue the new ones: one round trip when the
    store and RQ share one standalone Redis (record and enqueue in one script call), else
    recorded in one round trip and enqueued in one per queue. A run whose id exists is
    returned as it is and not enqueued again. Runs asked to start later are recorded only
    (the controller enqueues them at their start)."""
    if any(delayed(r) for r in records):
        # By position, not by id: an id given twice in one chunk has two answers (the
        # first recorded created it, the other found it).
        now = [i for i, r in enumerate(records) if not delayed(r)]
        later = [i for i, r in enumerate(records) if delayed(r)]
        done: dict[int, Enqueued] = dict(zip(
            now, enqueue_records(runs, rq, [records[i] for i in now]), strict=True))
        done.update(zip(later, _tagged(runs, [_result(rec, dispatched=False) for rec in
                                              runs.record_chunk([records[i] for i in later])]),
                        strict=True))
        return [done[i] for i in range(len(records))]
    delivered = FirstDelivery(rq, runs.keys, runs.client).record_chunk(
        lambda pushes: runs.record_chunk(records, pushes),
        [(limit_specs.delivery_queue(r), r.id) for r in records])
    return _tagged(runs, [_result(recorded, dispatched=dispatched)
                          for recorded, dispatched in delivered])


def _result(recorded: Recorded, *, dispatched: bool) -> Enqueued:
    return Enqueued(recorded.record.id, recorded.created, recorded.status, recorded.record,
                    dispatched)
