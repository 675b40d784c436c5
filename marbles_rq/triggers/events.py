"""Inbound events: journaled first under a stable key, then turned into one run each.

    @mr.on_event("github", type="push")
    @mr.workflow
    def on_push(ctx: mr.RunContext, event: mr.Event) -> None: ...

`send_event` validates everything, then (1) claims the event's hash (insert-if-absent on
``ev-<sha256(source NUL event id)[:32]>``) as ``pending`` with the run it will start, (2)
records that run under the same id (``ops.enqueue``: the same id again creates nothing), (3)
marks the event ``started``. A sender that dies between (1) and (3) leaves a pending event;
the controller's ``events`` duty records its run (on election: every pending event; on each
pass: those pending for more than `PENDING_GRACE_MS`). Because the run id is derived from
the event, the sender and the controller racing, or a controller killed midway, still make
one run.

An event that no trigger matches is journaled as ``unmatched`` (no run; a later trigger does
not pick it up: sending it again says it was received); either way it is offered to the runs
waiting for it (engine/event_waits.py). A trigger names one workflow; an event of source S
and type T goes to the trigger declared for (S, T), else to the one for S with no type.

Which triggers: the sender's own (the ``@mr.on_event`` of the source it imports) for every
source they name; for a source they do not name (or a sender that imports none), the ones
the deployment's workers declared (triggers/event_catalog.py), so a service that does not
import the workflow code sends events all the same. The run is then recorded with the
defaults its workers declared (engine/catalog.py), as a client's start by name is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import redis

from .. import tracing
from ..engine import catalog, ops
from ..engine.authoring import (
    REGISTRY,
    DefinitionError,
    InputError,
    Registry,
    UnknownWorkflowError,
    WorkflowDef,
)
from ..engine.event_waits import offer_event
from ..engine.runs import RunStore
from ..errors import CorruptRecordError, InvalidIdError, UnsupportedRecordVersionError
from ..payloads.fields import open_record, run_holder, seal_record
from ..store import RedisStore, new_request_id
from ..store.keys import Keyspace
from ..store.records import EventRecord, decode, encode
from ..store.redis_errors import is_outage, one_line
from ..store.replies import as_text
from ..transport.lanes import RQLike, as_lanes
from . import event_catalog
from .batches import Appended, Batch, Batches, BatchSlot, batch_input, slot_for

if TYPE_CHECKING:
    from ..controller.context import DutyContext

log = logging.getLogger("marbles_rq.triggers.events")

SOURCE_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
TYPE_PATTERN = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
EVENT_ID_PATTERN = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII, no spaces
PENDING_GRACE_MS = 5_000   # a pending event is the sender's for this long, then the controller's
RETRY_MS = 60_000          # a pending event whose workflow this controller lacks waits this long
SCAN_EVERY_S = 1.0         # how often a leader looks for pending events past their grace
PER_BUCKET = 100           # pending events read per bucket per scan
RECOVER_BATCH = 500
RETENTION_S = 7 * 86400.0  # an event is kept (and a resend recognised) this long
PRUNE_EVERY_S = 5.0
PRUNE_BUDGET = 200         # events pruned per prune pass


class Event(msgspec.Struct, kw_only=True, frozen=True):
    """The input a triggered workflow receives (declare ``event: mr.Event``, or a Struct of
    your own with the same field names and a typed `payload`)."""

    key: str               # the stable event key, also the run id
    source: str
    type: str = ""
    id: str                # the provider's event id, as sent
    payload: Any = None    # the JSON payload, decoded
    received_at_ms: int = 0


@dataclass(frozen=True)
class Trigger:
    source: str
    type: str | None
    workflow: str
    batch: Batch | None = None  # its events start one run per batch (triggers/batches.py)

    @property
    def label(self) -> str:
        return self.source + (f"/{self.type}" if self.type else "")


@dataclass
class Triggers:
    by_key: dict[tuple[str, str | None], Trigger]

    def add(self, trigger: Trigger) -> None:
        existing = self.by_key.get((trigger.source, trigger.type))
        if existing is not None and existing.workflow != trigger.workflow:
            what = trigger.source + (f"/{trigger.type}" if trigger.type else "")
            raise DefinitionError(f"two triggers for events {what}: workflows "
                                  f"{existing.workflow!r} and {trigger.workflow!r}")
        self.by_key[(trigger.source, trigger.type)] = trigger

    def match(self, source: str, type: str) -> Trigger | None:
        return self.by_key.get((source, type or None)) or self.by_key.get((source, None))

    def knows(self, source: str) -> bool:
        """Whether a trigger names `source` (then these triggers alone decide its events)."""
        return any(s == source for s, _ in self.by_key)


TRIGGERS = Triggers({})


def declare_triggers(client: Any, keys: Keyspace, triggers: Triggers = TRIGGERS) -> None:
    """Declare `triggers` in the deployment (a worker on start, `dev` before it says ready),
    for senders that do not import them."""
    event_catalog.declare(client, keys, ((t.source, t.type, t.workflow,
                                          t.batch.describe() if t.batch else None)
                                         for t in triggers.by_key.values()))


def on_event(source: str, *, type: str | None = None,
             batch: Batch | None = None) -> Callable[[WorkflowDef], WorkflowDef]:
    """Start the decorated workflow for each inbound event of `source` (and `type`, if
    given). Put it above ``@mr.workflow``; the workflow's input is an `Event`. With
    `batch` (`mr.Batch`), one run per batch of events instead: its input is the list of
    them (declare ``events: list[mr.Event]``)."""
    _check_source(source, DefinitionError)
    if type is not None:
        _check_type(type, DefinitionError)
    if batch is not None and not isinstance(batch, Batch):
        raise DefinitionError(f"batch= takes mr.Batch(max_size=..., max_wait=..., key=...), "
                              f"not {batch!r}")

    def register(definition: WorkflowDef) -> WorkflowDef:
        if not isinstance(definition, WorkflowDef):
            raise DefinitionError("@on_event goes above @workflow (it triggers a workflow)")
        if definition.input_param is None:
            raise DefinitionError(f"workflow {definition.name!r} is triggered by events; it "
                                  f"must take (ctx, event)")
        if batch is not None:
            _check_batch_input(definition)
        TRIGGERS.add(Trigger(source, type, definition.name, batch))
        return definition

    return register


def _check_batch_input(definition: WorkflowDef) -> None:
    import typing

    try:
        wanted = definition.input_type
    except Exception:  # a hint not resolvable yet: the first event's check says it
        return
    if wanted is Any or typing.get_origin(wanted) in (list, tuple) or wanted in (list, tuple):
        return
    raise DefinitionError(f"workflow {definition.name!r} is triggered by batches of events; "
                          f"its input must be a list (declare events: list[mr.Event])")


# -- validation and identities ---------------------------------------------------------------

class EventInputError(InputError):
    code = "invalid_event"


def _check_source(source: str, error: type[Exception] = EventInputError) -> str:
    if not isinstance(source, str) or not SOURCE_PATTERN.fullmatch(source):
        raise error(f"invalid event source {source!r}: use 1 to 64 of A-Z a-z 0-9 _ . -")
    return source


def _check_type(type: str, error: type[Exception] = EventInputError) -> str:
    if not isinstance(type, str) or not TYPE_PATTERN.fullmatch(type):
        raise error(f"invalid event type {type!r}: use 1 to 128 of A-Z a-z 0-9 _ . : / -")
    return type


def _check_event_id(event_id: str) -> str:
    if not isinstance(event_id, str) or not EVENT_ID_PATTERN.fullmatch(event_id):
        raise EventInputError(f"invalid event id {event_id!r}: use 1 to 256 printable ASCII "
                              f"characters, no spaces")
    return event_id


def event_key(source: str, event_id: str) -> str:
    """The stable key of an event (and the id of its run): the same on every resend."""
    digest = hashlib.sha256(f"{source}\0{event_id}".encode()).hexdigest()
    return f"ev-{digest[:32]}"


def check_payload(raw: bytes, limit: int | None = None) -> bytes:
    """JSON, within MARBLES_MAX_PAYLOAD bytes and 64 levels of nesting, or EventInputError."""
    limit = ops.max_payload() if limit is None else limit
    if len(raw) > limit:
        raise ops.PayloadTooLargeError(f"event payload is {len(raw)} bytes; the limit is "
                                       f"{limit} (set {ops.MAX_PAYLOAD_ENV} to change it)")
    if ops.json_depth_exceeds(raw):
        raise ops.InputTooDeepError(f"event payload nests arrays or objects deeper than "
                                    f"{ops.MAX_DEPTH} levels")
    try:
        msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise EventInputError(f"event payload is not valid JSON: {exc}") from None
    return raw


def run_input(record: EventRecord) -> bytes:
    """The JSON input of the event's run: an `Event`, built from the journaled record only,
    so the sender and the controller record the same input."""
    return (b'{"key":' + msgspec.json.encode(record.id) + b',"source":'
            + msgspec.json.encode(record.source) + b',"type":' + msgspec.json.encode(record.type)
            + b',"id":' + msgspec.json.encode(record.event_id) + b',"payload":'
            + bytes(record.payload) + b',"received_at_ms":'
            + str(record.received_at_ms).encode() + b"}")


def prepare_event(source: str, event_id: str, *, type: str = "", payload: bytes = b"null",
                  registry: Registry = REGISTRY, triggers: Triggers = TRIGGERS
                  ) -> tuple[EventRecord, Trigger | None]:
    """Validate an event (source, id, type, payload, and the input of the run its trigger
    starts) and build its record; raises before anything is written."""
    _check_source(source)
    _check_event_id(event_id)
    if type:
        _check_type(type)
    check_payload(payload)
    key = event_key(source, event_id)
    record = EventRecord(version=1, id=key, source=source, payload=msgspec.Raw(payload),
                         received_at_ms=int(time.time() * 1000), event_id=event_id, type=type)
    trigger = triggers.match(source, type)
    if trigger is not None:  # the run's input must fit its workflow, or nothing is written
        check_run_input(trigger, record, registry)
    return record, trigger


def check_run_input(trigger: Trigger, record: EventRecord, registry: Registry) -> None:
    """Raise unless the event's run (or a batch of it alone) fits the trigger's workflow."""
    if trigger.batch is None:
        ops.prepare(ops.RunRequest(trigger.workflow, run_input(record), record.id,
                                   origin="event"), registry)
        return
    item = run_input(record)
    slot = slot_for(trigger.batch, trigger.label, trigger.workflow, record, item,
                    EventInputError, _decode_event)
    ops.prepare(ops.RunRequest(trigger.workflow, batch_input([item]), f"{slot.group}-1",
                               origin="batch"), registry)


# -- the event store --------------------------------------------------------------------------

@dataclass(frozen=True)
class Sent:
    key: str
    created: bool          # False: received before; nothing was written
    state: str             # pending | started | unmatched | failed
    workflow: str          # '' when no trigger matched
    run_id: str            # '' when no trigger matched
    run_created: bool = False  # this call recorded the run
    delivered: tuple[str, ...] = ()  # the waiting runs this call delivered it to


@dataclass(frozen=True)
class EventView:
    key: str
    source: str
    type: str
    id: str
    state: str
    workflow: str
    run_id: str
    received_ms: int
    note: str
    run_status: str | None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "source": self.source, "type": self.type, "id": self.id,
                "state": self.state, "workflow": self.workflow or None,
                "run": self.run_id or None, "run_status": self.run_status,
                "received_at": _iso(self.received_ms), "note": self.note or None}


class Events:
    """Inbound events in the store: journal, start, list. `rq` is needed only to start.
    `declared`: match an event whose source `triggers` do not name against the triggers the
    deployment's workers declared (and record a run of a workflow `registry` lacks with the
    defaults they declared)."""

    def __init__(self, runs: RunStore, rq: RQLike | None = None, *,
                 registry: Registry = REGISTRY, triggers: Triggers = TRIGGERS,
                 declared: bool = True) -> None:
        self.runs, self.rq = runs, rq
        self.store: RedisStore = runs.store
        self.keys = runs.keys
        self.registry, self.triggers, self.declared = registry, triggers, declared
        self._looked_up: dict[str, Registry] = {}  # one catalog read per workflow per use

    # -- sending ----------------------------------------------------------------------------

    def prepare(self, source: str, event_id: str, *, type: str = "",
                payload: bytes = b"null") -> tuple[EventRecord, Trigger | None]:
        """Validate an event completely before anything is written (reads the declared
        triggers when this process's do not name its source)."""
        record, trigger = prepare_event(source, event_id, type=type, payload=payload,
                                        registry=self.registry, triggers=self.triggers)
        if trigger is None and self.declared and not self.triggers.knows(source):
            found = event_catalog.find(self.store.client, self.keys, source, type)
            if found is not None:
                trigger = Trigger(source, found[0], found[1].workflow,
                                  declared_batch(found[1].batch, source, type))
                check_run_input(trigger, record, self._registry_for(trigger.workflow))
        return record, trigger

    def slot(self, record: EventRecord, trigger: Trigger | None) -> BatchSlot | None:
        """The batch a batched trigger's event goes to (None: it starts a run of its own)."""
        if trigger is None or trigger.batch is None:
            return None
        return slot_for(trigger.batch, trigger.label, trigger.workflow, record,
                        run_input(record), EventInputError,
                        _decode_event)

    def _registry_for(self, workflow: str) -> Registry:
        """The definitions to record `workflow`'s run with: this process's when it has the
        workflow, else the defaults its workers declared (UnknownWorkflowError: none did)."""
        if workflow in self.registry.workflows or not self.declared:
            return self.registry
        if workflow not in self._looked_up:
            self._looked_up[workflow] = Registry(workflows={
                workflow: catalog.lookup(self.store.client, self.keys, workflow)})
        return self._looked_up[workflow]

    @staticmethod
    def validate(source: str, event_id: str, *, type: str = "", payload: bytes = b"null",
                 registry: Registry = REGISTRY, triggers: Triggers = TRIGGERS) -> None:
        """Raise what `send` would raise on bad input, without a store."""
        prepare_event(source, event_id, type=type, payload=payload, registry=registry,
                      triggers=triggers)

    def journal(self, record: EventRecord, trigger: Trigger | None,
                slot: BatchSlot | None = None) -> Sent:
        """Step 1 alone: claim the event as pending (or unmatched). The same key again
        writes nothing and returns what was received first. `slot`: the batch it goes to
        (then the event names no run until it is in a batch)."""
        key = record.id
        bucket = self.keys.bucket_of(key)
        reply = self.store.scripts.claim_event(
            event_key=key, event_hash=self.keys.event(key),
            listing_key=self.keys.event_listing(bucket),
            pending_key=self.keys.event_pending(bucket),
            offer_key=self.keys.event_offer(bucket),
            doc=encode(seal_record(self.store, record, run_holder(record.id))),
            request_id=new_request_id(), workflow=trigger.workflow if trigger else "",
            run_id=key if trigger and slot is None else "", grace_ms=PENDING_GRACE_MS,
            batch=b"" if slot is None else msgspec.json.encode(slot))
        if reply.status == "ok":
            return Sent(key, True, "pending" if trigger else "unmatched",
                        trigger.workflow if trigger else "", key if trigger else "")
        state, workflow, run_id = (as_text(v) for v in reply.values[1:4])
        return Sent(key, False, state, workflow, run_id)

    def _open(self, record: EventRecord) -> EventRecord:
        return open_record(self.store, record)

    def send(self, source: str, event_id: str, *, type: str = "",
             payload: bytes = b"null") -> Sent:
        """Journal the event, record its run, mark it started. The same event again (same
        source and id) creates nothing and returns `created=False`."""
        with tracing.span(f"event {source}", "CONSUMER", **{
                "marbles.event_source": source, "marbles.event_type": type}):
            return self._send(source, event_id, type=type, payload=payload)

    def _send(self, source: str, event_id: str, *, type: str, payload: bytes) -> Sent:
        record, trigger = self.prepare(source, event_id, type=type, payload=payload)
        slot = self.slot(record, trigger)
        sent = self.journal(record, trigger, slot)
        # A failure here leaves a pending event's run to the controller, as any other.
        delivered = tuple(sorted(run for run, outcome in self.offer(record).items()
                                 if outcome != "consumed"))
        if not sent.created or trigger is None:
            return dataclasses.replace(sent, delivered=delivered)
        if slot is not None:
            appended, _ = self._batch(slot, record, 0)
            return Sent(sent.key, True, "batched", trigger.workflow, appended.batch_id,
                        appended.started, delivered)
        enqueued = self._enqueue(trigger.workflow, record)
        if (foreign := self._foreign(enqueued, trigger.workflow, record)) is not None:
            self._mark(sent.key, 0, "failed", foreign)
            return Sent(sent.key, True, "failed", trigger.workflow, sent.key,
                        delivered=delivered)
        self._mark(sent.key, 0, "started")
        return Sent(sent.key, True, "started", trigger.workflow, sent.key, enqueued.created,
                    delivered)

    def offer(self, record: EventRecord, received_ms: int | None = None) -> dict[str, str]:
        """Deliver the journaled event to every run waiting for it (engine/event_waits.py),
        then drop it from the controller's to-offer index. After the journal: a resend of
        the event offers it again, and a run given it once is not given it twice."""
        enqueue = as_lanes(self.rq, self.keys).enqueue if self.rq is not None else None
        outcomes = offer_event(self.runs, record, enqueue, received_ms=received_ms)
        self.store.client.zrem(self.keys.event_offer(self.keys.bucket_of(record.id)),
                               record.id)
        return outcomes

    def offer_due(self, now_ms: int, per_bucket: int, buckets: Iterable[int]) -> int:
        """Offer the events whose sender did not (it died between the journal and the
        offer) once their grace has passed; returns how many."""
        pipe = self.store.client.pipeline(transaction=False)
        for bucket in buckets:
            pipe.zrangebyscore(self.keys.event_offer(bucket), "-inf", now_ms, start=0,
                               num=per_bucket)
        return self.offer_late([as_text(k) for found in pipe.execute() for k in found])

    def offer_late(self, keys: list[str]) -> int:
        """Offer these journaled events (their offer came due: the sender died between the
        journal and the offer); returns how many."""
        for key in keys:
            fields = self.store.client.hmget(self.keys.event(key), ["doc", "received_ms"])
            if fields[0] is None:  # pruned
                self.store.client.zrem(self.keys.event_offer(self.keys.bucket_of(key)), key)
                continue
            doc = fields[0]
            try:
                record = self._open(decode(
                    EventRecord, doc.encode() if isinstance(doc, str) else doc,
                    self.keys.event(key)))
            except (CorruptRecordError, UnsupportedRecordVersionError) as exc:
                log.warning("event %s: not offered to waiting runs: %s", key, exc)
                self.store.client.zrem(self.keys.event_offer(self.keys.bucket_of(key)), key)
                continue
            outcomes = self.offer(record, int(fields[1] or 0) or None)
            log.info("event %s: offered to waiting runs after its sender (%s)", key,
                     ", ".join(f"{r} {o}" for r, o in sorted(outcomes.items())) or "none")
        return len(keys)

    def _enqueue(self, workflow: str, record: EventRecord) -> ops.Enqueued:
        if self.rq is None:
            raise ValueError("Events needs an RQ connection to start runs")
        return ops.enqueue(self.runs, self.rq,
                           ops.RunRequest(workflow, run_input(record), record.id, origin="event"),
                           self._registry_for(workflow))

    def _foreign(self, enqueued: ops.Enqueued, workflow: str,
                 record: EventRecord) -> str | None:
        """Why the run found under the event's id is not the event's (None: it is, or it
        was recorded just now). Such a run is never reported as the event's: the event
        fails, saying so."""
        wanted = ops.prepare(ops.RunRequest(workflow, run_input(record), record.id,
                                            origin="event"), self._registry_for(workflow))
        if enqueued.created or ops.owned_by(enqueued.record, "event", wanted):
            return None
        found = enqueued.record
        note = (f"run id {record.id} is taken by a run this event did not start (workflow "
                f"{found.name!r}, origin {found.origin or 'an enqueuer'}); the event's "
                f"workflow {workflow!r} did not run")
        log.error("event %s: %s", record.id, note)
        return note

    def _mark(self, key: str, ctl_epoch: int, state: str, note: str = "",
              retry_ms: int = 0, run: str = "") -> str:
        bucket = self.keys.bucket_of(key)
        reply = self.store.scripts.mark_event(
            event_key=key, event_hash=self.keys.event(key),
            pending_key=self.keys.event_pending(bucket),
            fence_key=self.keys.controller_fence(bucket), ctl_epoch=ctl_epoch, state=state,
            note=note, retry_ms=retry_ms, run=run)
        return reply.status

    def _batch(self, slot: BatchSlot, record: EventRecord,
               ctl_epoch: int) -> tuple[Appended, str]:
        """Append the journaled event to its batch (once, whoever repeats it), then mark it
        batched with the batch's id; (what the append did, the mark's status)."""
        appended = Batches(self.runs, self.rq, registry=self.registry).append(
            slot, record.id, run_input(record))
        return appended, self._mark(record.id, ctl_epoch, "batched", run=appended.batch_id)

    # -- recovery (the controller) ----------------------------------------------------------

    def start_pending(self, key: str, ctl_epoch: int) -> str:
        """Record the run of a pending event and mark it started (or append it to its batch:
        batched). Returns started | batched | retry | failed | not_pending | missing |
        fenced."""
        fields = self.store.client.hmget(self.keys.event(key), ["doc", "state", "workflow",
                                                                "batch"])
        if fields[0] is None:
            return self._mark(key, ctl_epoch, "failed", "missing")  # clears the pending entry
        if as_text(fields[1]) != "pending":
            return self._mark(key, ctl_epoch, "started")  # not_pending: drops a stale entry
        doc = fields[0]
        record = self._open(decode(EventRecord, doc.encode() if isinstance(doc, str) else doc,
                                   self.keys.event(key)))
        workflow = as_text(fields[2])
        if fields[3]:  # its trigger batches: it goes to the batch journaled with it
            try:
                slot = msgspec.json.decode(fields[3], type=BatchSlot)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise CorruptRecordError(f"{self.keys.event(key)} field 'batch'",
                                         str(exc)) from None
            status = self._batch(slot, record, ctl_epoch)[1]
            return "batched" if status in ("ok", "not_pending") else status
        try:
            enqueued = self._enqueue(workflow, record)
        except UnknownWorkflowError as exc:
            status = self._mark(key, ctl_epoch, "retry", str(exc), RETRY_MS)
            log.warning("event %s: %s; retrying in %d s", key, exc, RETRY_MS // 1000)
            return "retry" if status == "ok" else status
        except (InputError, InvalidIdError) as exc:
            status = self._mark(key, ctl_epoch, "failed", str(exc))
            log.warning("event %s: its run cannot be recorded (%s); failed", key, exc)
            return "failed" if status == "ok" else status
        if (foreign := self._foreign(enqueued, workflow, record)) is not None:
            status = self._mark(key, ctl_epoch, "failed", foreign)
            return "failed" if status == "ok" else status
        status = self._mark(key, ctl_epoch, "started")
        return "started" if status == "ok" else status

    def pending(self, *, due_ms: int | None, per_bucket: int,
                buckets: Iterable[int] | None = None) -> list[str]:
        """Pending event keys (all of them when `due_ms` is None, else those due by then),
        in `buckets` (default: all)."""
        pipe = self.store.client.pipeline(transaction=False)
        for bucket in range(self.keys.buckets) if buckets is None else buckets:
            pipe.zrangebyscore(self.keys.event_pending(bucket), "-inf",
                               "+inf" if due_ms is None else due_ms, start=0, num=per_bucket)
        out: list[str] = []
        for found in pipe.execute(raise_on_error=False):
            if isinstance(found, Exception):
                if is_outage(found):
                    raise found
                log.warning("skipping an unreadable pending-events index: %s", one_line(found))
                continue
            out += [as_text(k) for k in found]
        return out

    # -- reading ----------------------------------------------------------------------------

    def get(self, key: str) -> EventView | None:
        views = self._views([key])
        return views[0] if views else None

    def recent(self, limit: int = 50) -> list[EventView]:
        """The newest `limit` events, newest first, with the status of their runs."""
        pipe = self.store.client.pipeline(transaction=False)
        for bucket in range(self.keys.buckets):
            pipe.zrevrange(self.keys.event_listing(bucket), 0, limit - 1, withscores=True)
        rows = sorted(((score, as_text(k)) for part in pipe.execute() for k, score in part),
                      reverse=True)[:limit]
        return self._views([k for _, k in rows])

    def _views(self, keys: list[str]) -> list[EventView]:
        pipe = self.store.client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(self.keys.event(key), ["doc", "state", "workflow", "run", "received_ms",
                                              "note"])
            pipe.hget(self.keys.run(key), "status")
        replies = pipe.execute(raise_on_error=False)
        views = []
        for i, key in enumerate(keys):
            fields, run_status = replies[2 * i], replies[2 * i + 1]
            if isinstance(fields, Exception) or fields[0] is None:
                continue
            try:
                record = self._open(decode(EventRecord, fields[0], self.keys.event(key)))
            except Exception as exc:  # one unreadable event costs only itself
                log.warning("skipping event %s: %s", key, exc)
                continue
            views.append(EventView(
                key, record.source, record.type, record.event_id, as_text(fields[1]),
                as_text(fields[2] or b""), as_text(fields[3] or b""), int(fields[4] or 0),
                as_text(fields[5] or b""),
                # A failed event's id names no run of its own (a foreign one, at most).
                None if isinstance(run_status, Exception) or run_status is None
                or as_text(fields[1]) == "failed" else as_text(run_status)))
        return views


def send_event(runs: RunStore, rq: RQLike, source: str, event_id: str, *, type: str = "",
               payload: bytes = b"null") -> Sent:
    """`marbles-rq events send` in Python: `Events(runs, rq).send(...)` with the triggers
    declared by the loaded modules, else by the deployment's workers."""
    return Events(runs, rq).send(source, event_id, type=type, payload=payload)

# -- the controller's duty ------------------------------------------------------------------

class EventsDuty:
    """Turns pending events into runs: every one on election, then each pass (at most every
    SCAN_EVERY_S) those pending past their grace. Each write is fenced by the leader's epoch."""

    kind = "events"

    def __init__(self, registry: Registry = REGISTRY, triggers: Triggers = TRIGGERS, *,
                 retention_s: float = RETENTION_S) -> None:
        self.registry, self.triggers = registry, triggers
        self.retention_ms = int(retention_s * 1000)
        self._next_scan = 0.0
        self._next_prune = 0.0

    def _events(self, ctl: DutyContext) -> Events:
        return Events(ctl.runs, ctl.rq, registry=self.registry, triggers=self.triggers)

    def _start(self, ctl: DutyContext, events: Events, keys: list[str]) -> tuple[int, bool]:
        done = 0
        for key in keys:
            try:
                status = events.start_pending(key, ctl.epoch)
            except redis.RedisError as exc:
                if is_outage(exc):
                    raise
                log.warning("event %s: %s; skipped", key, one_line(exc))
                continue
            except (CorruptRecordError, UnsupportedRecordVersionError) as exc:
                log.warning("event %s: %s; failed", key, exc)
                status = events._mark(key, ctl.epoch, "failed", str(exc)[:500])
            if status == "fenced":
                ctl.step_down(f"a newer controller acts on event {key}")
                return done, False
            if status == "started":
                log.info("event %s: run %s recorded", key, key)
                done += 1
            elif status == "batched":
                log.info("event %s: appended to its batch", key)
                done += 1
        return done, True

    def recover(self, ctl: DutyContext) -> int:
        events, done = self._events(ctl), 0
        seen: set[str] = set()
        while True:
            keys = [k for k in events.pending(due_ms=None, per_bucket=RECOVER_BATCH,
                                              buckets=ctl.buckets) if k not in seen]
            if not keys:
                return done
            seen.update(keys)
            count, carry_on = self._start(ctl, events, keys)
            done += count
            if not carry_on:
                return done

    def tick(self, ctl: DutyContext) -> None:
        now = time.monotonic()
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_EVERY_S
            self.prune(ctl)
        if now < self._next_scan:
            return
        self._next_scan = now + SCAN_EVERY_S
        events = self._events(ctl)
        # Through the controller's reads of what is due: an idle lane reads no bucket.
        events.offer_late([k for _, k in ctl.due(ctl.keys.event_offer, ctl.server_ms(),
                                                 PER_BUCKET)])
        keys = [k for _, k in ctl.due(ctl.keys.event_pending, ctl.server_ms(), PER_BUCKET)]
        if keys:
            self._start(ctl, events, keys)

    def prune(self, ctl: DutyContext, budget: int = PRUNE_BUDGET) -> int:
        """Remove events received more than the retention ago (pending ones stay)."""
        cutoff = ctl.server_ms() - self.retention_ms
        due = ctl.due(ctl.keys.event_listing, cutoff, 2 * -(-budget // len(ctl.buckets)),
                      budget)
        done = 0
        for _, key in due:
            bucket = ctl.keys.bucket_of(key)
            reply = ctl.store.scripts.prune_event(
                event_key=key, event_hash=ctl.keys.event(key),
                listing_key=ctl.keys.event_listing(bucket),
                fence_key=ctl.keys.controller_fence(bucket), ctl_epoch=ctl.epoch,
                cutoff_ms=cutoff)
            if reply.status == "fenced":
                ctl.step_down(f"a newer controller acts on event {key}")
                break
            done += reply.status == "ok"
        if done:
            log.info("pruned %s events past their retention", done)
        return done


def _decode_event(item: bytes) -> Event:
    return msgspec.json.decode(item, type=Event)


def declared_batch(described: dict[str, Any] | None, source: str, type: str) -> Batch | None:
    """The Batch of a trigger the deployment's workers declared (EventInputError when it
    batches by a function this process does not have)."""
    if described is None:
        return None
    if described.get("key_function"):
        raise EventInputError(f"the trigger of {source}" + (f"/{type}" if type else "")
                              + f" batches by the function {described['key_function']}; send "
                              f"its events from a process that imports its source")
    return Batch(max_size=int(described["max_size"]),
                 max_wait=int(described["max_wait_ms"]) / 1000,
                 key=described.get("key_field"))


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"
