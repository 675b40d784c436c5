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

import hashlib
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec
import redis
from cronsim import CronSim, CronSimError

from .. import metrics
from ..engine.authoring import (
    REGISTRY,
    DefinitionError,
    InputError,
    Registry,
    WorkflowDef,
    _where,
)
from ..engine.ops import RunRequest, enqueue_many, owned_by, prepare
from ..engine.runs import TERMINAL, RunStore
from ..errors import MarblesError
from ..store.redis_errors import is_outage, one_line
from ..store.scripts import Reply
from ..transport.lanes import RQLike

if TYPE_CHECKING:
    from ..controller.context import DutyContext

log = logging.getLogger("marbles_rq.triggers.schedules")

OVERLAPS = ("skip", "buffer_one", "allow")
KEY_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,100}")
POLL_MS = 1_000           # how soon a schedule waiting on a running run is looked at again
DUE_BATCH = 1_000         # due schedules read per bucket per pass
OPEN_AFTER_MS = 5_000     # a claimed occurrence not started by then is started by the tick
LOCK_TTL_MS = 60_000
MIN_WAIT_MS = 5           # the firing thread takes due schedules in batches at least this far apart
_EVERY = re.compile(r"([1-9][0-9]*)([smhd])")
_UNIT_MS = {"s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_WEEKDAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
MAX_EVERY_MS = 2**53 - 1


class UnknownScheduleError(MarblesError):
    """No schedule with this key is declared or registered."""

    code = "unknown_schedule"


# -- time zones and occurrences ----------------------------------------------------------------


def local_zone() -> ZoneInfo:
    """The machine's zone, as Marbles uses it: $TZ, else /etc/localtime, else UTC."""
    name = os.environ.get("TZ", "").lstrip(":")
    if name:
        try:
            return ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            pass
    local = Path("/etc/localtime")
    try:
        target = str(local.resolve())
        if "zoneinfo/" in target:
            return ZoneInfo(target.split("zoneinfo/", 1)[1])
        with local.open("rb") as fh:
            return ZoneInfo.from_file(fh, key="localtime")
    except (OSError, ZoneInfoNotFoundError, ValueError):
        return ZoneInfo("UTC")


def zone(name: str | None) -> ZoneInfo:
    if name is None:
        return local_zone()
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise DefinitionError(f"unknown time zone {name!r}") from None


def parse_every(every: str) -> int:
    """'30s', '10m', '6h', '1d' -> milliseconds; anything else is a DefinitionError."""
    match = _EVERY.fullmatch(every) if isinstance(every, str) else None
    if match is None:
        raise DefinitionError(f"invalid every {every!r}: use a positive whole number with "
                              f"s, m, h or d (e.g. '30s')")
    ms = int(match.group(1)) * _UNIT_MS[match.group(2)]
    if ms > MAX_EVERY_MS:
        raise DefinitionError(f"invalid every {every!r}: too long")
    return ms


def check_cron(expr: str) -> str:
    try:
        CronSim(expr, datetime(2000, 1, 1, tzinfo=UTC))
    except (CronSimError, ValueError, TypeError, AttributeError) as exc:
        raise DefinitionError(f"invalid cron {expr!r}: {exc}") from None
    return expr


def calendar_cron(at: dict[str, Any]) -> str:
    """Marbles' calendar form {weekday?, hour, minute?} -> cron ``m h * * DOW``."""
    if not isinstance(at, dict) or set(at) - {"weekday", "hour", "minute"} or "hour" not in at:
        raise DefinitionError(f"invalid at {at!r}: use {{'hour': 0-23, 'minute': 0-59, "
                              f"'weekday': 'mon' or ['mon', 'fri']}}")
    hour, minute = at["hour"], at.get("minute", 0)
    if not (isinstance(hour, int) and 0 <= hour <= 23):
        raise DefinitionError(f"invalid at hour {hour!r}: 0 to 23")
    if not (isinstance(minute, int) and 0 <= minute <= 59):
        raise DefinitionError(f"invalid at minute {minute!r}: 0 to 59")
    days = at.get("weekday")
    if days is None:
        dow = "*"
    else:
        names = [days] if isinstance(days, str) else list(days)
        if not names or any(not isinstance(d, str) or d.lower() not in _WEEKDAYS for d in names):
            raise DefinitionError(f"invalid at weekday {days!r}: sun..sat or a list of them")
        dow = ",".join(str(_WEEKDAYS.index(d.lower())) for d in names)
    return f"{minute} {hour} * * {dow}"


def slots_after(expr: str, tz: ZoneInfo, after_ms: int) -> Iterator[int]:
    """The nominal times (ms) of cron `expr` in `tz` strictly after `after_ms`. Each nominal
    wall-clock slot fires once across a DST change: a slot skipped by spring-forward fires at
    the jump (cronsim does this); a slot repeated by fall-back fires at its first instant only
    (cronsim yields it twice, the second with fold=1, which is dropped here)."""
    start = datetime.fromtimestamp(after_ms / 1000, tz)
    for slot in CronSim(expr, start):
        if slot.fold == 1:
            continue
        yield int(slot.timestamp() * 1000)


def next_slot(expr: str, tz: ZoneInfo, after_ms: int) -> int:
    return next(slots_after(expr, tz, after_ms))


# -- declarations ------------------------------------------------------------------------------


@dataclass
class ScheduleDef:
    key: str
    workflow: str
    kind: str  # interval | cron | calendar
    label: str
    input: bytes  # JSON; b"null" when none
    overlap: str = "skip"
    every_ms: int = 0
    cron: str = ""
    tz: ZoneInfo | None = None
    catch_up_ms: int | None = None  # None: one period
    where: str = ""
    spec: tuple[Any, ...] = field(default=(), repr=False)
    # Declared without input= and by name (`workflow="name"`, maybe not loaded yet): the
    # runs' input is what an omitted input means for that workflow, resolved when it fires.
    omitted: bool = False

    def input_for(self, workflows: Registry) -> bytes:
        """The runs' input: as declared, or, when omitted, the workflow's omitted input (its
        parameter's Python default, ...: WorkflowDef.omitted_input)."""
        if self.omitted and self.workflow in workflows.workflows:
            return workflows.workflow(self.workflow).omitted_input("give input=")
        return self.input

    @property
    def fingerprint(self) -> str:
        raw = json.dumps([self.kind, self.every_ms, self.cron, str(self.tz or ""),
                          self.workflow, self.input.decode()])
        return hashlib.sha1(raw.encode()).hexdigest()[:16]

    def occurrence_id(self, nominal_ms: int) -> str:
        return f"{self.key}@{nominal_ms}"

    def run_id(self, nominal_ms: int) -> str:
        return run_id_of(self.key, nominal_ms)

    def first_cursor(self, now_ms: int, state: dict[str, str] | None = None) -> int:
        """The first due time for a new or changed definition."""
        if self.kind == "interval":
            state = state or {}
            base = _int(state.get("last_finish")) or _int(state.get("registered_ms")) or now_ms
            return base + self.every_ms
        assert self.tz is not None
        return next_slot(self.cron, self.tz, now_ms)

    def period_at(self, slot_ms: int) -> int:
        assert self.tz is not None
        return next_slot(self.cron, self.tz, slot_ms) - slot_ms


def run_id_of(key: str, nominal_ms: int) -> str:
    return f"sched:{key}:{nominal_ms}"


@dataclass
class ScheduleRegistry:
    schedules: dict[str, ScheduleDef] = field(default_factory=dict)

    def add(self, definition: ScheduleDef, explicit_key: bool) -> ScheduleDef:
        for existing in self.schedules.values():
            if existing.where == definition.where and existing.spec == definition.spec:
                return existing  # the same declaration again: a module loaded twice
        key = definition.key
        if key in self.schedules:
            if explicit_key:
                raise DefinitionError(f"duplicate schedule key {key!r}: declared at "
                                      f"{self.schedules[key].where} and {definition.where}")
            n = 2
            while f"{key}-{n}" in self.schedules:
                n += 1
            definition.key = f"{key}-{n}"
        self.schedules[definition.key] = definition
        return definition

    def get(self, key: str) -> ScheduleDef:
        try:
            return self.schedules[key]
        except KeyError:
            known = ", ".join(sorted(self.schedules)) or "none declared; is --source set?"
            raise UnknownScheduleError(f"unknown schedule {key!r} (declared: {known})") from None


SCHEDULES = ScheduleRegistry()


def slug(name: str) -> str:
    """Marbles' slug: lowercase, non-alphanumerics to '-', trimmed, at most 40 characters."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40].strip("-") or "schedule"


def stable_json(value: Any) -> str:
    return json.dumps(msgspec.to_builtins(value), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False)


def derive_key(workflow: str, input: Any = None) -> str:
    """``slug(target)``, plus ``-sha8(stableJson(input))`` when there is an input."""
    if input is None:
        return slug(workflow)
    return f"{slug(workflow)}-{hashlib.sha256(stable_json(input).encode()).hexdigest()[:8]}"


def schedule(*, every: str | None = None, cron: str | None = None,
             at: dict[str, Any] | None = None, tz: str | None = None, input: Any = None,
             workflow: str | WorkflowDef | None = None, key: str | None = None,
             overlap: str = "skip", catch_up: str | None = None,
             registry: ScheduleRegistry | None = None) -> Any:
    """Declare a schedule of a workflow: exactly one of `every` ("30s", "10m", "6h", "1d";
    measured from the previous run's completion), `cron` (a cron expression in `tz`), `at`
    ({"weekday"?, "hour", "minute"?}, in `tz`). `tz` defaults to the machine's zone. `input`
    is the runs' input. `overlap`: "skip" (default), "buffer_one" or "allow". `catch_up`:
    how far back a missed cron/calendar slot still fires after downtime (default one period).

    Used as a decorator on a workflow (``@schedule(every="30s")`` above ``@workflow``), or
    called with ``workflow=``. Returns the decorated object unchanged."""
    registry = registry if registry is not None else SCHEDULES

    def declare(target: Any, where: str) -> ScheduleDef:
        return _declare(registry, target, where, every=every, cron=cron, at=at, tz=tz,
                        input=input, key=key, overlap=overlap, catch_up=catch_up)

    if workflow is not None:
        caller = sys._getframe(1)
        declare(workflow, f"{os.path.relpath(caller.f_code.co_filename)}:{caller.f_lineno}")
        return None

    def decorate(target: Any) -> Any:
        if not isinstance(target, WorkflowDef):
            raise DefinitionError(f"@schedule at {_where(target)} must decorate a @workflow "
                                  f"(put it above @workflow), or pass workflow=")
        declare(target, _where(target.fn))
        return target

    return decorate


def _declare(registry: ScheduleRegistry, target: Any, where: str, *, every: str | None,
             cron: str | None, at: dict[str, Any] | None, tz: str | None, input: Any,
             key: str | None, overlap: str, catch_up: str | None) -> ScheduleDef:
    def bad(message: str) -> DefinitionError:
        return DefinitionError(f"schedule at {where}: {message}")

    try:
        name = target.name if isinstance(target, WorkflowDef) else target
        if not isinstance(name, str) or not name:
            raise DefinitionError(f"the target {target!r} has no name")
        if sum(x is not None for x in (every, cron, at)) != 1:
            raise DefinitionError("give exactly one of every=, cron=, at=")
        if overlap not in OVERLAPS:
            raise DefinitionError(f"overlap must be one of {', '.join(OVERLAPS)}, "
                                  f"not {overlap!r}")
        if key is not None and not KEY_PATTERN.fullmatch(key):
            raise DefinitionError(f"invalid key {key!r}: use 1 to 100 of A-Z a-z 0-9 _ . -")
        raw = b"null" if input is None else msgspec.json.encode(input)
        if isinstance(target, WorkflowDef):
            if input is None:  # as enqueue without --input: the parameter's default, ...
                raw = target.omitted_input("give input=")
            target.parse_input(raw)  # a bad input fails here, at load, not at each firing
        catch_up_ms = None if catch_up is None else parse_every(catch_up)
        spec = (name, every, cron, json.dumps(at, sort_keys=True), tz, raw, key, overlap,
                catch_up)
        definition_key = key or derive_key(name, input)
        omitted = input is None and not isinstance(target, WorkflowDef)
        if every is not None:
            every_ms = parse_every(every)
            return registry.add(ScheduleDef(
                definition_key, name, "interval", f"every {every}", raw, overlap,
                every_ms=every_ms, catch_up_ms=catch_up_ms, where=where, spec=spec,
                omitted=omitted),
                key is not None)
        zone_info = zone(tz)
        if cron is not None:
            kind, expr, label = "cron", check_cron(cron), f"cron {cron}"
        else:
            assert at is not None
            kind, expr = "calendar", calendar_cron(at)
            label = f"at {expr}"
        return registry.add(ScheduleDef(
            definition_key, name, kind, f"{label} ({zone_info.key})", raw, overlap, cron=expr,
            tz=zone_info, catch_up_ms=catch_up_ms, where=where, spec=spec, omitted=omitted),
            key is not None)
    except DefinitionError as exc:
        if str(exc).startswith("schedule at "):
            raise
        raise bad(str(exc)) from None
    except InputError as exc:
        raise bad(str(exc)) from None
    except (TypeError, msgspec.EncodeError) as exc:
        raise bad(f"input is not JSON-encodable: {exc}") from None


# -- reading what Redis holds --------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleView:
    key: str
    kind: str
    label: str
    workflow: str
    # active | paused | orphaned | unregistered | registered (no sources given) | unreadable
    status: str
    last_start: int | None
    last_finish: int | None
    last_status: str | None
    next_due: int | None
    last_run: str | None
    skipped: int

    def history(self) -> dict[str, Any]:
        """Marbles' history shape: {kind, label, lastStart, lastFinish, lastStatus, nextDue}."""
        return {"kind": self.kind, "label": self.label, "lastStart": self.last_start,
                "lastFinish": self.last_finish, "lastStatus": self.last_status,
                "nextDue": self.next_due}


def _int(value: Any) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _decode(fields: dict[Any, Any]) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in fields.items()}


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def registered_keys(runs: RunStore, buckets: Iterable[int] | None = None) -> list[str]:
    """Every schedule key recorded in Redis (a controller registered it, or it was paused),
    in `buckets` (default: all)."""
    pipe = runs.client.pipeline(transaction=False)
    for bucket in range(runs.keys.buckets) if buckets is None else buckets:
        pipe.zrange(runs.keys.schedule_index(bucket), 0, -1)
    return sorted(_s(k) for found in pipe.execute() for k in found)


def list_schedules(runs: RunStore, registry: ScheduleRegistry | None = None, *,
                   sources_known: bool = True) -> list[ScheduleView]:
    """Declared and registered schedules, with history; a registered key the registry does
    not declare is `orphaned` (it never fires) -- or just `registered` when the caller has
    no sources to tell (`sources_known=False`)."""
    registry = registry if registry is not None else SCHEDULES
    keys = sorted(set(registered_keys(runs)) | set(registry.schedules))
    pipe = runs.client.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(runs.keys.schedule(key))
    out = []
    for key, raw in zip(keys, pipe.execute(raise_on_error=False), strict=True):
        unreadable = isinstance(raw, Exception)
        if unreadable:
            if is_outage(raw):
                raise raw
            log.warning("schedule %s: unreadable state at %s (%s)", key,
                        runs.keys.schedule(key), one_line(raw))
        state = {} if unreadable else _decode(raw)
        definition = registry.schedules.get(key)
        if unreadable:
            status = "unreadable"
        elif definition is None:
            status = "orphaned" if sources_known else (
                "paused" if state.get("paused") == "1" else "registered")
        elif state.get("paused") == "1":
            status = "paused"
        elif "registered_ms" not in state:
            status = "unregistered"
        else:
            status = "active"
        out.append(ScheduleView(
            key=key, kind=state.get("kind") or (definition.kind if definition else ""),
            label=state.get("label") or (definition.label if definition else ""),
            workflow=state.get("workflow") or (definition.workflow if definition else ""),
            status=status, last_start=_int(state.get("last_start")),
            last_finish=_int(state.get("last_finish")), last_status=state.get("last_status"),
            next_due=None if status in ("orphaned", "paused") else _int(state.get("cursor")),
            last_run=state.get("last_run"), skipped=_int(state.get("skipped")) or 0))
    return out


def set_paused(runs: RunStore, key: str, paused: bool,
               registry: ScheduleRegistry | None = None) -> bool:
    """Pause or resume `key` (recorded; survives restarts). Returns the previous flag.
    An unknown key raises UnknownScheduleError and records nothing."""
    registry = registry if registry is not None else SCHEDULES
    if not KEY_PATTERN.fullmatch(key):
        raise UnknownScheduleError(f"unknown schedule {key!r}")
    reply = runs.scripts.pause_schedule(keys=runs.keys.schedule_keys(key), key=key,
                                        paused=paused, declared=key in registry.schedules)
    if reply.status == "unknown":
        raise UnknownScheduleError(f"unknown schedule {key!r}: not declared by --source and "
                                   f"never registered")
    return _s(reply.values[0]) == "1"


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
        return RollResult(key, "skipped", holder=_s(taken.values[0]))
    try:
        secs, micros = runs.client.time()
        now_ms = int(secs) * 1000 + int(micros) // 1000
        occ_id = definition.occurrence_id(now_ms)
        reply = runs.scripts.claim_occurrences([dict(
            keys=keys, occurrence_key=runs.keys.occurrence(key, occ_id), key=key,
            ctl_epoch=None, expected="", nominal_ms=now_ms, occurrence_id=occ_id,
            run_id=definition.run_id(now_ms), cursor="", due_ms="", holder=holder)])[0]
        if reply.status == "missing":
            raise UnknownScheduleError(f"schedule {key!r} is not registered yet: start a "
                                       f"controller with this --source first")
        if reply.status == "locked":
            return RollResult(key, "skipped", holder=_s(reply.values[0]))
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
            state = _decode(raw)
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
        pipe = ctl.store.client.pipeline(transaction=False)
        for bucket in ctl.buckets:
            pipe.zrangebyscore(keys.occurrences_open(bucket), "-inf", cutoff, start=0,
                               num=DUE_BATCH)
        occ_ids = [_s(o) for found in pipe.execute() for o in found]
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
                                       definition.input_for(self.workflows), _s(run_id),
                                       origin="schedule"))
            started.append((schedule_keys, keys.occurrence(key_s, occ_id), occ_id, ctl.epoch))
            log.info("occurrence %s was claimed but not started; starting run %s", occ_id,
                     _s(run_id))
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
            ctl.step_down(f"a newer controller (epoch {_s(reply.values[0])}) acts on "
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
        pipe = ctl.store.client.pipeline(transaction=False)
        for bucket in ctl.buckets:
            pipe.zrangebyscore(keys.schedule_due(bucket), "-inf", now_ms, start=0,
                               num=DUE_BATCH, withscores=True)
        due: list[tuple[str, int]] = []
        results = pipe.execute(raise_on_error=False)
        for bucket, found in zip(ctl.buckets, results, strict=True):
            if isinstance(found, Exception):
                if is_outage(found):
                    raise found
                log.warning("skipping unreadable %s: %s", keys.schedule_due(bucket),
                            one_line(found))
                continue
            due += [(_s(k), int(score)) for k, score in found]
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
            readable.append(((key, score), _decode(raw)))
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
                         _s(reply.values[0]))
                # Looked at again a poll later, not at every pass while the lock is held.
                cursor = int(f.expected)
                held.append(_Move(f.definition, f.expected, cursor, now_ms + POLL_MS))
            elif reply.status == "exists":
                log.warning("occurrence %s exists for run %s; not fired again",
                            f.definition.occurrence_id(f.nominal_ms), _s(reply.values[0]))
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
    status, finished = (_s(x) if x is not None else None for x in raw)
    if status is None:  # pruned or never recorded: treat as finished at its start
        return _Previous(run_id, False, _int(state.get("last_start")), None)
    return _Previous(run_id, status not in TERMINAL, _int(finished), status)


def decide(definition: ScheduleDef, state: dict[str, str], prev: _Previous,
           now_ms: int) -> _Fire | _Move | None:
    """What one due schedule does now: fire an occurrence, or move its cursor."""
    cursor_s = state.get("cursor", "")
    cursor = _int(cursor_s)
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
            base = prev.finished_ms or _int(state.get("last_finish")) or \
                _int(state.get("last_start")) or now_ms
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
    buffered = _int(state.get("buffered"))
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
