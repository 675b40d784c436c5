"""A run's history: everything the executor reads back from the store when it replays the
run, in one document (`marbles-rq export`, one per line), so a change can be checked against
it offline (engine/replay_check.py).

What a replay reads, and so what a history holds:

* the run's record (its input, workflow and the version it started on) and its status;
* the ledger: steps, timers, signals and events received, children started, published keys,
  patch decisions (every recorded call returns what it holds);
* its questions, with their state and answers (`ctx.ask` reads them, engine/waiting.py);
* the signals sent to it and not taken yet (engine/signal_waits.py reads them where the
  ledger holds nothing yet);
* the outcome of each child it started (status, result, error: `gather` reads them,
  engine/fanout.py);
* the effect keys it claimed (`claim_effect` answers False for those).

A history line is a Record (store/records.py): a `version` the reader checks, unknown
versions refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from ..errors import CorruptRecordError, MarblesError, UnsupportedRecordVersionError
from ..payloads.codec import decode_payload
from ..payloads.fields import open_bytes_value
from ..store.records import AskRecord, ErrorInfo, Record, RunRecord, StepRecord, decode, encode
from ..store.replies import as_text
from .authoring import InputError
from .execution import RunNotFoundError
from .runs import STATUSES, TERMINAL, RunStore, RunView
from .waits import Question

BATCH = 100  # runs read per round of pipelines


class QuestionState(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A question the run asked, as `ctx.ask` finds it on a replay."""

    record: AskRecord
    state: str  # open | answered | timed_out | cancelled
    answer: msgspec.Raw = msgspec.Raw(b"null")
    asked_ms: int = 0
    answered_ms: int = 0


class SignalState(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """The signals of one name: how many were sent and taken, and the payloads not taken."""

    name: str
    sent: int
    taken: int
    buffered: list[msgspec.Raw] = msgspec.field(default_factory=list)
    buffered_at_ms: list[int] = msgspec.field(default_factory=list)


class ChildOutcome(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A child run's state as `gather` reads it (status "missing": pruned or never recorded)."""

    id: str
    workflow: str = ""
    status: str
    result: msgspec.Raw = msgspec.Raw(b"null")
    error: ErrorInfo | None = None


class History(Record, tag="history", kw_only=True, frozen=True):
    """One run's history (see the module's note)."""

    run: RunRecord
    wf_version: str = ""  # the workflow version the run started on ("" before versions)
    status: str
    result: msgspec.Raw = msgspec.Raw(b"null")
    error: ErrorInfo | None = None
    wait_reason: str = ""
    wait_for: dict[str, Any] = msgspec.field(default_factory=dict)
    ledger: list[StepRecord] = msgspec.field(default_factory=list)
    questions: list[QuestionState] = msgspec.field(default_factory=list)
    signals: list[SignalState] = msgspec.field(default_factory=list)
    children: list[ChildOutcome] = msgspec.field(default_factory=list)
    effects: list[str] = msgspec.field(default_factory=list)
    exported_at_ms: int = 0

    @property
    def run_id(self) -> str:
        return self.run.id

    @property
    def in_flight(self) -> bool:
        return self.status not in TERMINAL


class HistoryFileError(InputError):
    """A history file that cannot be read, or a line of it that is not a history."""

    code = "bad_history_file"


# -- reading from the store --------------------------------------------------------------

def wf_version_of(record: RunRecord) -> str:
    """The workflow version a run record names ("" for a record written before versions)."""
    return str(getattr(record, "wf_version", "") or "")


def read_histories(runs: RunStore, run_ids: list[str], *,
                   missing_ok: bool = False) -> list[History]:
    """The histories of these runs, in their order, three round trips per BATCH runs.
    RunNotFoundError for a run that does not exist (unless `missing_ok`: left out)."""
    out: list[History] = []
    for start in range(0, len(run_ids), BATCH):
        chunk = run_ids[start:start + BATCH]
        views = {v.record.id: v for v in runs.views(chunk)}
        if not missing_ok:
            gone = [rid for rid in chunk if rid not in views]
            if gone:
                raise RunNotFoundError(f"no run with id {gone[0]!r}"
                                       + (f" (and {len(gone) - 1} more)" if len(gone) > 1
                                          else ""))
        found = [views[rid] for rid in chunk if rid in views]
        out += _complete(runs, found)
    return out


def _complete(runs: RunStore, views: list[RunView]) -> list[History]:
    """Each view's questions, signals, effects and children, read in two pipelines."""
    keys = runs.keys
    pipe = runs.client.pipeline(transaction=False)
    for view in views:
        rid = view.record.id
        pipe.hgetall(keys.asks(rid))
        pipe.hgetall(keys.signals(rid))
        pipe.smembers(keys.effect_index(rid))
    replies = pipe.execute()
    waits = runs.waits()
    partial: list[tuple[RunView, list[QuestionState], list[SignalState], list[str]]] = []
    child_ids: list[str] = []
    for i, view in enumerate(views):
        rid = view.record.id
        asks, signals, effects = replies[3 * i:3 * i + 3]
        questions = [_question(q) for q in sorted(waits._questions(rid, asks),
                                                  key=lambda q: (q.asked_ms, q.key))]
        prefix = keys.effect(rid, "")
        claimed = sorted(k[len(prefix):] for k in map(as_text, effects) if k.startswith(prefix))
        partial.append((view, questions, _signals(runs.store, keys.signals(rid), signals), claimed))
        child_ids += [child["id"] for child in _children(view.steps)]
    states: dict[str, list[bytes | None]] = {}
    if child_ids:
        pipe = runs.client.pipeline(transaction=False)
        for cid in child_ids:
            pipe.hmget(keys.run(cid), "status", "result", "error")
        states = dict(zip(child_ids, pipe.execute(), strict=True))
    now = int(time.time() * 1000)
    out = []
    for view, questions, signals, claimed in partial:
        children = []
        for child in _children(view.steps):
            status, result, error = states.get(child["id"]) or [None, None, None]
            children.append(ChildOutcome(
                id=child["id"], workflow=str(child.get("workflow", "")),
                status=as_text(status) if status else "missing",
                result=msgspec.Raw(open_bytes_value(runs.store, result or None) or b"null"),
                error=msgspec.json.decode(error, type=ErrorInfo) if error else None))
        out.append(History(
            version=1, run=view.record, wf_version=wf_version_of(view.record),
            status=view.status, result=view.result or msgspec.Raw(b"null"), error=view.error,
            wait_reason=(view.wait_reason or "") if view.status == "waiting" else "",
            wait_for=(view.wait_for or {}) if view.status == "waiting" else {},
            ledger=view.steps, questions=questions, signals=signals, children=children,
            effects=claimed, exported_at_ms=now))
    return out


def _question(q: Question) -> QuestionState:
    return QuestionState(record=q.record, state=q.state,
                         answer=msgspec.Raw(msgspec.json.encode(q.answer)),
                         asked_ms=q.asked_ms, answered_ms=q.answered_ms or 0)


def _children(ledger: list[StepRecord]) -> list[dict[str, Any]]:
    found = []
    for entry in ledger:
        if entry.name == "|child" and entry.status == "succeeded":
            data = msgspec.json.decode(entry.result)
            if isinstance(data, dict) and isinstance(data.get("id"), str):
                found.append(data)
    return found


def _signals(store: Any, key: str, fields: dict[bytes, bytes]) -> list[SignalState]:
    """The signals hash (engine/signals.py): `<name>|n` sent, `<name>|c` taken, and each
    untaken payload under `<name>|<seq>` with its time under `<name>|<seq>|at`."""
    f = {as_text(k): v for k, v in fields.items()}
    out = []
    for field in sorted(f):
        name, _, kind = field.rpartition("|")
        if kind != "n":
            continue
        try:
            sent, taken = int(f[field]), int(f.get(f"{name}|c") or 0)
        except ValueError:
            raise CorruptRecordError(key, f"the counts of signal {name!r} are not numbers"
                                     ) from None
        payloads, at = [], []
        for seq in range(taken + 1, sent + 1):
            doc, when = f.get(f"{name}|{seq}"), f.get(f"{name}|{seq}|at")
            if doc is None:
                continue
            payloads.append(msgspec.Raw(decode_payload(store, doc)))
            at.append(int(when) if when else 0)
        out.append(SignalState(name=name, sent=sent, taken=taken, buffered=payloads,
                               buffered_at_ms=at))
    return out


# -- selecting runs ----------------------------------------------------------------------

@dataclass(frozen=True)
class Wanted:
    """Which runs to read: ids, or a workflow's runs (and statuses) newest first."""

    run_ids: tuple[str, ...] = ()
    workflow: str | None = None
    statuses: tuple[str, ...] = ()


def select(runs: RunStore, wanted: Wanted) -> Iterator[list[History]]:
    """The histories `wanted` names, a batch at a time (ids: all of them must exist)."""
    if wanted.run_ids:
        ids = list(dict.fromkeys(wanted.run_ids))
        for start in range(0, len(ids), BATCH):
            yield read_histories(runs, ids[start:start + BATCH])
        return
    from .selection import RunFilter, Selection

    as_of = int(time.time() * 1000)
    taken: set[str] = set()  # a run whose status moved between two walks is read once
    for status in wanted.statuses or (None,):
        chosen = Selection(runs, RunFilter.build(status=status, workflow=wanted.workflow),
                           batch=BATCH, as_of_ms=as_of)
        for ids in chosen.batches():
            fresh = [rid for rid in ids if rid not in taken]
            taken.update(fresh)
            # A run pruned between the listing and the read is simply gone.
            found = read_histories(runs, fresh, missing_ok=True) if fresh else []
            if found:
                yield found


def parse_statuses(text: str | None) -> tuple[str, ...]:
    """`--status waiting,running`: the statuses, checked (InputError names a bad one)."""
    from .runs import STATUSES

    if not text:
        return ()
    wanted = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    for status in wanted:
        if status not in STATUSES:
            raise InputError(f"--status: {status!r} is not one of {', '.join(STATUSES)}")
    return wanted


# -- the file ----------------------------------------------------------------------------

def to_line(history: History) -> bytes:
    return encode(history) + b"\n"


def from_line(line: bytes, where: str) -> History:
    """A history from one line; HistoryFileError naming `where` (file:line) if it is not."""
    try:
        history = decode(History, line, where)
        for entry in history.ledger:
            if entry.version > StepRecord.VERSION:
                raise UnsupportedRecordVersionError(where, entry.version, StepRecord.VERSION)
        if history.run.version > RunRecord.VERSION:
            raise UnsupportedRecordVersionError(where, history.run.version, RunRecord.VERSION)
    except (CorruptRecordError, UnsupportedRecordVersionError) as exc:
        raise HistoryFileError(f"{where}: not a run history ({_short(exc)})") from None
    if history.status not in STATUSES:
        # Whether the run is in flight (the old-branch counts) is read from it.
        raise HistoryFileError(f"{where}: not a run history (status {history.status!r} is "
                               f"not one of {', '.join(STATUSES)})")
    return history


def _short(exc: MarblesError) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def read_file(path: str) -> Iterator[History]:
    """The histories of a file written by `export` ('-': stdin), one per non-empty line.
    HistoryFileError for a file that cannot be read or a line that is not a history."""
    import sys

    try:
        fh = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    except OSError as exc:
        raise HistoryFileError(f"cannot read the history file: {exc}") from None
    name = "stdin" if path == "-" else path
    try:
        for n, line in enumerate(fh, 1):
            if line.strip():
                yield from_line(line, f"{name}:{n}")
    except OSError as exc:
        raise HistoryFileError(f"cannot read the history file: {exc}") from None
    finally:
        if fh is not sys.stdin.buffer:
            fh.close()


__all__ = ["ChildOutcome", "History", "HistoryFileError", "QuestionState", "SignalState",
           "Wanted", "from_line", "parse_statuses", "read_file", "read_histories", "select",
           "to_line", "wf_version_of"]
