"""Event batching: ``@mr.on_event(source, batch=mr.Batch(max_size=100, max_wait="5s"))``.

Matching events accumulate in their group's open batch (a group: one trigger and one value
of its key); one run starts with the list of their `Event`s, in the order they were
appended, when the batch is full or `max_wait` after its first event.

Why every event lands in exactly one batch across kill -9 of anything:

* The event is journaled first (claim_event), as every event is, with the batch group it
  goes to (a `BatchSlot`, so a controller appends it without the trigger's code). It stays
  ``pending`` until it is appended; the controller appends a pending event past its grace,
  as it starts the run of any other pending event. So an accepted event never ends in no
  batch.
* Appending is one script (lua/append_batch.lua) on the group's own hash tag: it refuses an
  event appended before (its member key names the batch), so the sender and the controller
  racing, or either repeating after a kill, append it once. The event is then marked
  ``batched`` with its batch's id (a second script in the event's tag: a cluster forbids one
  script spanning both; the append's idempotence makes the pair safe to repeat).
* The append that fills a batch seals it in the same script (no batch ever holds more than
  `max_size`); a batch whose wait ended is sealed by the controller (lua/seal_batch.lua,
  found through its bucket's due index, so the next leader finds it at election). A batch's
  id is fixed when it opens (``<group>-<seq>``) and is its run's id: recording the run is
  idempotent, and a sealed batch whose sealer died is started by the controller after a
  grace (lua/close_batch.lua ends it).
* A batch also seals before an event would take its items past the run input limit
  (MARBLES_MAX_PAYLOAD); that event opens the next batch.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import redis

from .. import metrics
from ..engine import catalog, ops
from ..engine.authoring import (
    REGISTRY,
    DefinitionError,
    InputError,
    Registry,
    UnknownWorkflowError,
)
from ..engine.runs import RunStore
from ..errors import InvalidIdError
from ..payloads.codec import decode_payload, encode_payload
from ..store.redis_errors import is_outage, one_line
from ..store.replies import as_text
from ..transport.lanes import RQLike

if TYPE_CHECKING:
    from ..controller.context import DutyContext
    from ..store.records import EventRecord

log = logging.getLogger("marbles_rq.triggers.batches")

GROUP_PATTERN = re.compile(r"evb-[0-9a-f]{24}")
BATCH_ID_PATTERN = re.compile(r"(evb-[0-9a-f]{24})-([0-9]+)")
FIELD_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
MAX_SIZE = 10_000          # events in one batch, at most
MAX_WAIT_MS = 86_400_000   # a day
MAX_KEY_CHARS = 256
SEALED_GRACE_MS = 5_000    # a sealed batch's run is its sealer's to record for this long
RETRY_MS = 60_000          # a batch whose workflow this controller lacks waits this long
KEEP_MS = 7 * 86_400_000   # member keys, closed batches and idle groups are kept this long
PER_BUCKET = 100
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)?")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, None: 1000}


def parse_wait(value: str | float | int) -> int:
    """'500ms', '5s', '2m', '1h' or seconds as a number -> milliseconds (DefinitionError)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DefinitionError(f"invalid max_wait {value!r}: use a duration such as '5s', "
                              f"'500ms', '2m' or seconds as a number")
    match = _DURATION.fullmatch(value.strip()) if isinstance(value, str) else None
    if isinstance(value, str) and match is None:
        raise DefinitionError(f"invalid max_wait {value!r}: use a duration such as '5s', "
                              f"'500ms', '2m' or seconds as a number")
    ms = (float(match.group(1)) * _UNIT_MS[match.group(2)] if match is not None
          else float(value) * 1000)
    if not 1 <= ms <= MAX_WAIT_MS:
        raise DefinitionError(f"invalid max_wait {value!r}: from 1 ms to 24 hours")
    return int(ms)


@dataclass(frozen=True)
class Batch:
    """How a trigger batches its events: a batch seals when it holds `max_size` events or
    `max_wait` after its first one ('5s', '500ms', '2m', or seconds), whichever is first.
    `key`: a top-level field of the event's payload, or a function of the `Event` returning a
    string: one batch per value (None: one batch per trigger)."""

    max_size: int = 100
    max_wait: str | float = "5s"
    key: str | Callable[[Any], str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_size, bool) or not isinstance(self.max_size, int) \
                or not 1 <= self.max_size <= MAX_SIZE:
            raise DefinitionError(f"invalid max_size {self.max_size!r}: a whole number from 1 "
                                  f"to {MAX_SIZE}")
        parse_wait(self.max_wait)
        key = self.key
        if key is not None and not callable(key) and (
                not isinstance(key, str) or not FIELD_PATTERN.fullmatch(key)):
            raise DefinitionError(f"invalid batch key {key!r}: the name of a field of the "
                                  f"event's payload, or a function of the event")

    @property
    def max_wait_ms(self) -> int:
        return parse_wait(self.max_wait)

    def describe(self) -> dict[str, Any]:
        key = self.key
        return {"max_size": self.max_size, "max_wait_ms": self.max_wait_ms,
                "key_field": key if isinstance(key, str) else None,
                "key_function": None if key is None or isinstance(key, str)
                else getattr(key, "__qualname__", repr(key))}


class BatchSlot(msgspec.Struct, kw_only=True, frozen=True):
    """Where a journaled event goes (stored on the pending event: the controller appends it
    with this alone)."""

    version: int = 1
    group: str
    key: str
    trigger: str      # "<source>" or "<source>/<type>"
    workflow: str
    max_size: int
    max_wait_ms: int


def group_of(trigger: str, workflow: str, key: str) -> str:
    digest = hashlib.sha256(f"{trigger}\0{workflow}\0{key}".encode()).hexdigest()
    return f"evb-{digest[:24]}"


def key_value(batch: Batch, record: EventRecord, item: bytes, error: type[Exception],
              decode_event: Callable[[bytes], Any]) -> str:
    """The batch key's value for an event (EventInputError-like `error` when it has none);
    `decode_event` makes the `Event` a key function is called with."""
    if batch.key is None:
        return ""
    if isinstance(batch.key, str):
        payload = msgspec.json.decode(bytes(record.payload))
        if not isinstance(payload, dict) or batch.key not in payload:
            raise error(f"event payload has no field {batch.key!r} (the trigger batches by "
                        f"it)")
        value = payload[batch.key]
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise error(f"event payload field {batch.key!r} is {type(value).__name__}; a batch "
                        f"key is a string or an integer")
        text = str(value)
    else:
        try:
            text = batch.key(decode_event(item))
        except Exception as exc:
            raise error(f"the batch key function failed on the event: "
                        f"{type(exc).__name__}: {exc}") from None
        if not isinstance(text, str):
            raise error(f"the batch key function returned {type(text).__name__}; it must "
                        f"return a string")
    if len(text) > MAX_KEY_CHARS:
        raise error(f"batch key value is {len(text)} characters; at most {MAX_KEY_CHARS}")
    return text


def slot_for(batch: Batch, trigger: str, workflow: str, record: EventRecord, item: bytes,
             error: type[Exception], decode_event: Callable[[bytes], Any]) -> BatchSlot:
    key = key_value(batch, record, item, error, decode_event)
    return BatchSlot(group=group_of(trigger, workflow, key), key=key, trigger=trigger,
                     workflow=workflow, max_size=batch.max_size, max_wait_ms=batch.max_wait_ms)


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


def batch_input(items: Iterable[bytes]) -> bytes:
    return b"[" + b",".join(items) + b"]"


def split_batch_id(batch_id: str) -> tuple[str, int] | None:
    match = BATCH_ID_PATTERN.fullmatch(batch_id)
    return (match.group(1), int(match.group(2))) if match else None


@dataclass(frozen=True)
class Appended:
    batch_id: str
    status: str     # added | sealed | exists
    started: bool   # this call recorded the batch's run


@dataclass(frozen=True)
class OpenBatch:
    group: str
    batch_id: str
    trigger: str
    workflow: str
    key: str
    size: int
    opened_ms: int
    seals_ms: int

    def to_json(self) -> dict[str, Any]:
        return {"batch": self.batch_id, "trigger": self.trigger, "workflow": self.workflow,
                "key": self.key, "size": self.size, "opened_at": _iso(self.opened_ms),
                "seals_at": _iso(self.seals_ms)}


_SEQ: dict[str, int] = {}  # group -> the open batch this process last saw
_SEQ_LOCK = threading.Lock()


class Batches:
    """Event batches in the store: append, seal, start, read. `rq` is needed only to start."""

    def __init__(self, runs: RunStore, rq: RQLike | None = None, *,
                 registry: Registry = REGISTRY) -> None:
        self.runs, self.rq, self.registry = runs, rq, registry
        self.store = runs.store
        self.keys = runs.keys

    def _fence(self, group: str) -> str:
        return self.keys.controller_fence(self.keys.bucket_of(group))

    # -- appending ----------------------------------------------------------------------------

    def append(self, slot: BatchSlot, event_key: str, item: bytes) -> Appended:
        """Put the event in its group's open batch (once, whoever asks again), and record
        the run of the batch it filled."""
        keys, group = self.keys, slot.group
        bucket = keys.bucket_of(group)
        seq = _SEQ.get(group, 0)  # 0: not known here (the script answers which it is)
        # Held sealed until the batch's run is recorded (the size cap counts sealed bytes).
        item = encode_payload(self.store, item, holder=f"run:{event_key}")
        for _ in range(100):  # each "moved" means a batch sealed meanwhile
            batch_id = f"{group}-{seq}"
            reply = self.store.scripts.append_batch(
                group_key=keys.batch_group(group), items_key=keys.batch_items(group, batch_id),
                member_key=keys.batch_member(group, event_key),
                batch_key=keys.batch(group, batch_id), due_key=keys.batch_due(bucket),
                sealed_key=keys.batch_sealed(bucket), group=group, seq=seq,
                event_key=event_key, item=item, max_size=slot.max_size,
                max_wait_ms=slot.max_wait_ms, max_bytes=ops.max_payload(),
                grace_ms=SEALED_GRACE_MS, keep_ms=KEEP_MS, workflow=slot.workflow,
                trigger=slot.trigger, key=slot.key)
            if reply.status == "moved":
                seq = int(reply.values[0])
                with _SEQ_LOCK:
                    _SEQ[group] = seq
                if len(reply.values) > 1:  # sealed because this event did not fit
                    metrics_sealed(slot.workflow, "bytes")
                    self.start(as_text(reply.values[1]))
                continue
            batch_id = as_text(reply.values[0])
            if reply.status == "added":
                metrics_batched(slot.workflow)
                return Appended(batch_id, "added", False)
            if reply.status == "sealed":
                metrics_batched(slot.workflow)
                metrics_sealed(slot.workflow, "size")
                with _SEQ_LOCK:
                    _SEQ[group] = seq + 1
                return Appended(batch_id, "sealed", self.start(batch_id) == "started")
            # exists: appended before (a resend, or the sender and the controller both); if
            # its batch sealed and nobody recorded its run yet, do it now.
            state = self.store.client.hget(keys.batch(group, batch_id), "state")
            started = as_text(state) == "sealed" and self.start(batch_id) == "started"
            return Appended(batch_id, "exists", started)
        raise RuntimeError(f"batch group {group}: its open batch kept moving; try again")

    # -- starting -------------------------------------------------------------------------

    def _registry_for(self, workflow: str) -> Registry:
        if workflow in self.registry.workflows:
            return self.registry
        return Registry(workflows={workflow: catalog.lookup(self.store.client, self.keys,
                                                            workflow)})

    def start(self, batch_id: str, ctl_epoch: int = 0) -> str:
        """Record the run of a sealed batch (its id is the batch's) and close the batch.
        Returns started | retry | failed | closed | missing | fenced."""
        parts = split_batch_id(batch_id)
        if parts is None:
            return "missing"
        group = parts[0]
        keys = self.keys
        batch_key, items_key = keys.batch(group, batch_id), keys.batch_items(group, batch_id)
        fields = self.store.client.hmget(batch_key, ["state", "workflow"])
        items = self.store.client.lrange(items_key, 0, -1)
        if fields[0] is None or as_text(fields[0]) != "sealed":
            return self._close(group, batch_id, ctl_epoch, "started")
        workflow = as_text(fields[1])
        if self.rq is None:
            raise ValueError("Batches needs an RQ connection to start runs")
        request = ops.RunRequest(workflow, batch_input(
            decode_payload(self.store, i if isinstance(i, bytes) else i.encode())
            for i in items), batch_id, origin="batch")
        try:
            enqueued = ops.enqueue(self.runs, self.rq, request, self._registry_for(workflow))
        except UnknownWorkflowError as exc:
            log.warning("batch %s: %s; retrying in %d s", batch_id, exc, RETRY_MS // 1000)
            return self._close(group, batch_id, ctl_epoch, "retry", str(exc))
        except (InputError, InvalidIdError) as exc:
            log.warning("batch %s: its run cannot be recorded (%s); failed", batch_id, exc)
            return self._close(group, batch_id, ctl_epoch, "failed", str(exc)[:500])
        if not enqueued.created and enqueued.record.origin != "batch":
            note = (f"run id {batch_id} is taken by a run this batch did not start (workflow "
                    f"{enqueued.record.name!r})")
            log.error("batch %s: %s", batch_id, note)
            return self._close(group, batch_id, ctl_epoch, "failed", note)
        return self._close(group, batch_id, ctl_epoch, "started")

    def _close(self, group: str, batch_id: str, ctl_epoch: int, state: str,
               note: str = "") -> str:
        keys = self.keys
        reply = self.store.scripts.close_batch(
            batch_key=keys.batch(group, batch_id), items_key=keys.batch_items(group, batch_id),
            sealed_key=keys.batch_sealed(keys.bucket_of(group)), fence_key=self._fence(group),
            batch_id=batch_id, ctl_epoch=ctl_epoch, state=state, note=note, keep_ms=KEEP_MS,
            retry_ms=RETRY_MS)
        return state if reply.status == "ok" else reply.status

    def seal(self, group: str, ctl_epoch: int) -> tuple[str, str]:
        """The controller seals `group`'s open batch if its wait has ended: (status, its id);
        status sealed | not_due | gone | fenced."""
        keys = self.keys
        seq = int(self.store.client.hget(keys.batch_group(group), "seq") or 0)
        batch_id = f"{group}-{seq}"
        bucket = keys.bucket_of(group)
        reply = self.store.scripts.seal_batch(
            group_key=keys.batch_group(group), batch_key=keys.batch(group, batch_id),
            due_key=keys.batch_due(bucket), sealed_key=keys.batch_sealed(bucket),
            fence_key=self._fence(group), group=group, seq=seq, ctl_epoch=ctl_epoch,
            grace_ms=SEALED_GRACE_MS)
        if reply.status == "sealed":
            workflow = as_text(self.store.client.hget(keys.batch(group, batch_id), "workflow")
                               or b"")
            metrics_sealed(workflow, "time")
        return reply.status, batch_id

    # -- reading --------------------------------------------------------------------------

    def open(self, buckets: Iterable[int] | None = None) -> list[OpenBatch]:
        """Every open batch (its size, when it opened, when it seals by time), oldest
        first."""
        keys = self.keys
        pipe = self.store.client.pipeline(transaction=False)
        for bucket in range(keys.buckets) if buckets is None else buckets:
            pipe.zrange(keys.batch_due(bucket), 0, -1)
        groups = [as_text(g) for found in pipe.execute() for g in found]
        pipe = self.store.client.pipeline(transaction=False)
        for group in groups:
            pipe.hmget(keys.batch_group(group), ["seq", "n", "opened_ms", "due_ms", "workflow",
                                                 "trigger", "key"])
        out = []
        for group, f in zip(groups, pipe.execute(), strict=True):
            if f[1] is None or int(f[1]) == 0:
                continue
            out.append(OpenBatch(group, f"{group}-{int(f[0] or 0)}", as_text(f[5] or b""),
                                 as_text(f[4] or b""), as_text(f[6] or b""), int(f[1]),
                                 int(f[2] or 0), int(f[3] or 0)))
        return sorted(out, key=lambda b: (b.opened_ms, b.batch_id))

    def get(self, batch_id: str) -> dict[str, Any] | None:
        """A batch run's batch: {"batch", "trigger", "key", "events", "sealed_by",
        "opened_at", "sealed_at", "state"}; None when `batch_id` is not a batch's."""
        parts = split_batch_id(batch_id)
        if parts is None:
            return None
        f = self.store.client.hmget(self.keys.batch(parts[0], batch_id), [
            "trigger", "key", "n", "sealed_by", "opened_ms", "sealed_ms", "state"])
        if f[2] is None:
            return None
        return {"batch": batch_id, "trigger": as_text(f[0] or b""),
                "key": as_text(f[1] or b""), "events": int(f[2]),
                "sealed_by": as_text(f[3] or b""), "opened_at": _iso(int(f[4] or 0)),
                "sealed_at": _iso(int(f[5] or 0)), "state": as_text(f[6] or b"")}


def metrics_batched(workflow: str) -> None:
    m = metrics._M
    if m is not None:
        metrics._child(m.events_batched, metrics.bounded("workflow", workflow)).inc()


def metrics_sealed(workflow: str, by: str) -> None:
    m = metrics._M
    if m is not None:
        metrics._child(m.batches_sealed, metrics.bounded("workflow", workflow), by).inc()


# -- the controller's duty ------------------------------------------------------------------

class BatchesDuty:
    """Seals the batches whose wait ended and records the runs of sealed batches whose
    sealer died (every one at election; each pass those past their grace). Each write is
    fenced by the leader's epoch."""

    kind = "batches"

    def __init__(self, registry: Registry = REGISTRY) -> None:
        self.registry = registry

    def _batches(self, ctl: DutyContext) -> Batches:
        return Batches(ctl.runs, ctl.rq, registry=self.registry)

    def _start(self, ctl: DutyContext, batches: Batches, ids: list[str]) -> tuple[int, bool]:
        done = 0
        for batch_id in ids:
            try:
                status = batches.start(batch_id, ctl.epoch)
            except redis.RedisError as exc:
                if is_outage(exc):
                    raise
                log.warning("batch %s: %s; skipped", batch_id, one_line(exc))
                continue
            if status == "fenced":
                ctl.step_down(f"a newer controller acts on batch {batch_id}")
                return done, False
            if status == "started":
                log.info("batch %s: run recorded", batch_id)
                done += 1
        return done, True

    def _seal(self, ctl: DutyContext, batches: Batches, groups: list[str]) -> tuple[int, bool]:
        done = 0
        for group in groups:
            try:
                status, batch_id = batches.seal(group, ctl.epoch)
            except redis.RedisError as exc:
                if is_outage(exc):
                    raise
                log.warning("batch group %s: %s; skipped", group, one_line(exc))
                continue
            if status == "fenced":
                ctl.step_down(f"a newer controller acts on batch group {group}")
                return done, False
            if status == "sealed":
                count, carry_on = self._start(ctl, batches, [batch_id])
                done += count
                if not carry_on:
                    return done, False
        return done, True

    def recover(self, ctl: DutyContext) -> int:
        batches, done = self._batches(ctl), 0
        pipe = ctl.store.client.pipeline(transaction=False)
        for bucket in ctl.buckets:
            pipe.zrange(ctl.keys.batch_sealed(bucket), 0, -1)
        sealed = [as_text(b) for found in pipe.execute() for b in found]
        count, carry_on = self._start(ctl, batches, sealed)
        done += count
        if carry_on:
            due = [g for _, g in ctl.due(ctl.keys.batch_due, ctl.server_ms(), 10_000)]
            done += self._seal(ctl, batches, due)[0]
        return done

    def tick(self, ctl: DutyContext) -> None:
        batches = self._batches(ctl)
        now = ctl.server_ms()
        due = [g for _, g in ctl.due(ctl.keys.batch_due, now, PER_BUCKET)]
        if due and not self._seal(ctl, batches, due)[1]:
            return
        late = [b for _, b, _ in ctl.due_scored(ctl.keys.batch_sealed, now, PER_BUCKET)]
        if late:
            self._start(ctl, batches, late)



class OpenBatchesGauge:
    """marbles_rq_open_batches{workflow}: open event batches, read from Redis when scraped
    (a controller serves it; aggregate with max). A failed read is counted in
    marbles_rq_redis_errors_total and the gauge is left out."""

    def __init__(self, runs: RunStore) -> None:
        self.runs = runs
        self.client = metrics.scrape_client(runs.store.client)

    def describe(self) -> list[Any]:
        return []  # collected only when scraped

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import GaugeMetricFamily

        keys = self.runs.keys
        try:
            pipe = self.client.pipeline(transaction=False)
            for bucket in range(keys.buckets):
                pipe.zrange(keys.batch_due(bucket), 0, -1)
            groups = [as_text(g) for found in pipe.execute() for g in found]
            pipe = self.client.pipeline(transaction=False)
            for group in groups:
                pipe.hget(keys.batch_group(group), "workflow")
            workflows = pipe.execute()
        except redis.RedisError as exc:
            metrics.redis_error(exc)
            return
        gauge = GaugeMetricFamily("marbles_rq_open_batches", "Open event batches (collecting "
                                  "events for a trigger declared with batch=), per workflow.",
                                  labels=["workflow"])
        counts: dict[str, int] = {}
        for workflow in workflows:
            if workflow is not None:
                label = metrics.bounded("workflow", as_text(workflow))
                counts[label] = counts.get(label, 0) + 1
        for label, count in sorted(counts.items()):
            gauge.add_metric([label], count)
        yield gauge
