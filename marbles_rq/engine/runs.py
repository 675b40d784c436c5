"""Runs in the store: recording, executing (fenced by epoch), settling, reading.

Every transition is one Lua script (see lua/*_run.lua, *_step.lua, *_attempt.lua); this
module builds their arguments and turns their replies into values. Reads are plain
pipelined commands.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import redis

from .. import metrics, tracing
from ..errors import CorruptRecordError, MarblesError, UnsupportedRecordVersionError
from ..flow.limit_specs import delivery_queue, limit_field
from ..payloads.codec import encode_payload
from ..payloads.crypto import PayloadKeyMissing
from ..payloads.fields import open_bytes_value, open_event, open_record, run_holder, seal_record
from ..store import RedisStore, new_request_id
from ..store.ids import check_id
from ..store.keys import RunKeys
from ..store.records import (
    EffectReceipt,
    ErrorInfo,
    RunRecord,
    StepRecord,
    decode,
    encode,
    ledger_order,
)
from ..store.replies import as_text
from ..store.scripts import JobPush
from .compensation_view import compensations_json
from .execution import (
    DISPATCH_GRACE_MS,
    Execution,
    HeldCommit,
    StepStart,
    event,
    stamp,
    step_doc,
    take_due_starts,
)
from .undo_refs import MARKER_KEY
from .waits import WaitStore

if TYPE_CHECKING:
    from ..flow.lock_store import RedisLocks
    from ..flow.rate_store import RedisRates

log = logging.getLogger("marbles_rq.engine.runs")

TERMINAL = ("succeeded", "failed", "cancelled")
STATUSES = ("queued", "running", "waiting", *TERMINAL)
DEFAULT_LEASE_MS = 10_000
DEFAULT_RETENTION_MS = 7 * 86400 * 1000
# A run's output journal holds at most this many lines / bytes of stream.write and log data
# (MARBLES_MAX_OUTPUT_LINES / MARBLES_MAX_OUTPUT_BYTES); past it a "truncated" marker.
DEFAULT_MAX_OUTPUT_LINES = 10_000
DEFAULT_MAX_OUTPUT_BYTES = 8 << 20


@dataclass(frozen=True)
class Recorded:
    created: bool
    record: RunRecord
    status: str
    enqueued: bool = False  # its first delivery was enqueued by the same call (a JobPush)


@dataclass(frozen=True)
class Started:
    # ok | missing | settled | stale_attempt | busy | cancelled | timed_out | corrupt |
    # waiting (parked: a wake makes a new delivery) | paused (parked now: a pause was asked)
    # | needs_slot (detail: the run's limit) | held (its limit is full: handed back; both
    # flow/limits.py) | key_missing (started, its values sealed with a key this process
    # lacks: execution set, with the values still sealed, for the caller to hand it back)
    status: str
    execution: Execution | None = None
    detail: str = ""


@dataclass(frozen=True)
class OutputEvent:
    id: str
    type: str
    attempt: int
    data: Any

    @property
    def at_ms(self) -> int:
        return int(self.id.split("-", 1)[0])

    @property
    def happened_ms(self) -> int:
        """When what the entry tells happened: a step start written later than it happened
        (with its commit, or by the watchdog) carries `started_ms`, the executor's reckoning
        of the server clock, which errs late (never early: see Execution.server_now_ms) and
        may then pass the entry's own time, and so the time of the step's end, written in
        the same call. Never later than the entry: entries keep their order."""
        at = self.at_ms
        started = self.data.get("started_ms") if isinstance(self.data, dict) else None
        if self.type == "step_started" and isinstance(started, int):
            return min(started, at)
        return at


@dataclass(frozen=True)
class RunView:
    """A run as `status --json` shows it."""

    record: RunRecord
    status: str
    attempt: int
    epoch: int
    created_ms: int
    started_ms: int | None
    finished_ms: int | None
    result: msgspec.Raw | None
    error: ErrorInfo | None
    worker: str | None
    cancel_requested: bool
    steps: list[StepRecord]
    note: str | None = None  # why a queued run waits (e.g. no worker knows its workflow)
    wait_reason: str | None = None  # question | timer | child | paused, while waiting
    wait_for: dict[str, Any] | None = None
    wait_since_ms: int | None = None
    pause_requested: bool = False
    lane: int = 0  # the lane its deliveries go through (recorded when it was enqueued)
    # `attempt` is 1 + redeliveries (what max deliveries limits); `delivery` the delivery
    # number (every new delivery: redeliveries, resumptions, hand-backs, holds; it names the
    # RQ job and is the `a` of output events); `resumptions` the wakes after a park.
    delivery: int = 0
    resumptions: int = 0
    tags: dict[str, str] = field(default_factory=dict)  # search tags (engine/tags.py)

    def to_json(self) -> dict[str, Any]:
        def iso(ms: int | None) -> str | None:
            if ms is None:
                return None
            try:
                return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + (
                    f".{ms % 1000:03d}Z")
            except (OverflowError, ValueError, OSError):  # past any calendar
                return f"{ms} ms since 1970"

        return {
            "id": self.record.id, "name": self.record.name, "queue": self.record.queue,
            "version": self.record.wf_version,
            "lane": self.lane, "priority": self.record.priority,
            "concurrency": None if not self.record.concurrency else {
                "limit": self.record.concurrency,
                "key": self.record.concurrency_label or None},
            "status": self.status, "attempt": self.attempt, "resumptions": self.resumptions,
            "tags": dict(self.tags),
            **dict(zip(("phase", "compensations"),
                       compensations_json(self.steps, self.status), strict=True)),
            "start_at": iso(self.record.not_before_ms or None),
            "delivery": self.delivery,
            "created_at": iso(self.created_ms), "started_at": iso(self.started_ms),
            "finished_at": iso(self.finished_ms),
            "input": msgspec.json.decode(self.record.input),
            "result": None if self.result is None else msgspec.json.decode(self.result),
            "error": None if self.error is None else msgspec.structs.asdict(self.error),
            "worker": self.worker, "cancel_requested": self.cancel_requested,
            "note": self.note,
            "waiting": None if self.status != "waiting" else {
                "reason": self.wait_reason, "for": self.wait_for or {},
                "since": iso(self.wait_since_ms)},
            "pause_requested": self.pause_requested and self.status != "waiting",
            "parent": self.record.parent or None,
            "rerun_of": self.record.rerun_of or None,
            "rerun_from_step": self.record.rerun_from_step or None,
            "trace_id": tracing.trace_id_hex(self.record),
            "children": [msgspec.json.decode(s.result) for s in self.steps
                         if s.name == "|child"],
            "timers": [{"path": _step_path(s.key), "position": _step_position(s.key),
                        "due_at": iso(msgspec.json.decode(s.result).get("due_ms")),
                        "fired_at": iso(msgspec.json.decode(s.result).get("fired_ms"))}
                       for s in self.steps if s.name == "|sleep"],
            # The patch decisions (engine/patches.py): which branch the run takes where.
            "patches": [{"id": s.name[len("|patch:"):], "path": _step_path(s.key),
                         "new": msgspec.json.decode(s.result) is True}
                        for s in self.steps if s.name.startswith("|patch:")],
            # A step still "running" (or parked) in a finished run was interrupted.
            "steps": [{"path": _step_path(s.key), "position": _step_position(s.key),
                       "name": s.name, "attempts": s.attempts,
                       "status": "interrupted" if s.status in ("running", "parked",
                                                               "retrying", "exhausted")
                       and self.status in TERMINAL else s.status,
                       # Input patches given with `retry --input-patch` (engine/input_patch).
                       **({"patches": list(s.patches)} if s.patches else {})}
                      for s in self.steps if not s.name.startswith("|")],
        }


def _json_or_none(raw: bytes | None) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


def _tags(raw: bytes | None) -> dict[str, str]:
    value = _json_or_none(raw)
    return {} if value is None else {str(k): str(v) for k, v in value.items()}


def _step_path(key: str) -> str:
    return key.rsplit("#", 1)[0]


def _step_position(key: str) -> int | None:
    tail = key.rsplit("#", 1)[1] if "#" in key else ""
    return int(tail) if tail.isdigit() else None


class RunStore:
    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.keys = store.keys
        self.scripts = store.scripts
        self.client = store.client

    # -- recording -------------------------------------------------------------------------

    @staticmethod
    def traced(record: RunRecord) -> RunRecord:
        """`record` as it is written: with the traceparent of its enqueue span when this
        process traces (tracing.py), under the caller's current span. Only a record about to
        be written gets one: validating a request (`ops.prepare`) makes no span."""
        if record.traceparent or not tracing.enabled():
            return record
        return msgspec.structs.replace(record, traceparent=tracing.enqueue_traceparent(record))

    def _claim_args(self, record: RunRecord) -> dict[str, Any]:
        check_id(record.id, "run id")
        # The hash's `queue` is the RQ-side queue every delivery of the run goes to: its
        # priority band (flow control), so redeliveries keep the run's priority.
        doc = encode(seal_record(self.store, record, run_holder(record.id)))
        return dict(keys=self.keys.run_keys(record.id), run_id=record.id, doc=doc,
                    request_id=new_request_id(), queue=delivery_queue(record),
                    limit=limit_field(record),
                    timeout_ms=int(record.timeout_s * 1000),
                    max_deliveries=record.max_deliveries, grace_ms=grace_ms(record),
                    event=event(name=record.name, queue=record.queue),
                    retention_ms=int(record.retention_s * 1000),
                    lane=self.keys.lane_of(record.id))

    def _recorded(self, record: RunRecord, reply: Any) -> Recorded:
        if reply.status == "corrupt":
            raise CorruptRecordError(self.keys.run(record.id), as_text(reply.values[0]))
        if reply.status == "ok":
            enqueued = len(reply.values) > 1 and int(reply.values[1]) == 1
            metrics.run_enqueued(record.name, record.queue)
            return Recorded(True, record, "queued", enqueued)
        existing = decode(RunRecord, reply.values[0], self.keys.run(record.id))
        return Recorded(False, open_record(self.store, existing), as_text(reply.values[1]))

    def record(self, record: RunRecord, push: JobPush | None = None) -> Recorded:
        """Record a run (journal first). With `push` (its first delivery as an RQ job, when
        the store and RQ share one standalone Redis) the same script call enqueues it."""
        record = self.traced(record)
        args = self._claim_args(record)
        return self._recorded(record, self.scripts.claim_run(**args, push=push))

    def record_many(self, records: list[RunRecord]) -> list[Recorded]:
        """Record many runs in one round trip per 500 (one by one on a cluster)."""
        return [rec for chunk in _chunks(records, 500) for rec in self.record_chunk(chunk)]

    def record_chunk(self, chunk: list[RunRecord],
                     pushes: list[JobPush] | None = None) -> list[Recorded]:
        """Record a chunk in one round trip; `pushes` (one per record) enqueue each run's
        first delivery in the same call (see `record`)."""
        return self.record_chunk_later(chunk, pushes)()

    def record_chunk_later(self, chunk: list[RunRecord], pushes: list[JobPush] | None = None
                           ) -> Callable[[], list[Recorded]]:
        """`record_chunk` in two halves: the call is built now, the returned function sends
        it and reads the replies."""
        chunk = [self.traced(r) for r in chunk]
        calls = [self._claim_args(r) for r in chunk]
        if pushes is not None:
            for call, push in zip(calls, pushes, strict=True):
                call["push"] = push
        send = self.scripts.claim_runs_later(calls)
        return lambda: [self._recorded(r, reply)
                        for r, reply in zip(chunk, send(), strict=True)]

    def record_seeded(self, record: RunRecord, ledger: list[StepRecord],
                      push: JobPush | None = None) -> Recorded:
        """Record a run whose ledger starts with `ledger` (a rerun): the entries and the run
        land together or not at all; when the id exists nothing is written."""
        record = self.traced(record)
        args = self._claim_args(record)
        if push is not None:
            args["push"] = push
        seeded, claimed = self.scripts.seed_and_claim_run(
            seed=[(s.key, encode(seal_record(self.store, s, run_holder(record.id))))
                  for s in ledger], claim=args)
        recorded = self._recorded(record, claimed)
        if recorded.created and seeded.status == "corrupt":
            # Recorded without its ledger: it would run every step again. It has not
            # started (it was recorded a moment ago), so cancel it before it can.
            self.cancel(record.id, "its ledger key holds another type")
            raise CorruptRecordError(self.keys.run_keys(record.id).steps,
                                     as_text(seeded.values[0]) if seeded.values else "corrupt")
        return recorded

    # -- executing (every call fenced by the execution's epoch) ---------------------------

    def start(self, run_id: str, attempt: int, *, ttl_ms: int, worker: str,
              slot: bool = False, slot_until: int = 0) -> Started:
        """`slot`: the caller holds the run's concurrency slot (flow/limits.py, which
        calls this), until `slot_until` (the lease ends no later); without it a run with a
        limit answers needs_slot."""
        keys = self.keys.run_keys(run_id)
        # Taken before the request: the server's clock in the reply is read later than this,
        # so server_now_ms() errs late, never early (a sleep is at least as long as asked).
        sent = time.monotonic()
        reply = self.scripts.start_attempt(
            keys=keys, run_id=run_id, attempt=attempt, ttl_ms=ttl_ms, worker=worker,
            final_cancel=event(status="cancelled", reason="cancelled before it started"),
            final_timeout=event(status="failed", error={"type": "RunTimeout",
                                                        "message": "the run passed its timeout"}),
            # 64 random bits tell this start from the run's other starts; kept in its hash.
            token=uuid.uuid4().hex[:16], slot=slot, slot_until=slot_until)
        if reply.status == "corrupt":
            return Started("corrupt", detail=f"corrupt record at {keys.run}: "
                                             f"{as_text(reply.values[0])}")
        if reply.status != "ok":
            detail = as_text(reply.values[0]) if reply.values else ""
            return Started(reply.status, detail=detail)
        epoch, doc, deadline_ms, flat, server_ms, tries, resumptions, kind = reply.values
        ledger = {}
        missing: PayloadKeyMissing | None = None
        try:
            record = decode(RunRecord, doc, keys.run)
            if not flat and record.rerun_from_step:
                # start_attempt skips the ledger of a run that never started; a rerun's was
                # seeded with the steps it does not execute again (engine/rerun.py).
                flat = [x for kv in self.client.hgetall(keys.steps).items() for x in kv]
            for i in range(0, len(flat), 2):
                key = as_text(flat[i])
                ledger[key] = decode(StepRecord, flat[i + 1], f"{keys.steps}#{key}")
            try:
                record = open_record(self.store, record)
                ledger = {k: open_record(self.store, v) for k, v in ledger.items()}
            except PayloadKeyMissing as exc:
                missing = exc
        except (CorruptRecordError, UnsupportedRecordVersionError) as exc:
            return Started("corrupt", detail=str(exc))
        ex = Execution(run_id, attempt, int(epoch), keys, ttl_ms, record, int(deadline_ms),
                       ledger, server_ms=int(server_ms), mono_at_start=sent, lease_at=sent,
                       tries=int(tries), resumptions=int(resumptions), kind=as_text(kind))
        if missing is not None:
            # This process lacks a key the run's values were sealed with (a rotation rolled
            # out in the wrong order): started, but the caller hands it back (execute.py).
            return Started("key_missing", ex, detail=str(missing))
        return Started("ok", ex)

    def start_step(self, ex: Execution, record: StepRecord) -> str:
        """Write a step's start before it runs, checking cancel, pause and the deadline:
        ok | stale | settled | cancelled | timed_out | paused."""
        with ex.lock:
            self.write_starts_locked(ex)
            ex.seq += 1
            sent = time.monotonic()
            status = self.scripts.start_step(
                keys=ex.keys, epoch=ex.epoch, seq=ex.seq, late=False,
                starts=[(record.key, step_doc(self.store, ex, stamp(record, ex)),
                         event(step=record.key, attempt=record.attempts,
                               **({"started_ms": ex.admitted_ms} if ex.admitted_ms else {})))]
            ).status
            if status == "ok":
                ex.flags_at = sent
            return status

    def note_child(self, ex: Execution, record: StepRecord) -> str:
        """Name a child in the parent's ledger before recording it (a cancel's walk of the
        ledger then finds it): ok | stale | settled | cancelled | paused | timed_out."""
        with ex.lock:
            self.write_starts_locked(ex)
            ex.seq += 1
            sent = time.monotonic()
            status = self.scripts.note_child(
                keys=ex.keys, epoch=ex.epoch, seq=ex.seq, step_key=record.key,
                record=step_doc(self.store, ex, stamp(record, ex))).status
            if status == "ok":
                ex.flags_at = sent
            return status

    def parent_cancelled(self, parent: str) -> bool:
        """Whether run `parent` is cancelled or asked to be (a read in its own slot)."""
        status, cancel = self.client.hmget(self.keys.run(parent), ["status", "cancel"])
        return as_text(status or b"") == "cancelled" or as_text(cancel or b"") == "1"

    def parent_stopped(self, parent: str) -> bool:
        """Whether run `parent` can no longer take a child it just recorded: finished,
        cancelled or asked to be, or its record gone (a read in its own slot)."""
        status, cancel = self.client.hmget(self.keys.run(parent), ["status", "cancel"])
        return status is None or as_text(status) in TERMINAL or as_text(cancel or b"") == "1"

    def defer_start(self, ex: Execution, start: StepStart) -> None:
        """Keep a step's start to be written with its commit (or before any other write)."""
        with ex.lock:
            ex.starts[id(start)] = start

    def write_due_starts(self, ex: Execution, now: float) -> str | None:
        """Write the deferred starts due by `now` (monotonic): ok | stale | settled, or None
        when none is due (the watchdog's late start)."""
        with ex.lock:
            due = take_due_starts(ex, now)
            if not due:
                return None
            ex.seq += 1
            return self.scripts.start_step(keys=ex.keys, epoch=ex.epoch, seq=ex.seq, late=True,
                                           starts=[s.triple(ex, self.store) for s in due]).status

    def flush_starts(self, ex: Execution) -> None:
        """Write every deferred start of the execution now (see `write_starts_locked`)."""
        with ex.lock:
            self.write_starts_locked(ex)

    def write_starts_locked(self, ex: Execution) -> None:
        """Under ex.lock: write every deferred start first, so what the execution writes next
        comes after the start of the steps it runs in. Its status is the next write's too."""
        if not ex.starts:
            return
        starts = list(ex.starts.values())
        ex.starts.clear()
        ex.seq += 1
        self.scripts.start_step(keys=ex.keys, epoch=ex.epoch, seq=ex.seq, late=True,
                                starts=[s.triple(ex, self.store) for s in starts])

    def commit_step(self, ex: Execution, record: StepRecord, event_type: str,
                    data: bytes) -> str:
        """Record a step attempt's outcome, with the deferred starts (its own among them).
        ok | cancelled | paused (written) | timed_out | stale | settled (not written)."""
        with ex.lock:
            held = self._write_held_locked(ex)
            if held not in (None, "ok", "cancelled", "paused"):
                return held
            return self._commit_locked(ex, record, event_type, data)

    def _commit_locked(self, ex: Execution, record: StepRecord, event_type: str,
                       data: bytes) -> str:
        ex.seq += 1
        starts = [s.triple(ex, self.store) for s in ex.starts.values()]
        ex.starts.clear()
        sent = time.monotonic()
        # Never for a run holding a concurrency slot or a lock: its lease is capped at the
        # hold's expiry, which only the watchdog's renewals extend.
        extend = ex.slot is None and not ex.locks and sent - ex.lease_at > ex.ttl_ms / 2000
        status: str = self.scripts.commit_step(**self._commit_args(
            ex, record, event_type, data, starts, extend)).status
        if status == "ok":
            ex.flags_at = sent
            if extend:
                ex.lease_at = sent
        return status

    def _commit_args(self, ex: Execution, record: StepRecord, event_type: str, data: bytes,
                     starts: list[tuple[str, bytes, bytes]], extend: bool) -> dict[str, Any]:
        return {"keys": ex.keys, "epoch": ex.epoch, "step_key": record.key,
                "record": step_doc(self.store, ex, stamp(record, ex)),
                "event_type": event_type, "event": data,
                "run_id": ex.run_id, "ttl_ms": ex.ttl_ms if extend else 0, "seq": ex.seq,
                "starts": starts}

    def hold_commit(self, ex: Execution, held: HeldCommit) -> str | None:
        """Keep a step's success for the execution's next write (None: held), writing the
        one held before first (its reply when that one was not written: the caller stops)."""
        with ex.lock:
            before = self._write_held_locked(ex)
            if before not in (None, "ok", "cancelled", "paused"):
                return before
            ex.held = held
            return before

    def write_held(self, ex: Execution) -> str | None:
        """Write the held success now: its reply, or None when none is held."""
        with ex.lock:
            return self._write_held_locked(ex)

    def _write_held_locked(self, ex: Execution) -> str | None:
        held, ex.held = ex.held, None
        if held is None:
            return None
        return self._commit_locked(ex, held.record, held.event_type, held.event)

    def write(self, ex: Execution, type: str, data: bytes, *,
              max_lines: int = DEFAULT_MAX_OUTPUT_LINES,
              max_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
              position: tuple[str, int] | None = None) -> str:
        """ok | replayed (this `position`, (frame id, index), was written before: nothing
        written) | capped (dropped: the run's output cap is reached) | stale | settled"""
        with ex.lock:
            self.write_starts_locked(ex)
            if ex.output_capped:
                return "capped"
            ex.seq += 1
            # An output line is the body's own text or value: sealed whole (open_event).
            data = encode_payload(self.store, data, holder=run_holder(ex.run_id))
            status = self.scripts.append_output(
                keys=ex.keys, epoch=ex.epoch, type=type, data=data, seq=ex.seq,
                max_entries=max_lines, max_bytes=max_bytes,
                frame=position[0] if position else "", index=position[1] if position else 0
            ).status
            ex.output_capped = status == "capped"
            return status

    def renew(self, ex: Execution) -> str:
        sent = time.monotonic()
        # The slot and locks first, and the lease capped at their expiry: a live lease
        # always lies within a live hold (a lapsed hold may be another run's now).
        caps = [ex.slot.renew()] if ex.slot is not None else []
        caps += [hold.renew() for hold in list(ex.locks)]  # flow/locks.Hold
        cap = min((c for c in caps if c), default=0)
        status: str = self.scripts.renew_attempt(keys=ex.keys, epoch=ex.epoch, ttl_ms=ex.ttl_ms,
                                                 run_id=ex.run_id, cap_ms=cap).status
        if status == "ok":
            ex.lease_at = sent
        return status

    def renew_many(self, exs: list[Execution]) -> list[str | None]:
        """Renew the leases of executions that hold no concurrency slot, in one round trip
        (per master): each one's status as `renew`'s, None where its call failed."""
        sent = time.monotonic()
        statuses = self.scripts.renew_attempts([(ex.keys, ex.epoch, ex.ttl_ms, ex.run_id)
                                                for ex in exs])
        for ex, status in zip(exs, statuses, strict=True):
            if status == "ok":
                ex.lease_at = sent
        return statuses

    def settle(self, ex: Execution, status: str, *, result: bytes | None = None,
               error: ErrorInfo | None = None) -> str:
        err = b"" if error is None else msgspec.json.encode(error)
        data: dict[str, Any] = {"status": status}
        if result is not None:
            result = encode_payload(self.store, result, holder=run_holder(ex.run_id))
            data["result"] = msgspec.Raw(result)
        if error is not None:
            data["error"] = error
        settle: dict[str, Any] = {
            "keys": ex.keys, "epoch": ex.epoch, "status": status, "result": result or b"",
            "error": err, "event": msgspec.json.encode(data), "run_id": ex.run_id}
        with ex.lock:
            held, ex.held = ex.held, None
            if held is not None:
                # The last step's success and the settle, in one round trip (one fsync).
                ex.seq += 1
                starts = [s.triple(ex, self.store) for s in ex.starts.values()]
                ex.starts.clear()
                commit = self._commit_args(ex, held.record, held.event_type, held.event,
                                           starts, False)
                # A commit refused (stale, past its deadline) is refused by the settle too.
                reply = self.scripts.commit_step_and_settle(commit, settle)
            else:
                self.write_starts_locked(ex)  # a step interrupted early still shows
                reply = self.scripts.settle_run(**settle)
        if reply.status == "timed_out":  # it finished, but after its deadline
            again = self.settle(ex, "failed", error=TIMEOUT_ERROR)
            return "timed_out" if again == "ok" else again
        if reply.status == "ok" and ex.record.singleton:  # free its singleton's key
            from ..flow.singleton import cleared

            cleared(self, ex.record)
        return reply.status

    def claim_effect(self, ex: Execution, key: str, meta: bytes = b"null") -> str:
        """ok | exists | stale_epoch: a receipt under `key`, fenced by the run's epoch and
        the execution's lease (an expired one claims nothing, as it commits nothing)."""
        receipt = EffectReceipt(version=1, scope=ex.run_id, key=key,
                                at_ms=int(time.time() * 1000), meta=msgspec.Raw(meta))
        if not key or len(key) > 512:
            raise MarblesError("an effect key must be 1..512 characters")
        return self.scripts.claim_effect(
            receipt_key=self.keys.effect(ex.run_id, key), fence_key=ex.keys.run,
            index_key=ex.keys.effects, doc=encode(receipt), request_id=new_request_id(),
            epoch=ex.epoch, required=True, lease=(ex.keys.leases, ex.run_id)).status

    def defer(self, ex: Execution, note: str, *, delay_ms: int = DISPATCH_GRACE_MS) -> str:
        """Hand the run back (this worker cannot execute it): ok | stale | settled."""
        return self.scripts.defer_run(
            keys=ex.keys, epoch=ex.epoch, run_id=ex.run_id, delay_ms=delay_ms, note=note,
            event=event(reason=note, previous=ex.attempt)).status

    def fail_corrupt(self, run_id: str, reason: str) -> str:
        """Fail a run whose stored state cannot be read, once: failed | settled | unindexed."""
        keys = self.keys.run_keys(run_id)
        error = ErrorInfo(type="CorruptRecord", message=reason)
        return self.scripts.fail_corrupt(
            keys=keys, run_id=run_id, error=msgspec.json.encode(error),
            event=msgspec.json.encode({"status": "failed", "error": error}),
            retention_ms=DEFAULT_RETENTION_MS).status

    # -- operating ------------------------------------------------------------------------

    def cancel(self, run_id: str, reason: str = "cancelled by request") -> str:
        keys = self.keys.run_keys(check_id(run_id, "run id"))
        reply = self.scripts.cancel_run(keys=keys, run_id=run_id,
                                        event=event(status="cancelled", reason=reason),
                                        request_id=new_request_id())
        if reply.status == "corrupt":
            raise CorruptRecordError(keys.run, as_text(reply.values[0]))
        return reply.status

    def cancel_compensate(self, run_id: str, reason: str = "cancelled by request, with "
                          "compensation") -> tuple[str, int, str]:
        """Cancel a run and run its compensations first (engine/compensation.py):
        (requested | woken | queued | cancelled | settled | missing | compensating, the
        delivery to enqueue when woken, its queue; for compensating, already under way, how
        the run ends: failed | cancelled)."""
        keys = self.keys.run_keys(check_id(run_id, "run id"))
        reply = self.scripts.cancel_compensate(
            keys=keys, run_id=run_id, marker=encode(cancel_marker()),
            event=event(status="cancelled", reason=reason, compensate=True),
            request_id=new_request_id(), grace_ms=DISPATCH_GRACE_MS)
        if reply.status == "corrupt":
            raise CorruptRecordError(keys.run, as_text(reply.values[0]))
        if reply.status == "woken":
            return reply.status, int(reply.values[0]), as_text(reply.values[1])
        if reply.status == "compensating":
            return reply.status, 0, as_text(reply.values[0])
        return reply.status, 0, ""

    def hand_over_compensation(self, ex: Execution) -> tuple[str, int, str]:
        """The execution stopped on a cancel that asked for compensation: queue the run
        again to compensate. (ok | plain | stale | settled, the new delivery, its queue)"""
        reply = self.scripts.hand_over_compensation(
            keys=ex.keys, epoch=ex.epoch, run_id=ex.run_id, grace_ms=DISPATCH_GRACE_MS,
            event=event(reason="cancelled", previous=ex.attempt))
        if reply.status == "ok":
            return reply.status, int(reply.values[0]), as_text(reply.values[1])
        return reply.status, 0, ""

    def abandon(self, run_id: str, attempt: int, worker: str) -> str:
        return self.scripts.abandon_attempt(keys=self.keys.run_keys(run_id), run_id=run_id,
                                            attempt=attempt, worker=worker).status

    # -- reading --------------------------------------------------------------------------

    def rates(self) -> RedisRates:
        """Rate limits (flow/rate_store.py); one per store, so it keeps its cache."""
        rates = self.__dict__.get("_rates")
        if rates is None:
            from ..flow.rate_store import RedisRates

            rates = self.__dict__["_rates"] = RedisRates(self.client, self.keys, self.scripts)
        return rates

    def locks(self) -> RedisLocks:
        """Durable mutexes (flow/lock_store.py)."""
        locks = self.__dict__.get("_locks")
        if locks is None:
            from ..flow.lock_store import RedisLocks

            locks = self.__dict__["_locks"] = RedisLocks(self.client, self.keys, self.scripts)
        return locks

    def waits(self) -> WaitStore:
        """Questions, reports, parking and waking of this store's runs. (A method, so the
        runs in memory hand out their own: engine/memory_store.py.)"""
        return WaitStore(self)

    def child_states(self, ids: list[str]) -> list[tuple[str, bytes | None, bytes | None]]:
        """(status, result, error) of each child run, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for cid in ids:
            pipe.hmget(self.keys.run(cid), "status", "result", "error")
        out = []
        for cid, row in zip(ids, pipe.execute(), strict=True):
            if row[0] is None:
                raise MarblesError(f"child run {cid} does not exist (pruned, or never "
                                   f"recorded)")
            out.append((row[0].decode(), open_bytes_value(self.store, row[1] or None), row[2]))
        return out

    def get(self, run_id: str) -> RunView | None:
        keys = self.keys.run_keys(check_id(run_id, "run id"))
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(keys.run)
        pipe.hgetall(keys.steps)
        fields, steps = pipe.execute(raise_on_error=False)
        for value, key in ((fields, keys.run), (steps, keys.steps)):
            if isinstance(value, redis.ResponseError) and "WRONGTYPE" in str(value):
                raise CorruptRecordError(key, "the key holds another type")
            if isinstance(value, Exception):
                raise value
        return None if not fields else self._view(keys, fields, steps)

    def _view(self, keys: RunKeys, f: dict[bytes, bytes], steps: dict[bytes, bytes]) -> RunView:
        """Raises CorruptRecordError (naming the key and the field) on anything unreadable."""
        def num(name: str) -> int | None:
            value = f.get(name.encode())
            if value in (None, b""):
                return None
            try:
                return int(value)
            except ValueError:
                raise CorruptRecordError(keys.run, f"field {name} is not a number") from None

        if b"doc" not in f or b"status" not in f:
            raise CorruptRecordError(keys.run, "the run hash has no doc or status")
        result, error = open_bytes_value(self.store, f.get(b"result") or None), f.get(b"error")
        ledger = sorted((open_record(self.store, decode(StepRecord, v,
                                                        f"{keys.steps}#{as_text(k)}"))
                         for k, v in steps.items()), key=ledger_order)
        try:
            error_info = msgspec.json.decode(error, type=ErrorInfo) if error else None
            if result:
                msgspec.json.decode(result)
            status = f[b"status"].decode()
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise CorruptRecordError(keys.run, f"unreadable result, error or status: {exc}"
                                     ) from None
        return RunView(
            record=open_record(self.store, decode(RunRecord, f[b"doc"], keys.run)),
            status=status,
            attempt=attempt_of(num("attempt") or 0, num("deferred") or 0),
            delivery=num("attempt") or 0, resumptions=num("resumptions") or 0,
            epoch=num("epoch") or 0,
            created_ms=num("created_ms") or 0, started_ms=num("started_ms"),
            finished_ms=num("finished_ms"),
            result=msgspec.Raw(result) if result else None, error=error_info,
            worker=as_text(f[b"worker"]) if f.get(b"worker") else None,
            cancel_requested=f.get(b"cancel") == b"1", steps=ledger,
            note=as_text(f[b"note"]) if f.get(b"note") else None,
            wait_reason=as_text(f[b"wait_reason"]) if f.get(b"wait_reason") else None,
            wait_for=_json_or_none(f.get(b"wait_for")), wait_since_ms=num("wait_since"),
            pause_requested=f.get(b"pause") == b"1", lane=num("lane") or 0,
            tags=_tags(f.get(b"tags")))

    def list_runs(self, *, limit: int = 50, status: str | None = None,
             name: str | None = None) -> list[RunView]:
        """Newest first. Filters scan up to 50x `limit` of the newest runs per bucket."""
        scan = limit if status is None and name is None else limit * 50
        listings = [self.keys.listing("run", b) for b in range(self.keys.buckets)]
        pipe = self.client.pipeline(transaction=False)
        for key in listings:
            pipe.zrevrange(key, 0, scan - 1, withscores=True)
        rows = sorted(((score, as_text(rid)) for part in pipe.execute() for rid, score in part),
                      reverse=True)[:scan]
        views: list[RunView] = []
        for chunk in _chunks([rid for _, rid in rows], 500):
            for view in self.views(chunk):
                if (status is None or view.status == status) and (
                        name is None or view.record.name == name):
                    views.append(view)
                    if len(views) >= limit:
                        return views
        return views

    def views(self, run_ids: list[str]) -> list[RunView]:
        """The views of these runs in one round trip, in their order; a run that is gone is
        left out, and so is one whose record is unreadable (logged: it costs only itself)."""
        pipe = self.client.pipeline(transaction=False)
        for rid in run_ids:
            keys = self.keys.run_keys(rid)
            pipe.hgetall(keys.run)
            pipe.hgetall(keys.steps)
        replies = pipe.execute(raise_on_error=False)
        views: list[RunView] = []
        for i, rid in enumerate(run_ids):
            fields, steps = replies[2 * i], replies[2 * i + 1]
            if not fields:
                continue
            keys = self.keys.run_keys(rid)
            try:
                if isinstance(fields, Exception) or isinstance(steps, Exception):
                    raise CorruptRecordError(keys.run, f"unreadable: {fields or steps}")
                views.append(self._view(keys, fields, steps))
            except (CorruptRecordError, UnsupportedRecordVersionError) as exc:
                log.warning("skipping run %s: %s", rid, exc)
        return views

    def output(self, run_id: str, *, after: str = "0-0", block_ms: int | None = None,
               count: int = 1000) -> list[OutputEvent]:
        key = self.keys.output(check_id(run_id, "run id"))
        rows: Any
        if block_ms is None:
            rows = self.client.xrange(key, min=f"({after}" if after != "0-0" else "-",
                                      count=count)
        else:
            reply: Any = self.client.xread({key: after}, count=count, block=block_ms)
            if not reply:
                rows = []
            elif isinstance(reply, dict):  # RESP3 shape
                rows = next(iter(reply.values()))
                rows = rows[0] if rows and isinstance(rows[0], list) else rows
            else:
                rows = reply[0][1]
        events = []
        for eid, f in rows:
            try:
                events.append(OutputEvent(as_text(eid), f[b"t"].decode(), int(f[b"a"]),
                                          open_event(self.store, msgspec.json.decode(f[b"d"]))))
            except (KeyError, ValueError, UnicodeDecodeError, msgspec.DecodeError) as exc:
                # One bad entry costs only itself; the id keeps followers moving past it.
                log.warning("skipping unreadable output entry %s %s: %r", key, as_text(eid), exc)
                events.append(OutputEvent(as_text(eid), "unreadable", 0, {"error": repr(exc)}))
        return events


def delayed(record: RunRecord, now_ms: int | None = None) -> bool:
    """Whether a run asked to start later than now (its first delivery then waits for the
    controller's dispatch check, due at its start)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    return record.not_before_ms > now_ms


def grace_ms(record: RunRecord) -> int:
    """When the controller checks a recorded run's first delivery: after the enqueuer's
    grace, or at the run's start when it asked for a later one."""
    if not record.not_before_ms:
        return DISPATCH_GRACE_MS
    return max(0, record.not_before_ms - int(time.time() * 1000))


def attempt_of(delivery: int, deferred: int) -> int:
    """A run's attempt (1 + redeliveries) from its delivery number and the deliveries that
    do not count (wakes, hand-backs, holds): what max deliveries limits."""
    return max(1, delivery - deferred) if delivery else 0


TIMEOUT_ERROR = ErrorInfo(type="RunTimeout", message="the run passed its timeout")


def cancel_marker() -> StepRecord:
    """The ledger's phase marker of a cancel that asked for compensation."""
    return StepRecord(version=1, key=MARKER_KEY, name=MARKER_KEY, status="cancelled",
                      attempts=0, at_ms=int(time.time() * 1000))


T = TypeVar("T")


def _chunks(items: list[T], size: int) -> Iterator[list[T]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
