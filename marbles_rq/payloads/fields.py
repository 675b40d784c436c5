"""Which fields of the stored records and journal lines hold user values, and their sealing.

The engine writes records (store/records.py) whose user payloads are ``msgspec.Raw``
fields; each one passes through `codec.encode_payload` as the record is written and
`codec.decode_payload` as it is read. Kept in one table, so a reader and a writer never
disagree about which fields are sealed. Bookkeeping fields (status, keys, timings, error
types) stay clear: the Lua scripts read some of them.

A step record's `result` is sealed whatever the step kind (a timer's due time, a child's id
are not secret, but one rule for every entry keeps readers simple). Input patches
(`StepRecord.patches`, a list of JSON values) are sealed one by one: each element becomes an
envelope object.

The run's output stream (``d`` of each entry) holds JSON objects the engine builds; the user
values in them (a run's result, an answer, a report's entry, a printed value) are sealed
where they are put in, either as one member or as the whole object: `open_event` undoes
both, looking at the object and its top-level members only (a sealed value is never nested
deeper, and a user value that looks like an envelope was escaped by `encode_payload`)."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from ..store.records import (
    AskRecord,
    EventRecord,
    Record,
    ReportRecord,
    RunRecord,
    StepRecord,
    WorkspaceEntry,
)
from .codec import ENVELOPE, decode_payload, encode_payload

R = TypeVar("R", bound=Record)

# Record type -> its fields of type msgspec.Raw that hold user values.
PAYLOAD_FIELDS: dict[type[Any], tuple[str, ...]] = {
    RunRecord: ("input",),
    StepRecord: ("result", "undo"),
    AskRecord: ("default",),
    ReportRecord: ("entry",),
    EventRecord: ("payload",),
    WorkspaceEntry: ("value",),
}


def run_holder(run_id: str) -> str:
    """The holder name of anything a run stores (an offloaded blob's reference)."""
    return f"run:{run_id}"


def seal_record(store: Any, record: R, holder: str) -> R:
    """`record` with its user values as stored (the record itself when nothing changes)."""
    changes: dict[str, Any] = {}
    for name in PAYLOAD_FIELDS.get(type(record), ()):
        raw = bytes(getattr(record, name))
        if raw == b"null":  # the field's default (a step started, no undo): nothing to hide
            continue
        sealed = encode_payload(store, raw, holder=holder)
        if sealed != raw:
            changes[name] = msgspec.Raw(sealed)
    if isinstance(record, StepRecord) and record.patches:
        patches = [seal_value(store, p, holder) for p in record.patches]
        if any(isinstance(p, msgspec.Raw) for p in patches):
            changes["patches"] = patches
    return msgspec.structs.replace(record, **changes) if changes else record


def open_record(store: Any, record: R) -> R:
    """`record` with its user values as they were given (the inverse of `seal_record`)."""
    changes: dict[str, Any] = {}
    for name in PAYLOAD_FIELDS.get(type(record), ()):
        raw = bytes(getattr(record, name))
        if raw.startswith(ENVELOPE):
            changes[name] = msgspec.Raw(decode_payload(store, raw))
    if isinstance(record, StepRecord) and any(_is_envelope(p) for p in record.patches):
        changes["patches"] = [open_value(store, p) for p in record.patches]
    return msgspec.structs.replace(record, **changes) if changes else record


def seal_value(store: Any, value: Any, holder: str) -> Any:
    """A JSON value (decoded) as stored in a JSON document: the value itself, or a Raw
    envelope when the codec seals it."""
    raw = msgspec.json.encode(value)
    sealed = encode_payload(store, raw, holder=holder)
    return value if sealed == raw else msgspec.Raw(sealed)


def seal_raw(store: Any, raw: bytes, holder: str) -> msgspec.Raw:
    """JSON text of a user value, to embed in a JSON document the engine builds."""
    return msgspec.Raw(encode_payload(store, raw, holder=holder))


def open_value(store: Any, value: Any) -> Any:
    """A decoded JSON value as given (an envelope object opened; anything else as is)."""
    if not _is_envelope(value):
        return value
    return msgspec.json.decode(decode_payload(store, msgspec.json.encode(value)))


def open_event(store: Any, data: Any) -> Any:
    """An output entry's decoded data with its sealed members (or itself) opened."""
    data = open_value(store, data)
    if isinstance(data, dict) and any(_is_envelope(v) for v in data.values()):
        return {k: open_value(store, v) for k, v in data.items()}
    return data


def open_bytes_value(store: Any, raw: bytes | None) -> bytes | None:
    """Stored JSON text of a user value (a hash field) as given; None stays None."""
    if raw is None:
        return None
    return decode_payload(store, bytes(raw))


def _is_envelope(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and next(iter(value)) == "$mr"
