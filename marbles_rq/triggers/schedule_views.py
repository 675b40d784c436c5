"""What an operator reads and changes of the schedules (the CLI's and the web's views):
every schedule declared or registered with its history, and pausing or resuming one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..engine.runs import RunStore
from ..store.redis_errors import is_outage, one_line
from ..store.replies import as_text
from .schedule_spec import KEY_PATTERN, SCHEDULES, ScheduleRegistry, UnknownScheduleError, as_int

log = logging.getLogger("marbles_rq.triggers.schedules")


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


def decoded(fields: dict[Any, Any]) -> dict[str, str]:
    return {as_text(k): as_text(v) for k, v in fields.items()}


def registered_keys(runs: RunStore, buckets: Iterable[int] | None = None) -> list[str]:
    """Every schedule key recorded in Redis (a controller registered it, or it was paused),
    in `buckets` (default: all)."""
    pipe = runs.client.pipeline(transaction=False)
    for bucket in range(runs.keys.buckets) if buckets is None else buckets:
        pipe.zrange(runs.keys.schedule_index(bucket), 0, -1)
    return sorted(as_text(k) for found in pipe.execute() for k in found)


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
        state = {} if unreadable else decoded(raw)
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
            status=status, last_start=as_int(state.get("last_start")),
            last_finish=as_int(state.get("last_finish")), last_status=state.get("last_status"),
            next_due=None if status in ("orphaned", "paused") else as_int(state.get("cursor")),
            last_run=state.get("last_run"), skipped=as_int(state.get("skipped")) or 0))
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
    return as_text(reply.values[0]) == "1"
