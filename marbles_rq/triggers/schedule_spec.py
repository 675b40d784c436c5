"""Schedules as declared: the `schedule` decorator and its registry, the parsing of every=,
cron= and at=, and the calendar (time zones; cron slots across DST changes). Nothing here
reads Redis: triggers/schedules.py fires what is declared (its docstring tells how), and
triggers/schedule_views.py lists and pauses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec
from cronsim import CronSim, CronSimError

from ..engine.authoring import (
    DefinitionError,
    InputError,
    Registry,
    WorkflowDef,
    _where,
)
from ..errors import MarblesError

OVERLAPS = ("skip", "buffer_one", "allow")
KEY_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,100}")
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
            base = as_int(state.get("last_finish")) or as_int(state.get("registered_ms")) or now_ms
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

def as_int(value: Any) -> int | None:
    """A stored number, or None when absent or unreadable."""
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
