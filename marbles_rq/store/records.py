"""Records: msgspec Structs, stored as the exact JSON text encoded here.

Rules (see README, "Records"):

* every record has a required ``version``; a reader refuses a version newer than it knows,
  rather than decoding it and later writing it back without the new fields;
* user payloads (inputs, results, values) are ``msgspec.Raw``: their bytes are stored and
  handed back unchanged (key order, unicode, integers of any size);
* new fields get defaults; a field's type never changes;
* a field holding its default is not written (``omit_defaults``): a default never changes
  either, or a record written before would read back with the new one.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import msgspec

from ..errors import CorruptRecordError, UnsupportedRecordVersionError


class Record(msgspec.Struct, kw_only=True, frozen=True, tag_field="kind", omit_defaults=True):
    """Base of every stored document. Subclasses set ``tag=`` (their kind) and VERSION.

    A field equal to its default is left out of the stored text (a run's record is written
    for every run and kept until it is pruned: half of its bytes were defaults); the
    decoder fills it back in, and reads the texts written before, which hold every field,
    alike. ``kind`` and ``version`` have no default and are always written."""

    VERSION: ClassVar[int] = 1
    version: int

    def __post_init__(self) -> None:
        # msgspec leaves a float out only when it is the default's own object (floats are
        # compared by identity): a 0.0 computed elsewhere, or decoded, is made that object.
        for name, default in _float_defaults(type(self)):
            value = getattr(self, name)
            if value is not default and value == default:
                msgspec.structs.force_setattr(self, name, default)


_FLOAT_DEFAULTS: dict[type[Any], tuple[tuple[str, float], ...]] = {}


def _float_defaults(cls: type[Any]) -> tuple[tuple[str, float], ...]:
    found = _FLOAT_DEFAULTS.get(cls)
    if found is None:
        found = _FLOAT_DEFAULTS[cls] = tuple(
            (f.name, f.default) for f in msgspec.structs.fields(cls)
            if isinstance(f.default, float))
    return found


class IdRecord(Record, kw_only=True, frozen=True):
    """A record addressed by its own id (claims, journal entries)."""

    id: str


class EventRecord(IdRecord, tag="event", kw_only=True, frozen=True):
    """An inbound event, claimed under ``sha(source, provider event id)`` before its run."""

    source: str
    payload: msgspec.Raw = msgspec.Raw(b"null")
    received_at_ms: int = 0
    event_id: str = ""  # the provider's own id, as sent (the record id is derived from it)
    type: str = ""


class JournalEntry(IdRecord, tag="journal", kw_only=True, frozen=True):
    """One entry of a named journal (an obligation recorded before it is acted on)."""

    type: str
    payload: msgspec.Raw = msgspec.Raw(b"null")
    at_ms: int = 0


class AgentRecord(Record, tag="agent", kw_only=True, frozen=True):
    """A worker/agent created by provisioning; it owns the records it writes."""

    id: str
    definition_id: str
    provisioning_key: str
    created_at_ms: int = 0
    meta: msgspec.Raw = msgspec.Raw(b"{}")


class WorkspaceEntry(Record, tag="ws_entry", kw_only=True, frozen=True):
    """A value in a workspace, updated only by compare-and-set on ``updated_at``."""

    workspace_id: str
    key: str
    updated_at: str
    value: msgspec.Raw = msgspec.Raw(b"null")


class EffectReceipt(Record, tag="effect", kw_only=True, frozen=True):
    """Proof that an effect was reserved under its idempotency key (first claimer wins)."""

    scope: str
    key: str
    at_ms: int = 0
    meta: msgspec.Raw = msgspec.Raw(b"null")


class ErrorInfo(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    type: str
    message: str
    step: str = ""
    traceback: str = ""


class RunRecord(Record, tag="run", kw_only=True, frozen=True):
    """What was asked for: written once when the run is recorded, never rewritten. The
    mutable state (status, attempt, epoch, result) lives in the run hash's own fields."""

    id: str
    name: str
    queue: str
    input: msgspec.Raw
    requested_at_ms: int
    timeout_s: float = 0.0
    max_deliveries: int = 20
    retention_s: float = 7 * 86400.0
    parent: str = ""  # the run that started this one as its child ("" for none)
    # The trigger that recorded it under an id of its own namespace (event | schedule |
    # monitor; "" for none): a run found under such an id is the trigger's only if it says so.
    origin: str = ""
    # A rerun: the run it reruns, and the step it reran from ("" for a rerun from the top);
    # the ledger entries before that step were copied from that run (engine/rerun.py).
    rerun_of: str = ""
    rerun_from_step: str = ""
    # Flow control (flow/limits.py), fixed when the run is recorded: its priority (higher
    # before lower within its queue), and its concurrency limit (0: none) with the label of
    # the limit's key ("customer=acme"; "" for a workflow-wide limit).
    priority: int = 0
    concurrency: int = 0
    concurrency_label: str = ""
    # Asked to start no earlier than this (epoch ms; 0: at once): recorded without its first
    # delivery, which the controller enqueues when its dispatch check comes due then.
    not_before_ms: int = 0
    # The W3C traceparent of the span that enqueued it ("" when that process did not trace):
    # every attempt, on any worker and after any redelivery, joins this trace (tracing.py).
    traceparent: str = ""
    # The version of its workflow it started on (`@mr.workflow(version=...)`, or a
    # fingerprint of the code): only a worker that serves this version executes it. ""
    # for a run recorded before runs carried one: any worker that knows the workflow does.
    wf_version: str = ""
    # A singleton's run (flow/enqueue_gates.py): the digest of its key, whose pointer is
    # cleared when the run finishes; "" for none.
    singleton: str = ""


class StepRecord(Record, tag="step", kw_only=True, frozen=True):
    """The ledger entry of one step call, keyed ``<path>#<position>``."""

    key: str
    name: str
    # running | succeeded | failed; retrying (its next try is due at result.due_ms) |
    # exhausted (paused for a person: engine/step_retry.py); a timer: waiting | fired
    status: str
    attempts: int
    result: msgspec.Raw = msgspec.Raw(b"null")  # msgspec cannot decode `Raw | None`
    error: ErrorInfo | None = None
    at_ms: int = 0
    # The call's place among the recorded calls of its frame (steps, timers, children), so a
    # replay that calls something else there is caught; -1 in ledgers written before it.
    seq: int = -1
    args: str = ""  # a digest of the step's arguments; a replay with others gets a warning
    # Where the entry was written in the run's commit order: the writing execution's epoch
    # and its write number. The scripts refuse a stale epoch and a write number not above
    # the last applied one, so (epoch, wseq) grows with every write the server accepts: the
    # ledger's order, whatever the workers' clocks say (`at_ms` is for people). -1 in
    # ledgers written before it; epoch 0 for entries copied into a rerun.
    epoch: int = -1
    wseq: int = -1
    # Input patches given with `retry --input-patch`, applied in order to its arguments by
    # every later try and replay (engine/input_patch.py).
    patches: list[Any] = msgspec.field(default_factory=list)
    # The undo a step declared with `compensate=` registers as it succeeds, written with its
    # success: {fn, name, args, kwargs, passes_result} (engine/compensation.py); null: none.
    undo: msgspec.Raw = msgspec.Raw(b"null")


class AskRecord(Record, tag="ask", kw_only=True, frozen=True):
    """A question a run asked (written once; its state lives in the asks hash's fields)."""

    key: str
    ask: str  # approval | question
    title: str
    body: str | None = None
    choices: list[str] | None = None
    step: str = ""  # the frame (step path) that asked
    timeout_s: float = 0.0
    default: msgspec.Raw = msgspec.Raw(b"null")  # the answer on timeout when has_default
    has_default: bool = False


class ReportRecord(Record, tag="report", kw_only=True, frozen=True):
    """A milestone or result a run reported."""

    key: str
    report: str  # milestone | result
    entry: msgspec.Raw
    step: str = ""
    at_ms: int = 0


def ledger_order(step: StepRecord) -> tuple[int, int, int, str]:
    """Sort key of a ledger entry: the run's commit order; entries written before it was
    recorded (epoch -1) come first, by their worker's clock as they always were."""
    return step.epoch, step.wseq, step.at_ms, step.key


R = TypeVar("R", bound=Record)
IR = TypeVar("IR", bound=IdRecord)

_encoder = msgspec.json.Encoder()
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def kind_of(cls: type[Record]) -> str:
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"{cls.__name__} has no string tag")
    return tag


def encode(record: Record) -> bytes:
    return _encoder.encode(record)


def warm_decoders() -> None:
    """Build every record type's decoder now (msgspec reads a type's annotations once per
    process): a forking worker calls this before its first fork, so no horse pays it."""
    todo: list[type[Any]] = [Record]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if isinstance(cls.__struct_config__.tag, str) and cls not in _decoders:
            _decoders[cls] = msgspec.json.Decoder(cls)


def decode(cls: type[R], data: bytes, key: str) -> R:
    """Decode `data` as `cls`; `key` names where it came from in every error."""
    decoder = _decoders.get(cls)
    if decoder is None:
        decoder = _decoders[cls] = msgspec.json.Decoder(cls)
    try:
        record: R = decoder.decode(data)
    except msgspec.DecodeError as exc:  # also covers ValidationError
        raise CorruptRecordError(key, str(exc)) from None
    if record.version > cls.VERSION:
        raise UnsupportedRecordVersionError(key, record.version, cls.VERSION)
    return record
