"""marbles-rq: durable workflows on Redis with RQ workers."""

from .client import (
    AsyncClient,
    Client,
    ResultTimeoutError,
    RunCancelledError,
    RunFailedError,
    RunHandle,
    RunStatus,
    StartRequest,
    connect,
    connect_async,
)
from .engine.api import (
    ask,
    gather,
    parallel,
    publish,
    report,
    sleep,
    sleep_until,
    start_child,
    wait_for_event,
)
from .engine.authoring import step, workflow
from .engine.execute import RunContext, current
from .errors import MarblesError
from .store import RedisStore, Store, open_store
from .store.keys import Keyspace
from .store.memory import MemoryStore
from .triggers.events import Event, on_event, send_event
from .triggers.monitors import FileChange, HttpChange, Launch, monitor
from .triggers.schedules import schedule

__all__ = [
    "AsyncClient",
    "Client",
    "Event",
    "FileChange",
    "HttpChange",
    "Keyspace",
    "Launch",
    "MarblesError",
    "MemoryStore",
    "RedisStore",
    "ResultTimeoutError",
    "RunCancelledError",
    "RunContext",
    "RunFailedError",
    "RunHandle",
    "RunStatus",
    "StartRequest",
    "Store",
    "ask",
    "connect",
    "connect_async",
    "current",
    "gather",
    "monitor",
    "on_event",
    "open_store",
    "parallel",
    "publish",
    "report",
    "schedule",
    "send_event",
    "sleep",
    "sleep_until",
    "start_child",
    "step",
    "wait_for_event",
    "workflow",
]
__version__ = "0.1.0"
