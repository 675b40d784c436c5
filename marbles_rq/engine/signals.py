"""Signals into runs, in the store: sending one (to a run, or with its start), what a run has
buffered, and taking signals into an execution's ledger.

A signal is a named JSON payload sent to a run from outside. Signals of one name are
numbered in the order they arrive (1, 2, ...) and kept in the run's signals hash until the
run takes them (engine/signal_waits.py: `ctx.wait_for_signal`, `ctx.signals`); a signal sent
before the run asks for it is buffered, not lost. Taking is a compare-and-set on how many
of the name were taken, in the same script that writes the ledger entry, so each signal
enters the ledger exactly once and a replay reads it from there. Every transition is one Lua
script: send_signal, start_signal (signal-with-start), take_signal; park_run requeues a run
that parks for a signal it already has.

    sent = send_signal(runs, "order-7", "approved", {"by": "ann"}, rq=rq)
    started = start_with_signal(runs, rq, RunRequest("orders", b'{"n": 7}', "order-7"),
                                "approved", {"by": "ann"})
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import redis

from .. import metrics, tracing
from ..errors import CorruptRecordError, MarblesError, RunSettledError
from ..flow import limit_specs
from ..payloads.codec import decode_payload as decode_stored
from ..payloads.codec import encode_payload as encode_stored
from ..payloads.fields import open_record, run_holder
from ..store import new_request_id
from ..store.ids import check_id
from ..store.records import RunRecord, StepRecord, decode
from ..store.redis_errors import one_line
from ..store.replies import as_text
from .authoring import REGISTRY, InputError, Registry
from .execution import DISPATCH_GRACE_MS, Execution, RunNotFoundError, stamp, step_doc
from .json_values import changed_by_json
from .runs import RunStore
from .waits import check_key

if TYPE_CHECKING:
    from ..transport.lanes import RQLike
    from .ops import RunRequest

log = logging.getLogger("marbles_rq.engine.signals")

# Signals of one name a run may hold untaken: a run that never asks must not grow without
# bound. Sending more is refused (SignalBufferFullError) until it takes some.
MAX_BUFFERED = 10_000


class SignalBufferFullError(MarblesError):
    """The run holds MAX_BUFFERED signals of the name that it has not taken yet."""

    code = "signal_buffer_full"


class InvalidSignalError(InputError):
    """A signal name or payload that is not acceptable (the message says why)."""

    code = "invalid_signal"


class SignalTimeoutError(MarblesError):
    """`wait_for_signal(name, timeout_s=...)` saw no signal of the name within its timeout."""

    code = "signal_timeout"


def check_name(name: str) -> str:
    """A signal name: 1..128 printable characters without '|'."""
    try:
        return check_key(name, "signal name")
    except InputError as exc:
        raise InvalidSignalError(str(exc)) from None


def check_payload(raw: bytes) -> bytes:
    """A payload given as JSON text: within the payload limit, valid UTF-8 JSON, at most
    MAX_DEPTH levels deep. Returned as given (it is stored verbatim)."""
    # ops (and with it RQ) only when a signal is sent: a `status` reads the counts here.
    from .ops import (
        MAX_DEPTH,
        MAX_PAYLOAD_ENV,
        PayloadTooLargeError,
        json_depth_exceeds,
        max_payload,
    )

    limit = max_payload()
    if len(raw) > limit:
        raise PayloadTooLargeError(f"the signal's payload is {len(raw)} bytes; the limit is "
                                   f"{limit} (set {MAX_PAYLOAD_ENV} to change it)")
    if json_depth_exceeds(raw):
        raise InvalidSignalError(f"the signal's payload nests arrays or objects deeper than "
                                 f"{MAX_DEPTH} levels")
    try:
        msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidSignalError(f"the signal's payload is not valid JSON: {exc}") from None
    return raw


def encode_payload(value: Any) -> bytes:
    """A Python value as a signal payload (JSON), checked as `check_payload` does."""
    try:
        raw = msgspec.json.encode(value)
    except (TypeError, UnicodeEncodeError, msgspec.EncodeError) as exc:
        raise InvalidSignalError(f"the signal's payload cannot be sent as JSON: {exc}"
                                 ) from None
    except RecursionError:  # nesting deeper than the encoder can recurse
        raise InvalidSignalError("the signal's payload nests too deep to be sent as JSON"
                                 ) from None
    if changed_by_json(value, raw):
        raise InvalidSignalError("the signal's payload cannot be sent as JSON: it holds NaN "
                                 "or an infinity")
    return check_payload(raw)


def _payload(payload: Any, payload_json: bytes | None) -> bytes:
    if payload_json is not None:
        if payload is not None:
            raise InvalidSignalError("give the payload as a value or as JSON text, not both")
        return check_payload(payload_json)
    return encode_payload(payload)


def _event_head(name: str) -> bytes:
    # The script appends the sequence number and the closing brace: it never encodes JSON.
    return msgspec.json.encode({"name": name})[:-1] + b',"seq":'


@dataclass(frozen=True)
class SignalSent:
    """What sending one signal did."""

    run_id: str
    name: str
    seq: int  # its number among the run's signals of this name (1, 2, ...)
    woken: bool  # the run was parked waiting for this name and is queued again now
    dispatched: bool  # the woken run's delivery is enqueued (else the controller does it)

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run_id, "name": self.name, "seq": self.seq, "woken": self.woken,
                "dispatched": self.dispatched}


@dataclass(frozen=True)
class SignalStarted:
    """What signal-with-start did: the run (new or found) and the signal it got."""

    run_id: str
    created: bool  # the run was recorded by this call (False: it existed)
    name: str
    seq: int
    status: str  # the run's status after the call
    record: RunRecord
    woken: bool  # an existing run parked waiting for this name was queued again
    dispatched: bool  # its delivery (first, or the wake's) is enqueued

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run_id, "created": self.created, "name": self.name,
                "seq": self.seq, "status": self.status, "workflow": self.record.name,
                "woken": self.woken, "dispatched": self.dispatched}


def _enqueue_wake(runs: RunStore, rq: RQLike | None, queue: str, run_id: str,
                  attempt: int) -> bool:
    """Enqueue a woken run's delivery now; a failure leaves it to the controller (after its
    dispatch grace), as every wake does."""
    from ..transport.lanes import as_lanes

    if rq is None:
        return False
    try:
        as_lanes(rq, runs.keys).enqueue(queue, run_id, attempt)
    except redis.RedisError as exc:
        log.warning("run %s attempt %s: enqueue failed (%s); the controller dispatches it",
                    run_id, attempt, one_line(exc))
        return False
    return True


def _marker(runs: RunStore, run_id: str, request_id: str | None) -> str:
    # A caller's request id makes a retry of the same send (its reply lost to a timeout or a
    # restart) answer what the first did, within MARKER_MS (a minute); none: this call only.
    rid = new_request_id() if request_id is None else check_id(request_id, "request id")
    return runs.keys.request_marker(run_id, f"sig.{rid}")


def send_signal(runs: RunStore, run_id: str, name: str, payload: Any = None, *,
                payload_json: bytes | None = None, rq: RQLike | None = None,
                request_id: str | None = None) -> SignalSent:
    """Send signal `name` to run `run_id`: appended durably after the run's earlier signals
    of that name; if the run is parked waiting for that name it is woken by the same script
    (and its delivery enqueued on `rq`; without `rq` the controller dispatches it after its
    grace). The payload is `payload` (a JSON-able value) or `payload_json` (JSON text, as
    the CLI and HTTP take it). Raises InvalidSignalError / PayloadTooLargeError (bad name or
    payload), RunNotFoundError (no such run), RunSettledError (the run has finished),
    SignalBufferFullError; on any of them nothing is recorded. `request_id`: the caller's id
    for this send; sent again with it within a minute (a retry after a lost reply), it is
    not appended again and the first send's reply is returned."""
    with tracing.span(f"signal {name}", "PRODUCER", **{"marbles.run_id": run_id}):
        return _send_signal(runs, run_id, name, payload, payload_json=payload_json, rq=rq,
                            request_id=request_id)


def _send_signal(runs: RunStore, run_id: str, name: str, payload: Any, *,
                 payload_json: bytes | None, rq: RQLike | None,
                 request_id: str | None) -> SignalSent:
    check_id(run_id, "run id")
    check_name(name)
    raw = _payload(payload, payload_json)
    keys = runs.keys.run_keys(run_id)
    reply = runs.scripts.send_signal(
        keys=keys, marker=_marker(runs, run_id, request_id), run_id=run_id,
        name=name, payload=encode_stored(runs.store, raw, holder=run_holder(run_id)),
        event_head=_event_head(name), grace_ms=DISPATCH_GRACE_MS,
        max_buffered=MAX_BUFFERED)
    if reply.status == "missing":
        raise RunNotFoundError(f"no run with id {run_id!r}")
    if reply.status == "settled":
        raise RunSettledError(f"run {run_id} has already finished "
                              f"({as_text(reply.values[0])}); signal {name!r} not recorded")
    if reply.status == "full":
        raise SignalBufferFullError(
            f"run {run_id} holds {int(reply.values[0])} signals {name!r} it has not taken "
            f"yet (at most {MAX_BUFFERED}); signal not recorded")
    seq, attempt, queue = int(reply.values[0]), int(reply.values[1]), as_text(reply.values[2])
    dispatched = attempt > 0 and _enqueue_wake(runs, rq, queue, run_id, attempt)
    return SignalSent(run_id, name, seq, attempt > 0, dispatched)


@dataclass(frozen=True)
class _Written:
    """What start_signal answered, as FirstDelivery reads a recording."""

    reply_status: str
    values: list[Any]

    @property
    def created(self) -> bool:
        return self.reply_status == "created"

    @property
    def enqueued(self) -> bool:
        return self.created and int(self.values[1]) == 1


def start_with_signal(runs: RunStore, rq: RQLike, request: RunRequest, name: str,
                      payload: Any = None, *, payload_json: bytes | None = None,
                      registry: Registry = REGISTRY,
                      request_id: str | None = None) -> SignalStarted:
    """Signal-with-start: create run `request.run_id` if no run has that id and deliver
    signal `name` to it, in one script call on the store: a new run is recorded with the
    signal already buffered (and its first delivery enqueued in the same call when the store
    and RQ share one standalone Redis, as `ops.enqueue` does); an existing run gets the
    signal as `send_signal` gives it. Concurrent calls for one id create one run, which gets
    every signal. The request is validated completely first (as `ops.enqueue`'s); a
    request without an id is refused (the id is what makes the start idempotent). Raises as
    `send_signal`, and RunSettledError when the run exists and has finished. `request_id`
    as `send_signal`'s."""
    from ..transport.first_delivery import FirstDelivery
    from .ops import prepare

    if request.run_id is None:
        raise InvalidSignalError("signal-with-start needs a run id (--id)")
    check_name(name)
    raw = _payload(payload, payload_json)
    record = runs.traced(prepare(request, registry))
    claim = runs._claim_args(record)
    marker = _marker(runs, record.id, request_id)

    def write(push: Any) -> _Written:
        reply = runs.scripts.start_signal(claim={**claim, "push": push}, marker=marker,
                                          name=name, payload=encode_stored(
                                              runs.store, raw, holder=run_holder(record.id)),
                                          event_head=_event_head(name),
                                          max_buffered=MAX_BUFFERED)
        return _Written(reply.status, reply.values)

    written, dispatched = FirstDelivery(rq, runs.keys, runs.client).record(
        write, limit_specs.delivery_queue(record), record.id)
    status, values = written.reply_status, written.values
    if status == "corrupt":
        raise CorruptRecordError(runs.keys.run(record.id), as_text(values[0]))
    if status == "settled":
        raise RunSettledError(f"run {record.id} has already finished "
                              f"({as_text(values[0])}); signal {name!r} not recorded")
    if status == "full":
        raise SignalBufferFullError(
            f"run {record.id} holds {int(values[0])} signals {name!r} it has not taken yet "
            f"(at most {MAX_BUFFERED}); signal not recorded")
    if status == "created":
        metrics.run_enqueued(record.name, record.queue)
        return SignalStarted(record.id, True, name, int(values[0]), "queued", record, False,
                             dispatched)
    seq, attempt, queue = int(values[0]), int(values[1]), as_text(values[2])
    existing = open_record(runs.store, decode(RunRecord, values[3], runs.keys.run(record.id)))
    woken_dispatched = attempt > 0 and _enqueue_wake(runs, rq, queue, record.id, attempt)
    return SignalStarted(record.id, False, name, seq, as_text(values[4]), existing,
                         attempt > 0, woken_dispatched)


# -- what a run holds ----------------------------------------------------------------------

@dataclass(frozen=True)
class SignalCount:
    sent: int  # signals of the name sent so far
    taken: int  # taken into the run's ledger

    @property
    def buffered(self) -> int:
        return self.sent - self.taken


def signal_counts(runs: RunStore, run_id: str) -> dict[str, SignalCount]:
    """Per signal name: how many were sent to the run and how many it has taken."""
    key = runs.keys.signals(check_id(run_id, "run id"))
    fields: dict[bytes, bytes] = runs.client.hgetall(key)  # type: ignore[assignment]
    sent: dict[str, int] = {}
    taken: dict[str, int] = {}
    for field, value in fields.items():
        name, _, kind = as_text(field).rpartition("|")
        try:
            if kind == "n":
                sent[name] = int(value)
            elif kind == "c":
                taken[name] = int(value)
        except ValueError:
            raise CorruptRecordError(key, f"field {as_text(field)!r} is not a number") from None
    return {name: SignalCount(n, taken.get(name, 0)) for name, n in sorted(sent.items())}


def signals_json(runs: RunStore, run_id: str) -> dict[str, Any]:
    """What `status --json` shows under "signals": per name sent, taken, buffered."""
    return {name: {"sent": c.sent, "taken": c.taken, "buffered": c.buffered}
            for name, c in signal_counts(runs, run_id).items()}


@dataclass(frozen=True)
class Buffered:
    """A run's signals of one name not taken yet, as an execution read them."""

    taken: int  # how many of the name were taken before these
    sent: int
    payloads: list[bytes]  # those read, in order (seq taken+1, ...)
    at_ms: list[int]  # when each was sent (server ms)


def read_buffered(runs: RunStore, run_id: str, name: str, limit: int | None = None
                  ) -> Buffered:
    """The run's untaken signals of `name`, at most `limit` of them (None: all)."""
    key = runs.keys.signals(run_id)
    counts: list[bytes | None] = runs.client.hmget(  # type: ignore[assignment]
        key, [f"{name}|n", f"{name}|c"])
    try:
        sent, taken = (int(v) if v else 0 for v in counts)
    except ValueError:
        raise CorruptRecordError(key, f"the counts of signal {name!r} are not numbers"
                                 ) from None
    last = sent if limit is None else min(sent, taken + limit)
    if last <= taken:
        return Buffered(taken, sent, [], [])
    fields = []
    for seq in range(taken + 1, last + 1):
        fields += [f"{name}|{seq}", f"{name}|{seq}|at"]
    values: list[bytes | None] = runs.client.hmget(key, fields)  # type: ignore[assignment]
    payloads: list[bytes] = []
    at_ms: list[int] = []
    for i in range(0, len(values), 2):
        doc, at = values[i], values[i + 1]
        if doc is None or at is None:
            # Taken meanwhile by another branch of the execution: the caller reads again.
            return Buffered(taken, sent, payloads, at_ms)
        payloads.append(decode_stored(runs.store, doc))
        at_ms.append(int(at))
    return Buffered(taken, sent, payloads, at_ms)


def take(runs: RunStore, ex: Execution, name: str, taken: int, count: int,
         record: StepRecord, event: dict[str, Any]) -> str:
    """Take signals taken+1 .. taken+count of `name` into the ledger as `record` (fenced by
    the execution). ok | conflict (read again) | cancelled | paused | stale | settled."""
    with ex.lock:
        runs.write_starts_locked(ex)  # the steps started before come first in the output
        ex.seq += 1
        return runs.scripts.take_signal(
            keys=ex.keys, epoch=ex.epoch, run_id=ex.run_id, name=name, taken=taken,
            count=count, step_key=record.key, record=step_doc(runs.store, ex, stamp(record, ex)),
            event=msgspec.json.encode(event), seq=ex.seq).status
