"""marbles-rq: durable workflows on Redis with RQ workers."""

from .engine.api import (
    ask,
    gather,
    parallel,
    report,
    signals,
    sleep,
    sleep_until,
    start_child,
    wait_for_signal,
)
from .engine.authoring import step, workflow
from .engine.execute import RunContext, current
from .engine.signals import RunSettledError, SignalTimeoutError
from .errors import MarblesError
from .store import RedisStore, Store, open_store
from .store.keys import Keyspace
from .store.memory import MemoryStore
from .triggers.events import Event, on_event, send_event
from .triggers.monitors import FileChange, HttpChange, Launch, monitor
from .triggers.schedules import schedule

__all__ = [
    "Event",
    "FileChange",
    "HttpChange",
    "Keyspace",
    "Launch",
    "MarblesError",
    "MemoryStore",
    "RedisStore",
    "RunContext",
    "RunSettledError",
    "SignalTimeoutError",
    "Store",
    "ask",
    "current",
    "gather",
    "monitor",
    "on_event",
    "open_store",
    "parallel",
    "report",
    "schedule",
    "send_event",
    "signals",
    "sleep",
    "sleep_until",
    "start_child",
    "step",
    "wait_for_signal",
    "workflow",
]
__version__ = "0.1.0"
