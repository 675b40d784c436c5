"""marbles-rq: durable workflows on Redis with RQ workers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .artifacts import Artifact, ArtifactConflict, ArtifactVersion, artifact
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
        compensate,
        gather,
        now,
        parallel,
        publish,
        report,
        signals,
        sleep,
        sleep_until,
        start_child,
        wait_for_event,
        wait_for_signal,
    )
    from .engine.async_run import AsyncRunContext
    from .engine.authoring import step, workflow
    from .engine.execute import RunContext, current
    from .engine.patches import deprecate_patch, patched
    from .engine.retry_policy import NonRetryable, Retry
    from .engine.signals import SignalTimeoutError
    from .engine.undo_refs import CompensationError
    from .errors import MarblesError, RunSettledError
    from .flow.locks import LockError, lock
    from .flow.rate_limits import rate_limit
    from .flow.rate_specs import Rate
    from .store import RedisStore, Store, open_store
    from .store.keys import Keyspace
    from .store.memory import MemoryStore
    from .triggers.batches import Batch
    from .triggers.events import Event, on_event, send_event
    from .triggers.monitors import FileChange, HttpChange, Launch, monitor
    from .triggers.schedules import schedule

__all__ = [
    "Artifact",
    "ArtifactConflict",
    "ArtifactVersion",
    "AsyncClient",
    "AsyncRunContext",
    "Batch",
    "Client",
    "CompensationError",
    "Event",
    "FileChange",
    "HttpChange",
    "Keyspace",
    "Launch",
    "LockError",
    "MarblesError",
    "MemoryStore",
    "NonRetryable",
    "Rate",
    "RedisStore",
    "ResultTimeoutError",
    "Retry",
    "RunCancelledError",
    "RunContext",
    "RunFailedError",
    "RunHandle",
    "RunSettledError",
    "RunStatus",
    "SignalTimeoutError",
    "StartRequest",
    "Store",
    "artifact",
    "ask",
    "compensate",
    "connect",
    "connect_async",
    "current",
    "deprecate_patch",
    "gather",
    "lock",
    "monitor",
    "now",
    "on_event",
    "open_store",
    "parallel",
    "patched",
    "publish",
    "rate_limit",
    "report",
    "schedule",
    "send_event",
    "signals",
    "sleep",
    "sleep_until",
    "start_child",
    "step",
    "wait_for_event",
    "wait_for_signal",
    "workflow",
]
__version__ = "0.1.0"

# Each public name's module, imported on first use (PEP 562): every `marbles-rq` process
# imports this package, and most of them (a status, an enqueue, a worker whose workflows
# declare no trigger) need only a few of these modules.
_HOME = {
    **{name: ".client" for name in (
        "AsyncClient", "Client", "ResultTimeoutError", "RunCancelledError", "RunFailedError",
        "RunHandle", "RunStatus", "StartRequest", "connect", "connect_async")},
    "ask": ".engine.api", "gather": ".engine.api", "now": ".engine.api", "parallel": ".engine.api",
    "report": ".engine.api", "sleep": ".engine.api", "sleep_until": ".engine.api",
    "start_child": ".engine.api", "publish": ".engine.api", "wait_for_event": ".engine.api",
    "signals": ".engine.api", "wait_for_signal": ".engine.api",
    "compensate": ".engine.api", "CompensationError": ".engine.undo_refs",
    "RunSettledError": ".errors", "SignalTimeoutError": ".engine.signals",
    "step": ".engine.authoring", "workflow": ".engine.authoring",
    "RunContext": ".engine.execute", "current": ".engine.execute",
    "AsyncRunContext": ".engine.async_run",
    "patched": ".engine.patches", "deprecate_patch": ".engine.patches",
    "Retry": ".engine.retry_policy", "NonRetryable": ".engine.retry_policy",
    "rate_limit": ".flow.rate_limits", "Rate": ".flow.rate_specs",
    "MarblesError": ".errors",
    "RedisStore": ".store", "Store": ".store", "open_store": ".store",
    "Keyspace": ".store.keys",
    "MemoryStore": ".store.memory",
    "Event": ".triggers.events", "on_event": ".triggers.events",
    "send_event": ".triggers.events",
    "Batch": ".triggers.batches",
    "FileChange": ".triggers.monitors", "HttpChange": ".triggers.monitors",
    "Launch": ".triggers.monitors", "monitor": ".triggers.monitors",
    "schedule": ".triggers.schedules",
    "lock": ".flow.locks", "LockError": ".flow.locks",
    **{name: ".artifacts" for name in ("Artifact", "ArtifactConflict", "ArtifactVersion",
                                       "artifact")},
}


# Sessions (conversation transcripts: marbles_rq/sessions/).
if TYPE_CHECKING:
    from .sessions import AsyncSession as AsyncSession
    from .sessions import InvalidMessageError as InvalidMessageError
    from .sessions import Session as Session
    from .sessions import SessionCorruptError as SessionCorruptError
    from .sessions import SessionNotFoundError as SessionNotFoundError
    from .sessions.body import session as session
_SESSIONS = ("AsyncSession", "InvalidMessageError", "Session", "SessionCorruptError",
             "SessionNotFoundError")
__all__ += [*_SESSIONS, "session"]
_HOME.update({**{name: ".sessions" for name in _SESSIONS}, "session": ".sessions.body"})

if not TYPE_CHECKING:  # hidden from type checkers, which would take every misspelt name as Any

    def __getattr__(name: str) -> Any:
        home = _HOME.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home, __name__), name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
