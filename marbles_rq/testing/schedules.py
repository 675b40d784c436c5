"""Declared schedules fired on the test kit's virtual clock, by production's own decision
(triggers/schedules.py `decide`: cron slots in their zone across DST changes, intervals from
the previous run's end, overlap and catch-up) and under production's run ids
(`ScheduleDef.run_id`). What the scripts keep per schedule (cursor, last run, buffered
slot) is a dict here, updated as claim_occurrence.lua and move_schedule.lua update it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine.memory_engine import MemoryEngine, Timed
from ..engine.ops import RunRequest, prepare
from ..engine.runs import TERMINAL

if TYPE_CHECKING:
    from ..triggers.schedule_spec import ScheduleDef, ScheduleRegistry


@dataclass(frozen=True)
class Fired:
    """One occurrence a schedule fired: its key, nominal time (UTC) and run id."""

    key: str
    at: dt.datetime
    run_id: str


class _Schedule:
    def __init__(self, definition: ScheduleDef, now_ms: int) -> None:
        self.definition = definition
        cursor = definition.first_cursor(now_ms, {})
        self.state: dict[str, str] = {"registered_ms": str(now_ms), "cursor": str(cursor)}
        self.due: int | None = cursor
        self.skipped = 0


class Schedules(Timed):
    """The declared schedules, fired on the engine's clock (see the module's note)."""

    def __init__(self, engine: MemoryEngine, registry: ScheduleRegistry,
                 keys: list[str] | None = None) -> None:
        self.engine = engine
        self.fired: list[Fired] = []
        # By default those whose workflow is loaded (as a controller skips the others).
        wanted = [k for k, d in sorted(registry.schedules.items())
                  if d.workflow in engine.registry.workflows] if keys is None else keys
        now = engine.now_ms()
        self._all = {key: _Schedule(registry.get(key), now) for key in wanted}

    @property
    def keys(self) -> list[str]:
        return sorted(self._all)

    def skipped(self, key: str) -> int:
        """How many slots of schedule `key` were skipped (overlap, catch-up window)."""
        return self._all[key].skipped

    def _last(self, s: _Schedule) -> Any:
        run_id = s.state.get("last_run")
        return None if not run_id else self.engine.store.runs.get(run_id)

    def _due(self, s: _Schedule) -> int | None:
        if s.due is None:
            return None
        # Production looks again every second while it waits for a run to end (an interval
        # schedule, a buffered slot); here the run's end is known: it is looked at then.
        polls = "buffered" in s.state or (s.definition.kind == "interval"
                                          and s.definition.overlap != "allow")
        last = self._last(s)
        if polls and last is not None:
            if last.status not in TERMINAL:
                return None
            return max(s.due, last.finished_ms or 0)
        return s.due

    def due_ms(self) -> int | None:
        return min((d for s in self._all.values() if (d := self._due(s)) is not None),
                   default=None)

    def fire(self, now_ms: int) -> None:
        from ..triggers.schedules import _Fire, _Move, _Previous, decide

        for key in sorted(self._all):
            s = self._all[key]
            due = self._due(s)
            if due is None or due > now_ms:
                continue
            last = self._last(s)
            prev = _Previous(None, False, None, None) if "last_run" not in s.state else (
                _Previous(s.state["last_run"], False, int(s.state.get("last_start", 0)), None)
                if last is None else
                _Previous(s.state["last_run"], last.status not in TERMINAL, last.finished_ms,
                          last.status))
            action = decide(s.definition, s.state, prev, now_ms)
            if action is None:
                s.due = None
                continue
            if action.finish is not None:
                run_id, finished, status = action.finish
                s.state.update(fin_run=run_id, last_finish=str(finished), last_status=status)
            if isinstance(action, _Move):
                s.state["cursor"] = str(action.cursor)
                if action.buffered == "-":
                    s.state.pop("buffered", None)
                elif action.buffered:
                    s.state["buffered"] = action.buffered
                s.skipped += action.skipped
                s.due = action.due_ms
                continue
            assert isinstance(action, _Fire)
            self._start(s, action.nominal_ms, now_ms)
            if action.cursor:
                s.state["cursor"] = action.cursor
            if action.from_buffer:
                s.state.pop("buffered", None)
            s.due = int(action.due_ms) if action.due_ms else s.due

    def _start(self, s: _Schedule, nominal_ms: int, now_ms: int) -> None:
        definition = s.definition
        run_id = definition.run_id(nominal_ms)
        registry = self.engine.registry
        record = prepare(RunRequest(definition.workflow, definition.input_for(registry),
                                    run_id, origin="schedule"), registry)
        self.engine.store.record(record)
        s.state.update(last_run=run_id, last_nominal=str(nominal_ms), last_start=str(now_ms))
        self.fired.append(Fired(definition.key,
                                dt.datetime.fromtimestamp(nominal_ms / 1000, dt.UTC), run_id))


__all__ = ["Fired", "Schedules"]
