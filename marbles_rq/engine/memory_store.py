"""Runs kept in process memory, on a virtual clock: the calls the real executor
(engine/execute.py) makes of RunStore and WaitStore, with the outcomes the Lua scripts give,
and the calls from outside (answers, signals, events, pause, cancel) that a client makes.
The in-memory engine (engine/memory_engine.py) drives deliveries over it; the dry run
(engine/dryrun.py) and the test kit (marbles_rq/testing) both use that engine.

One lock makes each call atomic. Nothing runs concurrently with the caller between
deliveries, so a run is never cancelled or paused while it executes: what the scripts say
about a run fenced, cancelled or paused mid-execution does not arise here.

The clock (`VirtualClock`) moves only when told to (`advance_to`): a delivery takes no time
on it, and every time the engine reads for a run (timers, timeouts, ledger stamps) is the
clock's, through `Execution.clock`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from ..errors import MarblesError, RunSettledError
from ..store.keys import Keyspace
from ..store.records import (
    AskRecord,
    ErrorInfo,
    ReportRecord,
    RunRecord,
    StepRecord,
    ledger_order,
)
from .execution import Execution, HeldCommit, RunNotFoundError, stamp, take_due_starts
from .runs import TERMINAL, TIMEOUT_ERROR, OutputEvent, Recorded, RunView, Started, cancel_marker
from .waits import Question

if TYPE_CHECKING:
    from ..flow.lock_store import MemoryLocks
    from ..flow.rate_store import MemoryRates

MEMORY_WORKER = "memory"


class VirtualClock:
    """Epoch milliseconds that move only by `advance_to` (never backwards)."""

    def __init__(self, start_ms: int | None = None) -> None:
        self._ms = int(time.time() * 1000) if start_ms is None else int(start_ms)
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        return self._ms

    def advance_to(self, at_ms: int) -> None:
        with self._lock:
            self._ms = max(self._ms, int(at_ms))


class Crashed(BaseException):
    """An injected crash (the test kit's `crash_after`): the execution stops as a kill -9
    would, with nothing settled; the run is delivered again. A BaseException, so neither a
    step's retries nor the executor's handlers take it for the body's failure."""

    def __init__(self, key: str) -> None:
        super().__init__(f"crash injected after {key}")
        self.key = key


@dataclass
class _Ask:
    record: AskRecord
    asked_ms: int
    timeout_at_ms: int | None = None
    state: str = "open"  # open | answered | timed_out | cancelled
    answer: Any = None
    answered_ms: int | None = None


@dataclass
class _Signals:
    payloads: list[bytes] = field(default_factory=list)  # seq n is payloads[n - 1]
    at_ms: list[int] = field(default_factory=list)
    taken: int = 0


@dataclass
class _Run:
    record: RunRecord
    created_ms: int
    status: str = "queued"
    attempt: int = 1  # the delivery number
    tries: int = 1  # 1 + redeliveries
    resumptions: int = 0
    epoch: int = 0
    kind: str = "first"  # what the next execution is: first | resumption | redelivery
    queued_ms: int = 0  # when it was queued last: the engine delivers the oldest first
    deadline_ms: int = 0
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
    signals: dict[str, _Signals] = field(default_factory=dict)
    published: dict[str, Any] = field(default_factory=dict)
    wait_reason: str | None = None
    wait_for: dict[str, Any] | None = None
    wait_since_ms: int | None = None
    wake_at_ms: int = 0  # when its wait ends by itself (a timer, a timeout; 0: never)
    paused: bool = False
    # wait key -> {since, due} of its open event waits (engine/event_waits.py), and the
    # events it consumed (at most once each).
    event_waits: dict[str, dict[str, Any]] = field(default_factory=dict)
    consumed: set[str] = field(default_factory=set)


class MemoryRuns:
    """RunStore's executor-facing calls, in memory (see the module's note)."""

    def __init__(self, clock: VirtualClock | None = None,
                 on_event: Callable[[str, OutputEvent], None] | None = None) -> None:
        self.keys = Keyspace()
        self.clock = clock or VirtualClock()
        self.worker = MEMORY_WORKER  # the name `status` shows its runs executed on
        self.runs: dict[str, _Run] = {}
        self.on_event = on_event
        # A test's injected crash: the ledger key after whose commit an execution stops.
        self.crash_after: set[str] = set()
        # The test kit's overrides of step bodies, for every execution (engine/execute.py).
        self.override_step: Callable[[str, Any], Any] | None = None
        self.events: list[tuple[Any, Any]] = []  # (EventRecord, payload) received, in order
        self._lock = threading.RLock()
        self._seq = 0

    def now_ms(self) -> int:
        return self.clock.now_ms()

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
            now = self.now_ms()
            run = self.runs[record.id] = _Run(record, now, queued_ms=max(
                now, record.not_before_ms))
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
            now = self.now_ms()
            if run.deadline_ms and now > run.deadline_ms:
                timed_out = True
            else:
                timed_out = False
                run.status, run.epoch = "running", run.epoch + 1
                run.wait_reason = run.wait_for = run.wait_since_ms = None
                run.wake_at_ms = 0
                run.started_ms = run.started_ms or now
                if not run.deadline_ms and run.record.timeout_s > 0:
                    run.deadline_ms = now + int(run.record.timeout_s * 1000)
                ex = Execution(run_id, attempt, run.epoch, self.keys.run_keys(run_id), ttl_ms,
                               run.record, 0, dict(run.ledger), server_ms=now,
                               mono_at_start=time.monotonic(), tries=run.tries,
                               resumptions=run.resumptions, kind=run.kind)
                ex.clock = self.clock.now_ms
                ex.override_step = self.override_step
        if timed_out:
            self.time_out(run_id)
            return Started("timed_out")
        self._emit(run, "attempt_started", {"worker": worker, "epoch": ex.epoch,
                                            "attempt": ex.tries,
                                            "resumptions": run.resumptions, "kind": ex.kind})
        return Started("ok", ex)

    def _committed(self, run: _Run, record: StepRecord) -> None:
        """After a ledger entry is in: an injected crash stops the execution here."""
        if record.key in self.crash_after and record.status not in ("running", "waiting",
                                                                   "parked"):
            self.crash_after.discard(record.key)
            raise Crashed(record.key)

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
            self._emit(run, "step_started", {"step": record.key, "attempt": record.attempts,
                                             **({"started_ms": ex.admitted_ms}
                                                if ex.admitted_ms else {})})
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
            if event_type == "published":  # engine/published.py: its value, for get()
                decoded = msgspec.json.decode(data)
                run.published[str(decoded["key"])] = decoded.get("value")
            self._emit_raw(run, event_type, data)
            ex.flags_at = time.monotonic()
        self._committed(run, record)
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
        return self._settle(ex.run_id, status, result=result, error=error)

    def _settle(self, run_id: str, status: str, *, result: bytes | None = None,
                error: ErrorInfo | None = None, reason: str | None = None) -> str:
        with self._lock:
            run = self.runs[run_id]
            if run.status in TERMINAL:
                return "settled"
            run.status, run.result, run.error = status, result, error
            run.finished_ms = self.now_ms()
            run.wake_at_ms = 0
            for ask in run.asks.values():
                if ask.state == "open":
                    ask.state = "cancelled"
        data: dict[str, Any] = {"status": status}
        if result is not None:
            data["result"] = msgspec.json.decode(result)
        if error is not None:
            data["error"] = msgspec.structs.asdict(error)
        if reason is not None:
            data["reason"] = reason
        self._emit(run, "final", data)
        return "ok"

    def time_out(self, run_id: str) -> str:
        """The run passed its deadline (its workflow's timeout_s): failed, as the scripts
        settle it."""
        return self._settle(run_id, "failed", error=TIMEOUT_ERROR)

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
        raise MarblesError(f"in memory: {note}")  # the workflow is checked before it starts

    def fail_corrupt(self, run_id: str, reason: str) -> str:
        raise MarblesError(f"in memory: {reason}")

    def crashed(self, run_id: str, cause: BaseException | None = None) -> None:
        """An execution stopped as a kill -9 stops it: its lease expires and the run is
        delivered again (a redelivery, which replays the ledger), or fails once it has had
        its workflow's max_deliveries, as the controller's reaper gives up (lua/reap_run.lua).
        `cause`: what escaped the executor, named in that failure."""
        with self._lock:
            run = self.runs[run_id]
            if run.status != "running":
                return
            if run.tries >= run.record.max_deliveries:
                last = "" if cause is None else (f" (the last was stopped by "
                                                 f"{type(cause).__name__}: {cause})")
                error = ErrorInfo(type="DeliveriesExhausted",
                                  message=f"the run's executions kept vanishing; gave up "
                                          f"after {run.tries} deliveries{last}")
            else:
                error = None
        if error is not None:
            self._settle(run_id, "failed", error=error)
            return
        with self._lock:
            run.status, run.attempt, run.tries = "queued", run.attempt + 1, run.tries + 1
            run.kind, run.queued_ms = "redelivery", self.now_ms()

    # -- signals (engine/signal_waits.py reads and takes them through these) -------------

    def read_buffered(self, run_id: str, name: str, limit: int | None = None) -> Any:
        from .signals import Buffered

        with self._lock:
            box = self.runs[run_id].signals.get(name) or _Signals()
            last = len(box.payloads) if limit is None else min(len(box.payloads),
                                                                box.taken + limit)
            return Buffered(box.taken, len(box.payloads), box.payloads[box.taken:last],
                            box.at_ms[box.taken:last])

    def take_signal(self, ex: Execution, name: str, taken: int, count: int,
                    record: StepRecord, event: dict[str, Any]) -> str:
        with ex.lock:
            self.write_starts_locked(ex)
            with self._lock:
                run = self._run(ex)
                box = run.signals.setdefault(name, _Signals())
                if box.taken != taken:
                    return "conflict"
                box.taken += count
                ex.seq += 1
                run.ledger[record.key] = stamp(record, ex)
        self._emit(run, "signal_taken" if count or not event.get("timed_out") else
                   "signal_timed_out", event)
        self._committed(run, record)
        return "ok"

    def send_signal(self, run_id: str, name: str, payload: bytes) -> tuple[int, bool]:
        """Append a signal; (its number among the name's, whether it woke the run)."""
        with self._lock:
            run = self.runs.get(run_id)
            if run is None:
                raise RunNotFoundError(f"no run with id {run_id!r}")
            if run.status in TERMINAL:
                raise RunSettledError(f"run {run_id} has already finished ({run.status}); "
                                      f"signal {name!r} not recorded")
            box = run.signals.setdefault(name, _Signals())
            box.payloads.append(payload)
            box.at_ms.append(self.now_ms())
            seq = len(box.payloads)
            waits_for = run.status == "waiting" and not run.paused and name in (
                (run.wait_for or {}).get("signals") or [])
        self._emit(run, "signal", {"name": name, "seq": seq})
        woken = waits_for and self.waits().wake(run_id, "signal")[0] == "woken"
        return seq, woken

    # -- events (engine/event_waits.py, with the same matching rules) --------------------

    def event_wait(self, run: Any, spec: dict[str, Any], wait: dict[str, Any],
                   timeout_s: float | None, lookback_ms: int) -> Any:
        """`wait_for_event` for a run in memory: the matching event received within the
        lookback or since the wait opened (recorded at the wait's position), the timeout's
        EventWaitTimeoutError once it is due, else the run parks."""
        from .event_waits import _ended, matches, received
        from .waiting import ParkRun, Wait

        ex, wait_key, seq = run.ex, str(spec["key"]), int(spec["seq"])
        with self._lock:
            mine = self.runs[ex.run_id]
            now = self.now_ms()
            state = mine.event_waits.setdefault(wait_key, {
                "since": now, "due": now + int(timeout_s * 1000) if timeout_s else 0,
                "spec": spec})
            due = int(state["due"])
            found = None
            if not (due and now >= due):
                for event, payload in self.events:
                    if (event.received_at_ms >= int(state["since"]) - lookback_ms
                            and event.id not in mine.consumed
                            and matches(spec, event.source, event.type, payload)):
                        found = (event, payload)
                        mine.consumed.add(event.id)
                        break
            if found is not None or (due and now >= due):
                del mine.event_waits[wait_key]
        if found is not None:
            got = received(*found)
            run.commit_entry(StepRecord(
                version=1, key=wait_key, name="|event", status="received", attempts=0,
                result=msgspec.Raw(msgspec.json.encode(got)), at_ms=now, seq=seq),
                "event_received", {"wait": wait_key, "event": got.key,
                                   "source": got.source, "type": got.type})
            return got
        if due and now >= due:
            record = StepRecord(version=1, key=wait_key, name="|event", status="timed_out",
                                attempts=0, result=msgspec.Raw(msgspec.json.encode(wait)),
                                at_ms=now, seq=seq)
            run.commit_entry(record, "event_wait_timed_out", {"wait": wait_key, **wait})
            return _ended(record)
        raise ParkRun([Wait("event", wake_at_ms=due, until_ms=due, events=[wait])])

    def offer_event(self, event: Any, payload: Any) -> dict[str, str]:
        """Keep an event for later waits' lookback and deliver it to every open wait it
        matches (each run takes it once): {run id: woken | pending}."""
        from .event_waits import matches, received

        outcomes: dict[str, str] = {}
        woken: list[str] = []
        with self._lock:
            self.events.append((event, payload))
            got = received(event, payload)
            for run_id, run in self.runs.items():
                if run.status in TERMINAL or event.id in run.consumed:
                    continue
                for wait_key, state in list(run.event_waits.items()):
                    spec = state["spec"]
                    if not matches(spec, event.source, event.type, payload):
                        continue
                    run.consumed.add(event.id)
                    del run.event_waits[wait_key]
                    run.ledger[wait_key] = StepRecord(
                        version=1, key=wait_key, name="|event", status="received",
                        attempts=0, result=msgspec.Raw(msgspec.json.encode(got)),
                        at_ms=self.now_ms(), seq=int(spec.get("seq", -1)))
                    outcomes[run_id] = "pending"
                    if run.status == "waiting":
                        woken.append(run_id)
                    break
        for run_id in woken:
            if self.waits().wake(run_id, "event", detail={"event": event.id})[0] == "woken":
                outcomes[run_id] = "woken"
        return outcomes

    # -- operating ------------------------------------------------------------------------

    def cancel(self, run_id: str, reason: str = "cancelled by request") -> str:
        with self._lock:
            run = self.runs.get(run_id)
            if run is None:
                return "missing"
            if run.status in TERMINAL:
                return "settled"
            if run.status == "running":
                return "requested"  # not reached: nothing runs beside the caller
        self._settle(run_id, "cancelled", reason=reason)
        return "cancelled"

    def cancel_compensate(self, run_id: str, reason: str = "cancelled by request, with "
                          "compensation") -> tuple[str, int, str]:
        """As RunStore.cancel_compensate (lua/cancel_compensate.lua); nothing runs beside
        the caller, so a run is never running here."""
        with self._lock:
            run = self.runs.get(run_id)
            if run is None:
                return "missing", 0, ""
            if run.status in TERMINAL:
                return "settled", 0, ""
            current = run.ledger.get(cancel_marker().key)
            if current is not None:  # compensating already: how it ends is decided
                return "compensating", 0, current.status
            started = run.epoch > 0
            if started:
                run.ledger.setdefault(cancel_marker().key, cancel_marker())
                run.paused = False
                for ask in run.asks.values():
                    if ask.state == "open":
                        ask.state = "cancelled"
                woken = run.status == "waiting"
                if woken:
                    run.status, run.attempt = "queued", run.attempt + 1
                    run.kind, run.queued_ms, run.wake_at_ms = "resumption", self.now_ms(), 0
                    run.event_waits.clear()
        if not started:
            self._settle(run_id, "cancelled", reason=reason)
            return "cancelled", 0, ""
        self._emit(run, "compensating", {"status": "cancelled", "reason": reason,
                                         "compensate": True})
        return ("woken", run.attempt, run.record.queue) if woken else ("queued", 0, "")

    def hand_over_compensation(self, ex: Execution) -> tuple[str, int, str]:
        return "plain", 0, ""  # not reached: a run here is never cancelled while running

    # -- reading --------------------------------------------------------------------------

    def rates(self) -> MemoryRates:
        rates = self.__dict__.get("_rates")
        if rates is None:
            from ..flow.rate_store import MemoryRates

            rates = self.__dict__["_rates"] = MemoryRates(self.clock.now_ms)
        return rates

    def locks(self) -> MemoryLocks:
        locks = self.__dict__.get("_locks")
        if locks is None:
            from ..flow.lock_store import MemoryLocks

            def status_of(run_id: str) -> str | None:
                run = self.runs.get(run_id)
                return None if run is None else run.status

            locks = self.__dict__["_locks"] = MemoryLocks(self.clock.now_ms, status_of)
        return locks

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
        return RunView(record=run.record, status=run.status, attempt=run.tries,
                       delivery=run.attempt, resumptions=run.resumptions,
                       epoch=run.epoch, created_ms=run.created_ms, started_ms=run.started_ms,
                       finished_ms=run.finished_ms,
                       result=None if run.result is None else msgspec.Raw(run.result),
                       error=run.error, worker=self.worker, cancel_requested=False,
                       steps=ledger, wait_reason=run.wait_reason, wait_for=run.wait_for,
                       wait_since_ms=run.wait_since_ms)


class MemoryWaits:
    """WaitStore's calls for runs in memory."""

    def __init__(self, runs: MemoryRuns) -> None:
        self.runs = runs

    def park(self, ex: Execution, *, reason: str, wake_at_ms: int, wait_for: dict[str, Any],
             ledger: list[StepRecord], asks: list[AskRecord], notice: bytes = b""
             ) -> tuple[str, int, str]:
        # `notice`: pause notifications are a controller's (controller/notices.py); runs in
        # memory send none.
        mem = self.runs
        with ex.lock:
            mem.write_starts_locked(ex)
            with mem._lock:
                run = mem._run(ex)
                now = mem.now_ms()
                for i, entry in enumerate(ledger):
                    run.ledger[entry.key] = stamp(entry, ex, i + 1)
                for ask in asks:
                    run.asks.setdefault(ask.key, _Ask(ask, now, now + int(
                        ask.timeout_s * 1000) if ask.timeout_s else None))
                # A signal it parks for that came meanwhile: delivered again at once.
                has_signal = any(
                    len((box := run.signals.get(n) or _Signals()).payloads) > box.taken
                    for n in wait_for.get("signals") or [])
                if has_signal:
                    run.status, run.attempt = "queued", run.attempt + 1
                    run.resumptions += 1
                    run.kind, run.queued_ms = "resumption", now
                    return "requeued", run.attempt, run.record.queue
                run.status, run.wait_reason, run.wait_for = "waiting", reason, wait_for
                run.wait_since_ms = now
                # A wait only for children ends when one settles (it wakes its parent), not
                # at the controller's periodic check of them.
                only_children = set(wait_for) <= {"children"}
                timeouts = [a.timeout_at_ms for a in run.asks.values()
                            if a.state == "open" and a.timeout_at_ms]
                wakes = ([] if only_children or not wake_at_ms else [wake_at_ms]) + timeouts
                run.wake_at_ms = min(wakes, default=0)
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
            if run.paused:
                return "paused", 0, ""
            if cause == "child" and "children" not in (run.wait_for or {}):
                return "idle", 0, ""  # as wake_run: a child wakes only a run waiting for one
            if cause == "timer":
                now = mem.now_ms()
                if run.wake_at_ms > now or not run.wake_at_ms:
                    return "not_due", run.wake_at_ms, ""
                for ask in run.asks.values():  # questions past their timeout close first
                    if ask.state == "open" and ask.timeout_at_ms and ask.timeout_at_ms <= now:
                        ask.state, ask.answered_ms = "timed_out", now
            run.status, run.attempt = "queued", run.attempt + 1
            run.resumptions += 1
            run.kind, run.queued_ms, run.wake_at_ms = "resumption", mem.now_ms(), 0
        mem._emit(run, "woken", {"cause": cause, **(detail or {})})
        return "woken", run.attempt, run.record.queue

    def questions(self, run_id: str) -> list[Question]:
        run = self.runs.runs.get(run_id)
        if run is None:
            return []
        return [Question(run_id, a.record, a.state, "0", a.asked_ms, a.answer, a.answered_ms,
                         a.timeout_at_ms)
                for a in sorted(run.asks.values(), key=lambda a: (a.asked_ms, a.record.key))]

    def answer(self, run_id: str, key: str, value: Any) -> str:
        """Record an answer to an open question and wake the run: woken | open (the run is
        not waiting for it now: it sees it when it replays)."""
        mem = self.runs
        with mem._lock:
            run = mem.runs[run_id]
            ask = run.asks[key]
            ask.state, ask.answer, ask.answered_ms = "answered", value, mem.now_ms()
        mem._emit(run, "answered", {"key": key, "answer": value})
        return self.wake(run_id, "answer")[0]

    def pause(self, run_id: str) -> str:
        """paused | already | settled (as the client's pause)."""
        mem = self.runs
        with mem._lock:
            run = mem.runs.get(run_id)
            if run is None:
                raise RunNotFoundError(f"no run with id {run_id!r}")
            if run.status in TERMINAL:
                return "settled"
            if run.paused:
                return "already"
            run.paused = True
            if run.status == "queued":
                run.status, run.wait_reason, run.wait_for = "waiting", "paused", {}
                run.wait_since_ms, run.wake_at_ms = mem.now_ms(), 0
            elif run.status == "waiting":
                run.wait_reason = "paused"
        mem._emit(run, "paused", {"reason": "paused by request"})
        return "paused"

    def resume(self, run_id: str) -> str:
        """woken | not_paused | settled."""
        mem = self.runs
        with mem._lock:
            run = mem.runs.get(run_id)
            if run is None:
                raise RunNotFoundError(f"no run with id {run_id!r}")
            if run.status in TERMINAL:
                return "settled"
            if not run.paused:
                return "not_paused"
            run.paused = False
        mem._emit(run, "resumed", {"reason": "resumed by request"})
        return self.wake(run_id, "resume")[0]

    def resolve_step(self, run_id: str, key: str, expected: StepRecord, entry: StepRecord,
                     action: str, event: dict[str, Any]) -> tuple[str, int, str]:
        """As WaitStore.resolve_step (lua/resolve_step.lua)."""
        mem = self.runs
        with mem._lock:
            run = mem.runs.get(run_id)
            if run is None:
                return "missing", 0, ""
            if run.status in TERMINAL:
                return "settled", 0, ""
            if run.status != "waiting":
                return "not_waiting", 0, ""
            if run.ledger.get(key) != expected:
                return "conflict", 0, ""
            run.ledger[key] = msgspec.structs.replace(entry, epoch=run.epoch, wseq=0)
            run.paused = False
            run.wait_reason, run.wait_for, run.wake_at_ms = None, None, 0
            run.status, run.attempt = "queued", run.attempt + 1
            run.resumptions += 1
            run.kind, run.queued_ms = "resumption", mem.now_ms()
        mem._emit(run, "step_retried" if action == "retry" else "step_given_up", event)
        mem._emit(run, "woken", {"cause": action})
        return "woken", run.attempt, run.record.queue

    def failed_steps(self, limit: int = 100) -> list[str]:
        return [rid for rid, run in self.runs.runs.items() if run.status == "waiting"
                and (run.wait_for or {}).get("step") and any(
                    r.status == "exhausted" for r in run.ledger.values())][:limit]

    def cancel_children(self, run_id: str) -> list[str]:
        out = []
        for cid, run in list(self.runs.runs.items()):
            if run.record.parent == run_id and self.runs.cancel(
                    cid, "its parent was cancelled") == "cancelled":
                out.append(cid)
                out += self.cancel_children(cid)
        return out


__all__ = ["Crashed", "MemoryRuns", "MemoryWaits", "VirtualClock"]
