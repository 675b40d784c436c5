"""Dry runs: a workflow executed in this process by the real executor (engine/execute.py,
the same replay, steps, retries, asks, timers, children and parallel branches), on runs
kept in memory. Nothing is written to Redis, and Redis need not be up.

`MemoryRuns` stands in for RunStore (and `MemoryWaits` for WaitStore): the calls the
executor makes, with the outcomes the Lua scripts would give for a single execution that
nobody fences, cancels or pauses from outside. One lock makes each call atomic.

What differs from a run on Redis (and is said in the README):

* a question is answered by `answer(question)` (the CLI prompts on a terminal) or, when
  that returns None (stdin is not a terminal), the run is cancelled at the question, as
  Marbles does;
* durable timers do not sleep: the dry run's clock jumps to the timer's due time, so a
  workflow that waits an hour finishes at once, seeing the time it would see then;
* a child run is executed right here when its parent waits for it;
* the workflow's timeout_s is not enforced (the clock jumps), and there is no lease.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec

from ..errors import MarblesError
from ..store.keys import Keyspace
from ..store.records import (
    AskRecord,
    ErrorInfo,
    ReportRecord,
    RunRecord,
    StepRecord,
    ledger_order,
)
from .authoring import REGISTRY, Registry
from .context import Limits
from .execute import execute
from .execution import Execution, HeldCommit, stamp, take_due_starts
from .ops import RunRequest, prepare
from .runs import TERMINAL, OutputEvent, Recorded, RunStore, RunView, Started
from .waits import Question

DRY_LEASE_MS = 3_600_000  # no lease to keep: the watchdog renews in memory, rarely
DRY_WORKER = "dry-run"


@dataclass
class _Ask:
    record: AskRecord
    asked_ms: int
    state: str = "open"  # open | answered | cancelled
    answer: Any = None
    answered_ms: int | None = None


@dataclass
class _Run:
    record: RunRecord
    created_ms: int
    status: str = "queued"
    attempt: int = 1  # the delivery number (no redeliveries here: every new one is a wake)
    resumptions: int = 0
    epoch: int = 0
    started_ms: int | None = None
    finished_ms: int | None = None
    ledger: dict[str, StepRecord] = field(default_factory=dict)
    output: list[OutputEvent] = field(default_factory=list)
    output_bytes: int = 0
    written: dict[str, int] = field(default_factory=dict)  # frame entry -> writes made
    result: bytes | None = None
    error: ErrorInfo | None = None
    asks: dict[str, _Ask] = field(default_factory=dict)
    reports: dict[str, ReportRecord] = field(default_factory=dict)
    effects: set[str] = field(default_factory=set)
    wait_reason: str | None = None
    wait_for: dict[str, Any] | None = None
    wait_since_ms: int | None = None


class MemoryRuns:
    """RunStore's executor-facing calls, in memory (see the module's note)."""

    def __init__(self, on_event: Callable[[str, OutputEvent], None] | None = None) -> None:
        self.keys = Keyspace()
        self.runs: dict[str, _Run] = {}
        self.on_event = on_event
        self._lock = threading.RLock()
        self._offset_ms = 0  # how far the dry run's clock is ahead of the real one
        self._last_ms = 0
        self._seq = 0

    # -- the clock ------------------------------------------------------------------------

    def now_ms(self) -> int:
        with self._lock:
            self._last_ms = max(self._last_ms, int(time.time() * 1000) + self._offset_ms)
            return self._last_ms

    def advance_to(self, at_ms: int) -> None:
        """Move the clock to `at_ms` (a timer's due time) if it is behind."""
        with self._lock:
            ahead = at_ms - int(time.time() * 1000)
            self._offset_ms = max(self._offset_ms, ahead)
            self._last_ms = max(self._last_ms, at_ms)

    # -- output ---------------------------------------------------------------------------

    def _emit(self, run: _Run, type: str, data: Any, *, attempt: int | None = None) -> None:
        with self._lock:
            self._seq += 1
            ev = OutputEvent(f"{self.now_ms()}-{self._seq}", type,
                             run.attempt if attempt is None else attempt, data)
            run.output.append(ev)
        if self.on_event is not None:
            self.on_event(run.record.id, ev)

    def _emit_raw(self, run: _Run, type: str, data: bytes) -> None:
        self._emit(run, type, msgspec.json.decode(data))

    # -- recording ------------------------------------------------------------------------

    def record(self, record: RunRecord, push: object | None = None) -> Recorded:
        with self._lock:
            existing = self.runs.get(record.id)
            if existing is not None:
                return Recorded(False, existing.record, existing.status)
            run = self.runs[record.id] = _Run(record, self.now_ms())
        self._emit(run, "queued", {"name": record.name, "queue": record.queue})
        return Recorded(True, record, "queued")

    # -- executing ------------------------------------------------------------------------

    def _run(self, ex: Execution) -> _Run:
        return self.runs[ex.run_id]

    def start(self, run_id: str, attempt: int, *, ttl_ms: int, worker: str) -> Started:
        with self._lock:
            run = self.runs.get(run_id)
            if run is None:
                return Started("missing")
            if run.status in TERMINAL:
                return Started("settled", detail=run.status)
            if run.status != "queued" or attempt != run.attempt:
                return Started("stale_attempt", detail=run.status)
            run.status, run.epoch = "running", run.epoch + 1
            run.wait_reason = run.wait_for = run.wait_since_ms = None
            now = self.now_ms()
            run.started_ms = run.started_ms or now
            ex = Execution(run_id, attempt, run.epoch, self.keys.run_keys(run_id), ttl_ms,
                           run.record, 0, dict(run.ledger), server_ms=now,
                           mono_at_start=time.monotonic(), resumptions=run.resumptions,
                           kind="resumption" if run.epoch > 1 else "first")
        self._emit(run, "attempt_started", {"worker": worker, "epoch": ex.epoch, "attempt": 1,
                                            "resumptions": run.resumptions, "kind": ex.kind})
        return Started("ok", ex)

    def _put_starts(self, ex: Execution, starts: list[Any]) -> None:
        run = self._run(ex)
        ex.seq += 1
        for start in starts:
            run.ledger[start.key] = stamp(start.record, ex)
            self._emit_raw(run, "step_started", start.event)

    def write_starts_locked(self, ex: Execution) -> None:
        if ex.starts:
            starts = list(ex.starts.values())
            ex.starts.clear()
            self._put_starts(ex, starts)

    def flush_starts(self, ex: Execution) -> None:
        with ex.lock:
            self.write_starts_locked(ex)

    def defer_start(self, ex: Execution, start: Any) -> None:
        with ex.lock:
            ex.starts[id(start)] = start

    def write_due_starts(self, ex: Execution, now: float) -> str | None:
        with ex.lock:
            due = take_due_starts(ex, now)
            if not due:
                return None
            self._put_starts(ex, due)
            return "ok"

    def start_step(self, ex: Execution, record: StepRecord) -> str:
        with ex.lock:
            self.write_starts_locked(ex)
            run = self._run(ex)
            ex.seq += 1
            run.ledger[record.key] = stamp(record, ex)
            self._emit(run, "step_started", {"step": record.key, "attempt": record.attempts})
            ex.flags_at = time.monotonic()
            return "ok"

    def note_child(self, ex: Execution, record: StepRecord) -> str:
        with ex.lock:
            self.write_starts_locked(ex)
            self._run(ex).ledger[record.key] = record
            ex.flags_at = time.monotonic()
            return "ok"

    def parent_cancelled(self, parent: str) -> bool:
        with self._lock:
            run = self.runs.get(parent)
            return run is not None and run.status == "cancelled"

    def parent_stopped(self, parent: str) -> bool:
        with self._lock:
            run = self.runs.get(parent)
            return run is None or run.status in TERMINAL

    def commit_step(self, ex: Execution, record: StepRecord, event_type: str,
                    data: bytes) -> str:
        with ex.lock:
            self.write_starts_locked(ex)
            run = self._run(ex)
            ex.seq += 1
            run.ledger[record.key] = stamp(record, ex)
            self._emit_raw(run, event_type, data)
            ex.flags_at = time.monotonic()
            return "ok"

    def hold_commit(self, ex: Execution, held: HeldCommit) -> str | None:
        """Nothing is held in memory: the success is committed at once."""
        status = self.commit_step(ex, held.record, held.event_type, held.event)
        return None if status == "ok" else status

    def write_held(self, ex: Execution) -> str | None:
        return None

    def write(self, ex: Execution, type: str, data: bytes, *, max_lines: int = 10_000,
              max_bytes: int = 8 << 20, position: tuple[str, int] | None = None) -> str:
        with ex.lock:
            self.write_starts_locked(ex)
            run = self._run(ex)
            if ex.output_capped:
                return "capped"
            if position is not None:
                frame, index = position
                if index < run.written.get(frame, 0):
                    return "replayed"
                run.written[frame] = index + 1
            lines = sum(1 for e in run.output if e.type in ("output", "log"))
            if lines >= max_lines or run.output_bytes + len(data) > max_bytes:
                ex.output_capped = True
                self._emit(run, "truncated", {"max_lines": max_lines, "max_bytes": max_bytes})
                return "capped"
            run.output_bytes += len(data)
            self._emit_raw(run, type, data)
            return "ok"

    def renew(self, ex: Execution) -> str:
        return "ok"

    def settle(self, ex: Execution, status: str, *, result: bytes | None = None,
               error: ErrorInfo | None = None) -> str:
        self.flush_starts(ex)
        with self._lock:
            run = self._run(ex)
            if run.status in TERMINAL:
                return "settled"
            run.status, run.result, run.error = status, result, error
            run.finished_ms = self.now_ms()
        data: dict[str, Any] = {"status": status}
        if result is not None:
            data["result"] = msgspec.json.decode(result)
        if error is not None:
            data["error"] = msgspec.structs.asdict(error)
        self._emit(run, "final", data)
        return "ok"

    def claim_effect(self, ex: Execution, key: str, meta: bytes = b"null") -> str:
        if not key or len(key) > 512:
            raise MarblesError("an effect key must be 1..512 characters")
        with self._lock:
            run = self._run(ex)
            if key in run.effects:
                return "exists"
            run.effects.add(key)
            return "ok"

    def defer(self, ex: Execution, note: str, *, delay_ms: int = 0) -> str:
        raise MarblesError(f"dry run: {note}")  # the workflow is checked before it starts

    def fail_corrupt(self, run_id: str, reason: str) -> str:
        raise MarblesError(f"dry run: {reason}")

    # -- operating ------------------------------------------------------------------------

    def cancel(self, run_id: str, reason: str = "cancelled by request") -> str:
        with self._lock:
            run = self.runs.get(run_id)
            if run is None:
                return "missing"
            if run.status in TERMINAL:
                return "settled"
            if run.status == "running":
                return "requested"  # not reached: nothing cancels a dry run from outside
            run.status, run.finished_ms = "cancelled", self.now_ms()
            for ask in run.asks.values():
                if ask.state == "open":
                    ask.state = "cancelled"
        self._emit(run, "final", {"status": "cancelled", "reason": reason})
        return "cancelled"

    # -- reading --------------------------------------------------------------------------

    def waits(self) -> MemoryWaits:
        return MemoryWaits(self)

    def child_states(self, ids: list[str]) -> list[tuple[str, bytes | None, bytes | None]]:
        out = []
        with self._lock:
            for cid in ids:
                run = self.runs.get(cid)
                if run is None:
                    raise MarblesError(f"child run {cid} does not exist")
                error = None if run.error is None else msgspec.json.encode(run.error)
                out.append((run.status, run.result, error))
        return out

    def get(self, run_id: str) -> RunView | None:
        run = self.runs.get(run_id)
        if run is None:
            return None
        ledger = sorted(run.ledger.values(), key=ledger_order)
        return RunView(record=run.record, status=run.status, attempt=1,
                       delivery=run.attempt, resumptions=run.resumptions,
                       epoch=run.epoch, created_ms=run.created_ms, started_ms=run.started_ms,
                       finished_ms=run.finished_ms,
                       result=None if run.result is None else msgspec.Raw(run.result),
                       error=run.error, worker=DRY_WORKER, cancel_requested=False,
                       steps=ledger, wait_reason=run.wait_reason, wait_for=run.wait_for,
                       wait_since_ms=run.wait_since_ms)


class MemoryWaits:
    """WaitStore's calls for a dry run's runs."""

    def __init__(self, runs: MemoryRuns) -> None:
        self.runs = runs

    def park(self, ex: Execution, *, reason: str, wake_at_ms: int, wait_for: dict[str, Any],
             ledger: list[StepRecord], asks: list[AskRecord]) -> tuple[str, int, str]:
        mem = self.runs
        with ex.lock:
            mem.write_starts_locked(ex)
            with mem._lock:
                run = mem._run(ex)
                for i, entry in enumerate(ledger):
                    run.ledger[entry.key] = stamp(entry, ex, i + 1)
                for ask in asks:
                    run.asks.setdefault(ask.key, _Ask(ask, mem.now_ms()))
                run.status, run.wait_reason, run.wait_for = "waiting", reason, wait_for
                run.wait_since_ms = mem.now_ms()
        mem._emit(run, "parked", {"reason": reason, **wait_for})
        return "ok", 0, ""

    def add_report(self, ex: Execution, record: ReportRecord) -> str:
        mem = self.runs
        mem.flush_starts(ex)
        with mem._lock:
            run = mem._run(ex)
            if record.key in run.reports:
                return "exists"
            run.reports[record.key] = record
        mem._emit(run, "report", {"kind": record.report, "key": record.key,
                                  "entry": msgspec.json.decode(record.entry)})
        return "ok"

    def wake(self, run_id: str, cause: str, *, ctl_epoch: int | None = None,
             detail: dict[str, Any] | None = None) -> tuple[str, int, str]:
        mem = self.runs
        with mem._lock:
            run = mem.runs.get(run_id)
            if run is None or run.status != "waiting":
                return "not_waiting", 0, ""
            if cause == "child" and "children" not in (run.wait_for or {}):
                return "idle", 0, ""  # as wake_run: a child wakes only a run waiting for one
            run.status, run.attempt = "queued", run.attempt + 1
            run.resumptions += 1
        mem._emit(run, "woken", {"cause": cause, **(detail or {})})
        return "woken", run.attempt, run.record.queue

    def questions(self, run_id: str) -> list[Question]:
        run = self.runs.runs.get(run_id)
        if run is None:
            return []
        return [Question(run_id, a.record, a.state, "0", a.asked_ms, a.answer, a.answered_ms)
                for a in sorted(run.asks.values(), key=lambda a: (a.asked_ms, a.record.key))]

    def answer(self, run_id: str, key: str, value: Any) -> None:
        mem = self.runs
        with mem._lock:
            run = mem.runs[run_id]
            ask = run.asks[key]
            ask.state, ask.answer, ask.answered_ms = "answered", value, mem.now_ms()
        mem._emit(run, "answered", {"key": key, "answer": value})

    def cancel_children(self, run_id: str) -> list[str]:
        out = []
        for cid, run in list(self.runs.runs.items()):
            if run.record.parent == run_id and self.runs.cancel(
                    cid, "its parent was cancelled") == "cancelled":
                out.append(cid)
                out += self.cancel_children(cid)
        return out


# An answer to a question, or None to cancel the run at it (stdin is not a terminal).
Answerer = Callable[[Question], Any]


@dataclass(frozen=True)
class DryRun:
    view: RunView
    runs: MemoryRuns


def dry_run(name: str, raw_input: bytes, *, answer: Answerer | None = None,
            on_event: Callable[[str, OutputEvent], None] | None = None,
            on_note: Callable[[str], None] | None = None, registry: Registry = REGISTRY,
            run_id: str | None = None, limits: Limits | None = None) -> DryRun:
    """Execute a run of workflow `name` in this process, in memory (see the module's note).
    The input is validated as `enqueue` validates it (strictly). Returns the finished run."""
    request = RunRequest(name, raw_input, run_id or f"dry-{uuid.uuid4().hex[:12]}",
                         strict=True)
    record = prepare(request, registry)
    mem = MemoryRuns(on_event)
    mem.record(record)
    _drive(mem, registry, record.id, answer, on_note or (lambda text: None),
           limits or Limits.from_env())
    view = mem.get(record.id)
    assert view is not None
    return DryRun(view, mem)


def _drive(mem: MemoryRuns, registry: Registry, run_id: str, answer: Answerer | None,
           note: Callable[[str], None], limits: Limits) -> None:
    """Deliver the run until it settles, doing in between what the controller, a person
    and child runs would: answer questions, fire timers, execute children."""
    runs = cast(RunStore, mem)  # the calls the executor makes, in memory
    waits = mem.waits()
    for _ in range(10_000):  # a guard against a workflow that never stops waiting
        run = mem.runs[run_id]
        execute(runs, registry, run_id, run.attempt, worker=DRY_WORKER, lease_ms=DRY_LEASE_MS,
                hard_exit=False, limits=limits, deliver=None)
        run = mem.runs[run_id]
        if run.status in TERMINAL:
            return
        if run.status == "queued":  # a finished child woke it already
            continue
        if run.status != "waiting":
            raise MarblesError(f"dry run: run {run_id} stopped while {run.status}")
        what = run.wait_for or {}
        cause = run.wait_reason or "?"
        if run.wait_reason == "question":
            for question in waits.questions(run_id):
                if question.state != "open":
                    continue
                value = None if answer is None else answer(question)
                if value is None:
                    mem.cancel(run_id, f"question {question.key!r} was asked and stdin is "
                                       f"not a terminal to answer it")
                    return
                waits.answer(run_id, question.key, value)
            cause = "answer"
        elif run.wait_reason == "timer":
            due = int(what.get("until_ms") or 0)
            note(f"timer due {_iso(due)}: a dry run does not wait, its clock jumps there")
            mem.advance_to(due)
        elif run.wait_reason == "child":
            for cid in what.get("children") or []:
                child = mem.runs.get(cid)
                if child is not None and child.status not in TERMINAL:
                    _drive(mem, registry, cid, answer, note, limits)
        else:
            mem.cancel(run_id, f"dry run: cannot wait for {run.wait_reason}")
            return
        if mem.runs[run_id].status == "waiting":
            waits.wake(run_id, cause)
    mem.cancel(run_id, "dry run: too many deliveries")


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


__all__ = ["DryRun", "MemoryRuns", "MemoryWaits", "dry_run"]
