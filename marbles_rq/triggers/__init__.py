"""Triggers: what starts runs besides `enqueue`. Schedules live in `schedules`."""

from .schedules import (
    SCHEDULES,
    RollResult,
    ScheduleRegistry,
    UnknownScheduleError,
    list_schedules,
    roll_schedule,
    schedule,
    set_paused,
)

__all__ = [
    "SCHEDULES",
    "RollResult",
    "ScheduleRegistry",
    "UnknownScheduleError",
    "list_schedules",
    "roll_schedule",
    "schedule",
    "set_paused",
]
