"""Bulk enqueue: runs of one workflow from a JSON-lines stream, validated line by line and
recorded and enqueued ENQUEUE_CHUNK at a time, one round trip per chunk.

The format (one line, one run; blank lines are skipped but counted):

* `{"input": <input>}` or `{"id": "<run id>", "input": <input>}`: a line that is a JSON
  object whose keys are `input` and at most `id` besides is an envelope;
* anything else is the input itself (`{"sku": "a-1", "qty": 2}`, `[1, 2]`, `null`).

Rerunning a file is safe because every line names its run: its `id`, or else one derived
from the line, `<workflow>-<first 32 hex of sha256(workflow NUL line)>` (the line without
surrounding whitespace, so CRLF and LF files agree). A line enqueued by an earlier, cut-off
pass is found by its id and counted as `existing`; nothing is enqueued twice. Two lines
naming the same run id in one file are a mistake: the second is refused. So are two
identical lines without ids (give ids to run one input twice).

Memory stays bounded: a chunk of lines at a time, and 8 bytes (plus the dict's overhead,
about 100 bytes in all) per accepted line to find duplicate ids; a line longer than the
payload limit is skipped unread, not loaded.
"""

from __future__ import annotations

import hashlib
import queue as queue_mod
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO

import msgspec

from ..errors import InvalidIdError
from ..store.ids import check_id
from ..store.records import RunRecord
from ..transport.lanes import RQLike
from .authoring import REGISTRY, InputError, Registry, queue_problem
from .ops import (
    ENQUEUE_CHUNK,
    MAX_DEPTH,
    Enqueued,
    RunRequest,
    enqueue_records_later,
    json_depth_exceeds,
    max_payload,
    prepare,
)
from .runs import RunStore

ENVELOPE_SLACK = 1024  # an envelope's `{"id": ..., "input": ...}` around a full-size input
_envelope_keys = frozenset({"id", "input"})
_object = msgspec.json.Decoder(dict[str, msgspec.Raw])


@dataclass(frozen=True)
class Refused:
    line: int
    reason: str
    run_id: str | None = None


@dataclass
class BulkReport:
    lines: int = 0  # lines read, blank ones included
    enqueued: int = 0  # new runs, recorded and enqueued (or left to the controller)
    existing: int = 0  # runs recorded before (an earlier pass of the same file)
    refused: int = 0
    undispatched: int = 0  # recorded, but RQ was not reached: the controller enqueues them
    bytes_read: int = 0
    refusals: list[Refused] = field(default_factory=list)  # the first `keep_refusals`

    def to_json(self) -> dict[str, object]:
        return {"lines": self.lines, "enqueued": self.enqueued, "existing": self.existing,
                "refused": self.refused, "undispatched": self.undispatched,
                "refusals": [{"line": r.line, "id": r.run_id, "reason": r.reason}
                             for r in self.refusals]}


def derived_id(workflow: str, line: bytes) -> str:
    """The run id of a line that gives none: stable for the same workflow and line."""
    digest = hashlib.sha256(workflow.encode() + b"\0" + line).hexdigest()[:32]
    candidate = f"{workflow}-{digest}"
    try:
        return check_id(candidate, "run id")
    except InvalidIdError:  # a workflow name that cannot be part of an id
        return f"batch-{digest}"


def read_lines(fh: IO[bytes], limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, the line or None when longer than `limit`, bytes consumed). A long
    line is skipped in bounded pieces, never held whole."""
    number = 0
    while True:
        line = fh.readline(limit + 1)
        if not line:
            return
        number += 1
        consumed = len(line)
        if len(line) > limit and not line.endswith(b"\n"):
            while True:
                more = fh.readline(1 << 16)
                consumed += len(more)
                if not more or more.endswith(b"\n"):
                    break
            yield number, None, consumed
            continue
        yield number, line, consumed


def parse_line(workflow: str, text: bytes, queue: str | None) -> RunRequest:
    """A request for one stripped, non-blank line (see the module's format)."""
    if json_depth_exceeds(text):
        raise InputError(f"the line nests arrays or objects deeper than {MAX_DEPTH} levels")
    run_id: str | None = None
    raw = text
    if text[:1] == b"{":
        try:
            obj = _object.decode(text)
        except msgspec.DecodeError as exc:
            raise InputError(f"not valid JSON: {exc}") from None
        if "input" in obj and obj.keys() <= _envelope_keys:
            raw = bytes(obj["input"])
            if "id" in obj:
                given = msgspec.json.decode(obj["id"])
                if not isinstance(given, str):
                    raise InputError("an envelope's id must be a string")
                run_id = given
    return RunRequest(workflow, raw, run_id if run_id is not None else
                      derived_id(workflow, text), queue, strict=True)


def bulk_enqueue(runs: RunStore, rq: RQLike, workflow: str, fh: IO[bytes], *,
                 queue: str | None = None, registry: Registry = REGISTRY,
                 chunk: int = ENQUEUE_CHUNK, keep_refusals: int = 10_000,
                 on_refused: Callable[[Refused], None] | None = None,
                 on_progress: Callable[[BulkReport], None] | None = None) -> BulkReport:
    """Enqueue a run of `workflow` per line of `fh`. Every line is validated before its
    chunk is sent; a refused line is reported (`on_refused`) and the rest go in. Raises
    on a Redis error: the chunks sent before it are in, the rest not; the same call again
    enqueues what is missing (see the module's note on ids)."""
    definition = registry.workflow(workflow)  # an unknown name is refused before reading
    if definition.gate is not None:
        from ..flow.enqueue_gates import GateRefusedError

        raise GateRefusedError(f"workflow {definition.name!r} has a {definition.gate.kind}: "
                               f"bulk enqueue does not apply it; enqueue its runs one by one")
    if queue is not None and (problem := queue_problem(queue)) is not None:
        raise InvalidIdError(problem)  # the same for every line: refused before reading
    name = definition.name
    limit = max_payload()
    report = BulkReport()
    seen: dict[int, int] = {}  # 8 bytes of blake2b(run id) -> the line that named it
    pending: list[tuple[int, RunRecord]] = []

    def refuse(line: int, reason: str, run_id: str | None = None) -> None:
        report.refused += 1
        item = Refused(line, reason, run_id)
        if len(report.refusals) < keep_refusals:
            report.refusals.append(item)
        if on_refused is not None:
            on_refused(item)

    def deliver(send: Callable[[], list[Enqueued]]) -> None:  # in the sender's thread
        for outcome in send():
            if outcome.created:
                report.enqueued += 1
                report.undispatched += not outcome.dispatched
            else:
                report.existing += 1
        if on_progress is not None:
            on_progress(report)

    sender = _Sender(deliver)

    def send() -> None:
        # The chunk's call is built here, in the reader's thread: the sender's thread only
        # sends it, while the reader reads, checks and builds the next one.
        sender.put(enqueue_records_later(runs, rq, [record for _, record in pending]))
        pending.clear()

    try:
        _read(fh, name, queue, registry, limit, chunk, report, seen, pending, refuse, send,
              on_progress)
    finally:
        # The chunk in flight and the one waiting are sent even when reading stopped (an
        # error, Ctrl-C): a chunk is whole or absent, and `report` counts what went in.
        sender.close()
    if on_progress is not None:
        on_progress(report)
    return report


def _read(fh: IO[bytes], name: str, queue: str | None, registry: Registry, limit: int,
          chunk: int, report: BulkReport, seen: dict[int, int],
          pending: list[tuple[int, RunRecord]], refuse: Callable[..., None],
          send: Callable[[], None],
          on_progress: Callable[[BulkReport], None] | None) -> None:
    for number, line, consumed in read_lines(fh, limit + ENVELOPE_SLACK):
        report.lines = number
        report.bytes_read += consumed
        if line is None:
            refuse(number, f"the line is longer than the limit of {limit + ENVELOPE_SLACK} "
                           f"bytes (an input may have {limit})")
            continue
        text = line.strip()
        if not text:
            continue
        try:
            request = parse_line(name, text, queue)
            record = prepare(request, registry, limit)
        except (InputError, InvalidIdError) as exc:
            refuse(number, str(exc))
            continue
        # Two ids with the same 8-byte digest (odds about 1 in 10^9 at 100,000 lines) would
        # read as a duplicate: the second is refused, never enqueued twice.
        digest = int.from_bytes(hashlib.blake2b(record.id.encode(), digest_size=8).digest())
        first = seen.setdefault(digest, number)
        if first != number:
            refuse(number, f"duplicate run id {record.id!r} (line {first} names it too)",
                   record.id)
            continue
        pending.append((number, record))
        if len(pending) >= chunk:
            send()
        elif on_progress is not None and number % 256 == 0:
            on_progress(report)
    if pending:
        send()


_Send = Callable[[], list[Enqueued]]


class _Sender:
    """Sends chunks from a thread of its own, in order, while the caller reads, checks and
    builds the next chunk: the server's work on one chunk overlaps the client's on the next
    (with `appendfsync always`, about half the time of a chunk is the server's). At most one
    chunk is in flight and one waits, so memory stays bounded; the first error stops it and
    is raised to the caller by its next `put` or by `close`."""

    def __init__(self, deliver: Callable[[_Send], None]) -> None:
        self._deliver = deliver
        self._queue: queue_mod.Queue[_Send | None] = queue_mod.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bulk-sender", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            send = self._queue.get()
            if send is None:
                return
            if self._error is None:
                try:
                    self._deliver(send)
                except BaseException as exc:  # handed to the caller's thread
                    self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def put(self, send: _Send) -> None:
        self._raise()
        self._queue.put(send)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._raise()
