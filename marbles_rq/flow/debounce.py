"""Debounce windows in the store: an enqueue opens one or merges into it
(lua/debounce_enqueue.lua), the controller closes it when it comes due and records its run
(lua/close_debounce.lua, then the run's ordinary record and first delivery, then
lua/forget_debounce.lua), and `status` shows a window as a waiting run.

A window lives under the bucket tag of its key's digest, and its run id is chosen in that
same bucket: the window's index entries (`deb_due`, `deb_runs`, `deb_closed`) sit next to
the run's own keys, so `status <run id>` finds the window from the id alone, and every
decision is one script on one tag. The run id is fixed when the window opens; closing is
answered again until the run is recorded (insert-if-absent on that id), so a controller
killed anywhere in between leaves the window to the next leader, and the run starts once.
"""

from __future__ import annotations

import time
import uuid
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from ..engine.authoring import InputError
from ..payloads.codec import decode_payload, encode_payload
from ..payloads.fields import run_holder, seal_record
from ..store import new_request_id
from ..store.records import RunRecord, decode, encode
from ..store.replies import as_text
from .gate_specs import Decision, Gate

if TYPE_CHECKING:
    from ..engine.runs import RunStore, RunView
    from ..store.keys import Keyspace
    from ..transport.lanes import RQLike

# A reducer's compare-and-set gives up after this many lost races in a row (never seen: a
# race is lost only to an enqueue that merged in between).
MAX_CAS_TRIES = 1000
# A cancelled window's run is recorded to start this far away, then cancelled at once: no
# delivery is made in between.
CANCELLED_START_MS = 3_600_000


def id_in_bucket(keys: Keyspace, bucket: int) -> str:
    """A fresh run id whose bucket is `bucket`: 24 random hex digits and the first counter
    (in hex) that lands there (about `keys.buckets` CRC32s of a few bytes: ~0.2 ms)."""
    base = uuid.uuid4().hex[:24].encode()
    start, count = zlib.crc32(base), keys.buckets
    i = 0
    while zlib.crc32(b"%x" % i, start) % count != bucket:
        i += 1
    return (base + b"%x" % i).decode()


def enqueue(runs: RunStore, record: RunRecord, gate: Gate, digest: str, key: str,
            reduce: Callable[[bytes, bytes], bytes] | None) -> Decision:
    """Open a window for `record` (under a run id of the window's bucket) or merge its
    input into the open one: the last input wins, or `reduce(previous, new)` (JSON in, JSON
    out) by compare-and-set on the window's revision, so concurrent enqueuers lose none."""
    keys = runs.keys
    bucket = keys.bucket_of(digest)
    record = msgspec.structs.replace(record, id=id_in_bucket(keys, bucket))
    # The window holds the record and its inputs sealed (payloads/codec.py); the reducer
    # is given them as they were.
    holder = run_holder(record.id)
    doc = encode(seal_record(runs.store, record, holder))
    new_input = bytes(record.input)
    stored_input = encode_payload(runs.store, new_input, holder=holder)
    expect, merged = ("", b"") if reduce is None else ("?", b"")
    request_id = new_request_id()
    for _ in range(MAX_CAS_TRIES):
        reply = runs.scripts.debounce_enqueue(
            window=keys.debounce_window(digest), due=keys.debounce_due(bucket),
            runs=keys.debounce_runs(bucket), closed=keys.debounce_closed(bucket),
            run_id=record.id, doc=doc, input=stored_input, merged=merged, expect=expect,
            window_ms=gate.window_ms, max_ms=gate.max_ms, digest=digest,
            request_id=request_id)
        if reply.status == "conflict":
            assert reduce is not None
            expect = as_text(reply.values[1])
            merged = encode_payload(runs.store, reduce(
                decode_payload(runs.store, bytes(reply.values[2])), new_input), holder=holder)
            request_id = new_request_id()  # another write: another request
            continue
        run_id, n, until, most = reply.values
        return Decision(reply.status, as_text(run_id), until_ms=int(until), max_ms=int(most),
                        merged=int(n), key=key)
    raise RuntimeError(f"debounce: lost {MAX_CAS_TRIES} compare-and-set races in a row")


def close(runs: RunStore, rq: RQLike, bucket: int, run_id: str) -> str:
    """Close the window of `run_id` if it is due and record its run (with its first
    delivery): started | open (merged since: later) | gone. Safe to repeat and to race
    another controller: the run is recorded once, under the window's id."""
    from ..engine.ops import enqueue_record

    keys = runs.keys
    due, index, closed = (keys.debounce_due(bucket), keys.debounce_runs(bucket),
                          keys.debounce_closed(bucket))
    raw = runs.client.hget(index, run_id)
    # Without its digest the window key cannot be named; a closed one needs none.
    window = keys.debounce_window(as_text(raw)) if raw else closed
    reply = runs.scripts.close_debounce(window=window, due=due, runs=index, closed=closed,
                                        run_id=run_id)
    if reply.status != "closed":
        return reply.status
    doc, data, _, cancelled = reply.values
    record = msgspec.structs.replace(decode(RunRecord, doc, f"{closed} {run_id}"),
                                     input=msgspec.Raw(decode_payload(runs.store, bytes(data))))
    if cancelled:
        # Recorded to start later (no delivery yet), then cancelled: it never runs.
        record = msgspec.structs.replace(
            record, not_before_ms=int(time.time() * 1000) + CANCELLED_START_MS)
    enqueue_record(runs, rq, record)
    if cancelled:
        runs.cancel(run_id, "its debounce window was cancelled")
    runs.scripts.forget_debounce(due=due, runs=index, closed=closed, run_id=run_id)
    return "cancelled" if cancelled else "started"


def cancel_window(runs: RunStore, rq: RQLike, run_id: str) -> bool:
    """Cancel the run of an open (or closed, unrecorded) debounce window: recorded
    cancelled now, never delivered. False when `run_id` is no window's."""
    keys = runs.keys
    bucket = keys.bucket_of(run_id)
    raw = runs.client.hget(keys.debounce_runs(bucket), run_id)
    if raw is None:
        return False
    outcome = runs.scripts.cancel_debounce(window=keys.debounce_window(as_text(raw)),
                                           due=keys.debounce_due(bucket),
                                           closed=keys.debounce_closed(bucket), run_id=run_id)
    if outcome != "cancelled":
        return False
    # Recorded and cancelled here; killed before, the controller does it (the mark stays).
    close(runs, rq, bucket, run_id)
    return True


class DebouncingError(InputError):
    """The run is a debounce window's that has not started: only `status` and `cancel` act
    on it before it does. Bad input to the CLI (exit 2); HTTP 409."""

    code = "debouncing"


def refuse_window(runs: RunStore, run_id: str, what: str) -> None:
    """DebouncingError when `run_id` is an open (or closing) debounce window's run, which
    `status` shows but which cannot be acted on before it starts; else nothing."""
    view = window_view(runs, run_id)
    if view is None:
        return
    if view.wait_for is not None:
        raise DebouncingError(f"run {run_id} has not started: its debounce window is open "
                              f"until {view.wait_for['until']} (cancel closes it); nothing "
                              f"to {what}")
    raise DebouncingError(f"run {run_id} has not started: its debounce window has just "
                          f"closed and it is starting; nothing to {what} yet")


def window_view(runs: RunStore, run_id: str) -> RunView | None:
    """The run a debounce window will start, as `status` shows it (waiting, reason
    debouncing: until when, how many enqueues merged, the max), or queued once the window
    has closed and its run is being recorded; None when `run_id` is no window's."""
    from ..engine.runs import RunView

    keys = runs.keys
    bucket = keys.bucket_of(run_id)
    raw = runs.client.hget(keys.debounce_runs(bucket), run_id)
    if raw is None:
        return None
    fields = ("run", "doc", "in", "n", "first", "until", "max")
    values = runs.client.hmget(keys.debounce_window(as_text(raw)), fields)
    w: dict[str, Any] = dict(zip(fields, values, strict=True))
    if w["run"] is not None and as_text(w["run"]) == run_id:
        doc, data, first = w["doc"], w["in"], int(w["first"] or 0)
        most = int(w["max"] or 0)
        wait_for: dict[str, Any] | None = {"until": _iso(int(w["until"] or 0)),
                                    "merged": int(w["n"] or 0),
                                    "max": _iso(most) if most else None}
        status, reason, note = "waiting", "debouncing", None
    else:
        closed: list[Any] = runs.client.hmget(keys.debounce_closed(bucket),
                                              [run_id, f"{run_id}|in"])
        if closed[0] is None:
            return None
        doc, data, first, wait_for = closed[0], closed[1], 0, None
        status, reason, note = "queued", None, "its debounce window closed: starting"
    record = msgspec.structs.replace(decode(RunRecord, doc, keys.debounce_runs(bucket)),
                                     input=msgspec.Raw(decode_payload(
                                         runs.store, bytes(data or b"null"))))
    return RunView(record=record, status=status, attempt=0, epoch=0,
                   created_ms=first or record.requested_at_ms, started_ms=None,
                   finished_ms=None, result=None, error=None, worker=None,
                   cancel_requested=False, steps=[], note=note, wait_reason=reason,
                   wait_for=wait_for, wait_since_ms=first or None)


def _iso(ms: int) -> str:
    from .gate_specs import iso

    return iso(ms)
