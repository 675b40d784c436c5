"""Schedules: declared in Python beside the workflows, fired by the elected controller.

    @mr.schedule(every="30s")
    @mr.workflow()
    def sync(ctx): ...

    @mr.schedule(cron="0 9 * * MON-FRI", tz="Europe/Berlin", input={"team": "ops"})
    @mr.schedule(at={"weekday": ["mon", "fri"], "hour": 9, "minute": 30})
    mr.schedule(every="10m", workflow="report")      # a workflow declared elsewhere

An occurrence is ``<schedule key>@<nominal ms>``; its run id is ``sched:<key>:<nominal ms>``.
The controller claims it and moves the schedule's cursor past it in one script in the
schedule's slot (fenced by the controller epoch), then records the run under the derived id
(idempotent), then marks the occurrence started. A crash anywhere leaves either nothing (the
slot comes due again) or a claimed occurrence that recovery starts, under the same run id: an
occurrence never produces two runs.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from .. import metrics
from ..engine.authoring import REGISTRY, Registry
from ..engine.ops import RunRequest, enqueue_many, owned_by, prepare
from ..engine.runs import TERMINAL, RunStore
from ..errors import MarblesError
from ..store.redis_errors import is_outage, one_line
from ..store.replies import as_text, server_ms
from ..store.scripts import Reply
from ..transport.lanes import RQLike
from .schedule_spec import (
    KEY_PATTERN,
    SCHEDULES,
    ScheduleDef,
    ScheduleRegistry,
    UnknownScheduleError,
    as_int,
    derive_key,
    local_zone,
    next_slot,
    run_id_of,
    schedule,
    slots_after,
)
from .schedule_views import ScheduleView, decoded, list_schedules, registered_keys, set_paused

if TYPE_CHECKING:
    from ..controller.context import DutyContext

log = logging.getLogger("marbles_rq.triggers.schedules")

POLL_MS = 1_000           # how soon a schedule waiting on a running run is looked at again
DUE_BATCH = 1_000         # due schedules read per bucket per pass
OPEN_AFTER_MS = 5_000     # a claimed occurrence not started by then is started by the tick
LOCK_TTL_MS = 60_000
MIN_WAIT_MS = 5           # the firing thread takes due schedules in batches at least this far apart


# -- firing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RollResult:
    key: str
    status: str  # fired | skipped
    run_id: str | None = None
    holder: str | None = None  # who held the lock, when skipped

    def __str__(self) -> str:
        if self.status == "skipped":
            return f"[schedule] {self.key} skipped: held by {self.holder}"
        return f"[schedule] {self.key} fired run {self.run_id}"


def roll_schedule(runs: RunStore, rq: RQLike, key: str, *,
                  registry: ScheduleRegistry | None = None, holder: str | None = None,
                  workflows: Registry = REGISTRY) -> RollResult:
    """One forced tick of schedule `key` under its lock: claim an occurrence at the server's
    now (the cursor does not move), record its run, mark it started, release the lock. When
    another holder has the lock, nothing is written: status "skipped" with `holder`."""
    registry = registry if registry is not None else SCHEDULES
    definition = registry.get(key)
    holder = holder or f"roll:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    keys = runs.keys.schedule_keys(key)
    taken = runs.scripts.lock_schedule(keys=keys, holder=holder, ttl_ms=LOCK_TTL_MS)
    if taken.status == "held":
        return RollResult(key, "skipped", holder=as_text(taken.values[0]))
    try:
        now_ms = server_ms(runs.client)
        occ_id = definition.occurrence_id(now_ms)
        reply = runs.scripts.claim_occurrences([dict(
            keys=keys, occurrence_key=runs.keys.occurrence(key, occ_id), key=key,
            ctl_epoch=None, expected="", nominal_ms=now_ms, occurrence_id=occ_id,
            run_id=definition.run_id(now_ms), cursor="", due_ms="", holder=holder)])[0]
        if reply.status == "missing":
            raise UnknownScheduleError(f"schedule {key!r} is not registered yet: start a "
                                       f"controller with this --source first")
        if reply.status == "locked":
            return RollResult(key, "skipped", holder=as_text(reply.values[0]))
        if reply.status != "ok":
            raise MarblesError(f"schedule {key!r}: could not claim an occurrence "
                               f"({reply.status})")
        run_id = definition.run_id(now_ms)
        request = RunRequest(definition.workflow, definition.input_for(workflows), run_id,
                             origin="schedule")
        if _foreign(enqueue_many(runs, rq, [request], workflows), [request], workflows):
            raise MarblesError(f"schedule {key!r}: run id {run_id} is taken by a run this "
                               f"schedule did not start; the occurrence did not run")
        runs.scripts.start_occurrences([(keys, runs.keys.occurrence(key, occ_id), occ_id,
                                         None)])
        return RollResult(key, "fired", run_id=run_id)
    finally:
        runs.scripts.lock_schedule(keys=keys, holder=holder, ttl_ms=0)


@dataclass
class _Fire:
    definition: ScheduleDef
    nominal_ms: int
    expected: str
    cursor: str
    due_ms: str
    from_buffer: bool = False
    finish: tuple[str, int, str] | None = None


@dataclass
class _Move:
    definition: ScheduleDef
    expected: str
    cursor: int
    due_ms: int
    buffered: str = ""
    skipped: bool = False
    finish: tuple[str, int, str] | None = None


@dataclass
class ScheduleStats:
    fired: int = 0
    skipped: int = 0
    recovered: int = 0
    lateness_ms: list[int] = field(default_factory=list)  # kept only when `measure` is set
    pass_ms: list[float] = field(default_factory=list)  # firing passes, when `measure` is set
    pass_handled: list[int] = field(default_factory=list)  # occurrences fired or skipped


class ScheduleDuty:
    """The controller's schedules duty. Each pass reads, per bucket, the schedules whose due
    time passed (a sorted set per bucket), and costs what is due, not what exists."""

    kind = "schedules"

    def __init__(self, registry: ScheduleRegistry | None = None,
                 workflows: Registry = REGISTRY, *, measure: bool = False,
                 threaded: bool = True) -> None:
        self.registry = registry if registry is not None else SCHEDULES
        self.workflows = workflows
        self.stats = ScheduleStats()
        self.measure = measure
        self.threaded = threaded
        self._registered_epoch = 0
        self._thread: threading.Thread | None = None
        self._thread_epoch = 0
        self._open_checked = 0.0
        self._left_claimed: set[str] = set()  # warned about once

    # -- registration and recovery ---------------------------------------------------------

    def recover(self, ctl: DutyContext) -> int:
        """Register every declared schedule and retire the registered ones the source no
        longer declares (orphaned); they resume from their stored cursors. Returns how many
        are declared here."""
        self.register(ctl)
        return len(self.registry.schedules)

    def register(self, ctl: DutyContext) -> None:
        keys = ctl.keys
        epoch = ctl.epoch
        declared = {}
        for key, definition in sorted(self.registry.schedules.items()):
            if keys.bucket_of(key) not in ctl.buckets:
                continue  # another lane's: its controller registers it
            problem = self._problem(definition)
            if problem is not None:
                log.error("schedule %s: %s; it does not fire", key, problem)
                continue
            declared[key] = definition
        pipe = ctl.store.client.pipeline(transaction=False)
        for key in declared:
            pipe.hgetall(keys.schedule(key))
        states = pipe.execute(raise_on_error=False)
        now_ms = ctl.server_ms()
        for (key, definition), raw in zip(declared.items(), states, strict=True):
            if isinstance(raw, Exception):  # one broken schedule costs only itself
                if is_outage(raw):
                    raise raw
                log.warning("schedule %s: unreadable state at %s (%s); it does not fire",
                            key, keys.schedule(key), one_line(raw))
                continue
            state = decoded(raw)
            cursor = definition.first_cursor(now_ms, state)
            reply = ctl.runs.scripts.register_schedule(
                keys=keys.schedule_keys(key), key=key, ctl_epoch=epoch,
                fingerprint=definition.fingerprint, kind=definition.kind,
                label=definition.label, workflow=definition.workflow, cursor=cursor,
                every_ms=definition.every_ms)
            if self._fenced(ctl, reply):
                return
            if reply.status != "same":
                log.info("schedule %s (%s -> %s): %s", key, definition.label,
                         definition.workflow, reply.status)
        for key in registered_keys(ctl.runs, ctl.buckets):
            if key not in declared:
                reply = ctl.runs.scripts.retire_schedule(keys=keys.schedule_keys(key), key=key,
                                                         ctl_epoch=epoch)
                if self._fenced(ctl, reply):
                    return
                log.info("schedule %s is no longer declared: orphaned, it never fires", key)
        self._registered_epoch = epoch

    def _problem(self, definition: ScheduleDef) -> str | None:
        """Why a declared schedule cannot fire here (its workflow is not loaded, or its
        input does not fit it: a `workflow="name"` declaration is only checked here, where
        every module is loaded), or None."""
        if definition.workflow not in self.workflows.workflows:
            return f"workflow {definition.workflow!r} is not declared by --source"
        try:
            self.workflows.workflow(definition.workflow).parse_input(
                definition.input_for(self.workflows))
        except MarblesError as exc:
            return str(exc)
        return None

    def start_open(self, ctl: DutyContext, older_than_ms: int) -> int:
        """Start the occurrences claimed (their cursor moved on) but never started."""
        keys = ctl.keys
        cutoff = ctl.server_ms() - older_than_ms
        occ_ids = [occ_id for _, occ_id, _ in ctl.due_scored(keys.occurrences_open, cutoff,
                                                             DUE_BATCH)]
        if not occ_ids:
            return 0
        pipe = ctl.store.client.pipeline(transaction=False)
        for occ_id in occ_ids:
            key = occ_id.rsplit("@", 1)[0]
            pipe.hmget(keys.occurrence(key, occ_id), "key", "nominal_ms", "run_id")
        requests, started = [], []
        for occ_id, (key, _nominal, run_id) in zip(occ_ids, pipe.execute(), strict=True):
            key_s = occ_id.rsplit("@", 1)[0]
            schedule_keys = keys.schedule_keys(key_s)
            if key is None or run_id is None:
                started.append((schedule_keys, keys.occurrence(key_s, occ_id), occ_id,
                                ctl.epoch))
                continue
            definition = self.registry.schedules.get(key_s)
            if definition is None or self._problem(definition) is not None:
                if occ_id not in self._left_claimed:
                    self._left_claimed.add(occ_id)
                    log.warning("occurrence %s: its schedule cannot fire here; left claimed",
                                occ_id)
                continue
            requests.append(RunRequest(definition.workflow,
                                       definition.input_for(self.workflows), as_text(run_id),
                                       origin="schedule"))
            started.append((schedule_keys, keys.occurrence(key_s, occ_id), occ_id, ctl.epoch))
            log.info("occurrence %s was claimed but not started; starting run %s", occ_id,
                     as_text(run_id))
        if requests:
            try:
                _foreign(enqueue_many(ctl.runs, ctl.rq, requests, self.workflows), requests,
                         self.workflows)
            except MarblesError as exc:  # validated above; left claimed, retried later
                log.error("starting claimed occurrences failed (%s); they stay claimed",
                          one_line(exc))
                return 0
        replies = ctl.runs.scripts.start_occurrences(started) if started else []
        for reply in replies:
            if self._fenced(ctl, reply):
                break
        self.stats.recovered += len(requests)
        return len(requests)

    def _fenced(self, ctl: DutyContext, reply: Reply) -> bool:
        if reply.status == "fenced":
            ctl.step_down(f"a newer controller (epoch {as_text(reply.values[0])}) acts on "
                          f"schedules")
            return True
        return False

    # -- one pass ------------------------------------------------------------------------------

    def tick(self, ctl: DutyContext) -> None:
        """Register the declared schedules once per leadership, then make sure the firing
        thread runs for this epoch (or, unthreaded, fire what is due now)."""
        if self._registered_epoch != ctl.epoch:
            self.register(ctl)
            if ctl.lease is None:
                return
        if not self.threaded:
            self.fire_due(ctl)
            return
        thread = self._thread
        if thread is None or not thread.is_alive() or self._thread_epoch != ctl.epoch:
            self._thread_epoch = ctl.epoch
            self._thread = threading.Thread(target=self._serve, args=(ctl, ctl.epoch),
                                            name="marbles-schedules", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """The controller stopped leading this lane (its stop event is set): wait for the
        thread to finish what it was doing, so the lease is released after its last write."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _serve(self, ctl: DutyContext, epoch: int) -> None:
        """Fire what is due, then sleep until the soonest due time (at most 1 s, at least
        5 ms so that due schedules are taken in batches), while this epoch leads. The pass
        interval of the controller does not bound lateness; every write is still fenced."""
        try:
            while ctl.leads(epoch):
                started = time.perf_counter()
                before = self.stats.fired + self.stats.skipped
                self.fire_due(ctl)
                if self.measure:
                    self.stats.pass_ms.append((time.perf_counter() - started) * 1000)
                    self.stats.pass_handled.append(self.stats.fired + self.stats.skipped
                                                   - before)
                soonest = ctl.soonest(ctl.keys.schedule_due)
                wait = POLL_MS if soonest is None else soonest - ctl.server_ms()
                ctl.stop_event.wait(min(POLL_MS, max(MIN_WAIT_MS, wait)) / 1000)
        except (redis.RedisError, MarblesError, OSError) as exc:
            log.error("schedules: %s; the next pass starts again", one_line(exc))

    def fire_due(self, ctl: DutyContext) -> None:
        """Fire (or move) every schedule whose due time passed: O(what is due)."""
        keys = ctl.keys
        now_ms = ctl.server_ms()
        due = [(key, score) for _, key, score in ctl.due_scored(keys.schedule_due, now_ms,
                                                                DUE_BATCH)]
        if time.monotonic() - self._open_checked >= OPEN_AFTER_MS / 1000:
            self._open_checked = time.monotonic()  # open claims: every few seconds
            self.start_open(ctl, OPEN_AFTER_MS)
        if not due:
            return
        declared = [(k, s) for k, s in due if k in self.registry.schedules
                    and self.registry.schedules[k].workflow in self.workflows.workflows]
        known = {k for k, _ in declared}
        for key, _ in due:
            if key not in known:  # orphaned (or registered by a controller with other sources)
                reply = ctl.runs.scripts.retire_schedule(keys=keys.schedule_keys(key), key=key,
                                                         ctl_epoch=ctl.epoch)
                if self._fenced(ctl, reply):
                    return
        if not declared:
            return
        pipe = ctl.store.client.pipeline(transaction=False)
        for key, _ in declared:
            pipe.hgetall(keys.schedule(key))
        raw_states = pipe.execute(raise_on_error=False)
        readable = []
        for (key, score), raw in zip(declared, raw_states, strict=True):
            if isinstance(raw, Exception):  # one broken schedule costs only itself
                if is_outage(raw):
                    raise raw
                if key not in self._left_claimed:
                    self._left_claimed.add(key)
                    log.warning("schedule %s: unreadable state at %s (%s); skipped", key,
                                keys.schedule(key), one_line(raw))
                continue
            readable.append(((key, score), decoded(raw)))
        declared = [d for d, _ in readable]
        states = [state for _, state in readable]
        pipe = ctl.store.client.pipeline(transaction=False)
        for state in states:
            last_run = state.get("last_run")
            if last_run:
                pipe.hmget(keys.run(last_run), "status", "finished_ms")
            else:
                pipe.echo("")
        previous = pipe.execute()
        fires: list[_Fire] = []
        moves: list[_Move] = []
        for (key, _), state, prev in zip(declared, states, previous, strict=True):
            definition = self.registry.schedules[key]
            action = decide(definition, state, _prev(state, prev), now_ms)
            if isinstance(action, _Fire):
                fires.append(action)
            elif isinstance(action, _Move):
                moves.append(action)
        if fires:  # first: a move is never urgent, a firing is
            self._fire(ctl, fires, now_ms)
        if moves and ctl.lease is not None:
            self._move(ctl, moves)

    def _move(self, ctl: DutyContext, moves: list[_Move]) -> None:
        keys = ctl.keys
        replies = ctl.runs.scripts.move_schedules([
            (keys.schedule_keys(m.definition.key), m.definition.key, ctl.epoch, m.expected,
             m.cursor, m.due_ms, m.buffered, m.skipped, m.finish) for m in moves])
        for move, reply in zip(moves, replies, strict=True):
            if self._fenced(ctl, reply):
                return
            if reply.status == "ok" and move.skipped:
                self.stats.skipped += 1
                log.info("schedule %s: slot skipped (%s)", move.definition.key,
                         "buffered" if move.buffered not in ("", "-") else
                         "overlap or outside the catch-up window")

    def _fire(self, ctl: DutyContext, fires: list[_Fire], now_ms: int) -> None:
        keys = ctl.keys
        calls = []
        for f in fires:
            key = f.definition.key
            occ_id = f.definition.occurrence_id(f.nominal_ms)
            calls.append(dict(
                keys=keys.schedule_keys(key), occurrence_key=keys.occurrence(key, occ_id),
                key=key, ctl_epoch=ctl.epoch, expected=f.expected, nominal_ms=f.nominal_ms,
                occurrence_id=occ_id, run_id=f.definition.run_id(f.nominal_ms),
                cursor=f.cursor, due_ms=f.due_ms, from_buffer=f.from_buffer,
                finish=f.finish))
        replies = ctl.runs.scripts.claim_occurrences(calls)
        claimed: list[_Fire] = []
        held: list[_Move] = []
        for f, reply in zip(fires, replies, strict=True):
            if self._fenced(ctl, reply):
                return
            if reply.status == "ok":
                claimed.append(f)
            elif reply.status == "locked":
                log.info("[schedule] %s skipped: held by %s", f.definition.key,
                         as_text(reply.values[0]))
                # Looked at again a poll later, not at every pass while the lock is held.
                cursor = int(f.expected)
                held.append(_Move(f.definition, f.expected, cursor, now_ms + POLL_MS))
            elif reply.status == "exists":
                log.warning("occurrence %s exists for run %s; not fired again",
                            f.definition.occurrence_id(f.nominal_ms), as_text(reply.values[0]))
        if held:
            self._move(ctl, held)
        if not claimed:
            return
        requests = [RunRequest(f.definition.workflow, f.definition.input_for(self.workflows),
                               f.definition.run_id(f.nominal_ms), origin="schedule")
                    for f in claimed]
        foreign = _foreign(enqueue_many(ctl.runs, ctl.rq, requests, self.workflows), requests,
                           self.workflows)
        started = []
        for f in claimed:
            key = f.definition.key
            occ_id = f.definition.occurrence_id(f.nominal_ms)
            started.append((keys.schedule_keys(key), keys.occurrence(key, occ_id), occ_id,
                            ctl.epoch))
        for reply in ctl.runs.scripts.start_occurrences(started):
            if self._fenced(ctl, reply):
                return
        self.stats.fired += len(claimed) - len(foreign)
        if self.measure or metrics.enabled():
            fired_ms = ctl.server_ms()
            late = [fired_ms - f.nominal_ms for f in claimed]
            if self.measure:
                self.stats.lateness_ms += late
            for f, ms in zip(claimed, late, strict=True):
                metrics.schedule_late(f.definition.workflow, ms / 1000)
        for f in claimed:
            if f.definition.run_id(f.nominal_ms) not in foreign:
                log.info("schedule %s: fired run %s", f.definition.key,
                         f.definition.run_id(f.nominal_ms))


def _foreign(results: list[Any], requests: list[RunRequest], workflows: Registry) -> set[str]:
    """The run ids among `requests` that were found taken by a run the schedule did not
    start (each logged as an error): those occurrences did not run, and are not reported
    as fired."""
    foreign = set()
    for enqueued, request in zip(results, requests, strict=True):
        if enqueued.created or owned_by(enqueued.record, "schedule",
                                        prepare(request, workflows)):
            continue
        foreign.add(enqueued.run_id)
        log.error("schedule occurrence run %s: the id is taken by a run this schedule did "
                  "not start (workflow %r, origin %s); the occurrence did not run",
                  enqueued.run_id, enqueued.record.name, enqueued.record.origin or "an enqueuer")
    return foreign


@dataclass(frozen=True)
class _Previous:
    run_id: str | None
    running: bool
    finished_ms: int | None
    status: str | None


def _prev(state: dict[str, str], raw: Any) -> _Previous:
    run_id = state.get("last_run")
    if not run_id or not isinstance(raw, list):
        return _Previous(None, False, None, None)
    status, finished = (as_text(x) if x is not None else None for x in raw)
    if status is None:  # pruned or never recorded: treat as finished at its start
        return _Previous(run_id, False, as_int(state.get("last_start")), None)
    return _Previous(run_id, status not in TERMINAL, as_int(finished), status)


def decide(definition: ScheduleDef, state: dict[str, str], prev: _Previous,
           now_ms: int) -> _Fire | _Move | None:
    """What one due schedule does now: fire an occurrence, or move its cursor."""
    cursor_s = state.get("cursor", "")
    cursor = as_int(cursor_s)
    if cursor is None or "registered_ms" not in state:
        return None
    finish = None
    if prev.run_id and not prev.running and state.get("fin_run") != prev.run_id \
            and prev.status is not None:
        finish = (prev.run_id, prev.finished_ms or 0, prev.status)
    recheck = now_ms + POLL_MS

    if definition.kind == "interval":
        every = definition.every_ms
        if prev.run_id is None or definition.overlap == "allow":
            real = cursor  # allow: counted from the previous occurrence's nominal time
        elif not prev.running:
            base = prev.finished_ms or as_int(state.get("last_finish")) or \
                as_int(state.get("last_start")) or now_ms
            real = base + every
        else:  # measured from completion: wait for it
            # Its completion is noticed within a quarter of the interval (at most 1 s).
            return _Move(definition, cursor_s, cursor, now_ms + min(POLL_MS, every // 4),
                         finish=finish)
        if real > now_ms:
            return _Move(definition, cursor_s, real, real, finish=finish)
        # Missed ticks never queue: an overdue interval fires once, at its due time, and the
        # one after it is an interval from now at the earliest.
        nxt = real + every if real + every > now_ms else now_ms + every
        return _Fire(definition, real, cursor_s, str(nxt), str(nxt), finish=finish)

    assert definition.tz is not None
    buffered = as_int(state.get("buffered"))
    if buffered is not None:
        if prev.running:
            return _Move(definition, cursor_s, cursor, min(recheck, cursor) if cursor > now_ms
                         else recheck, finish=finish)
        return _Fire(definition, buffered, cursor_s, cursor_s, str(min(cursor, now_ms)),
                     from_buffer=True, finish=finish)
    if cursor > now_ms:
        return _Move(definition, cursor_s, cursor, cursor, finish=finish)
    nxt = next_slot(definition.cron, definition.tz, now_ms)
    window = definition.catch_up_ms if definition.catch_up_ms is not None else \
        definition.period_at(nxt)
    latest = None
    for slot in slots_after(definition.cron, definition.tz, max(cursor - 1, now_ms - window)):
        if slot > now_ms:
            break
        latest = slot
    if latest is None:
        return _Move(definition, cursor_s, nxt, nxt, skipped=True, finish=finish)
    if prev.running and definition.overlap == "skip":
        return _Move(definition, cursor_s, nxt, nxt, skipped=True, finish=finish)
    if prev.running and definition.overlap == "buffer_one":
        return _Move(definition, cursor_s, nxt, min(nxt, recheck), buffered=str(latest),
                     skipped=True, finish=finish)
    return _Fire(definition, latest, cursor_s, str(nxt), str(nxt), finish=finish)


class OccurrenceDuty:
    """Recovery of occurrences claimed but never started (their cursor moved past them):
    each gets its run, under the run id derived from it. Runs before the schedules resume."""

    kind = "occurrences"

    def __init__(self, schedules: ScheduleDuty) -> None:
        self.schedules = schedules

    def recover(self, ctl: DutyContext) -> int:
        return self.schedules.start_open(ctl, older_than_ms=0)

    def tick(self, ctl: DutyContext) -> None:
        """The schedules duty rechecks open occurrences itself, every few seconds."""


def duties(registry: ScheduleRegistry | None = None,
           workflows: Registry = REGISTRY) -> Sequence[OccurrenceDuty | ScheduleDuty]:
    """The controller's schedule duties: occurrence recovery, then the schedules."""
    sched = ScheduleDuty(registry, workflows)
    return [OccurrenceDuty(sched), sched]


__all__ = [
    "KEY_PATTERN",
    "SCHEDULES",
    "OccurrenceDuty",
    "RollResult",
    "ScheduleDef",
    "ScheduleDuty",
    "ScheduleRegistry",
    "ScheduleView",
    "UnknownScheduleError",
    "derive_key",
    "duties",
    "list_schedules",
    "local_zone",
    "next_slot",
    "roll_schedule",
    "run_id_of",
    "schedule",
    "set_paused",
    "slots_after",
]
