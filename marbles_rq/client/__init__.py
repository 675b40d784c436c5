"""The public client: `mr.connect()` (sync) and `mr.connect_async()` (asyncio).

Each name is imported from its module on first use, so a process that only needs the
synchronous client (a CLI command) does not pay for the asyncio one."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine.selection import RunFilter
    from .aio import AsyncClient, AsyncRunHandle, connect_async
    from .errors import ResultTimeoutError, RunCancelledError, RunFailedError
    from .sync import Client, RunHandle, StartRequest, connect
    from .views import (
        BulkSummary,
        Outcome,
        OutputEntry,
        QuestionInfo,
        ReportInfo,
        RunsPage,
        RunStatus,
        RunSummary,
    )

_HOMES = {
    "AsyncClient": "aio", "AsyncRunHandle": "aio", "connect_async": "aio",
    "ResultTimeoutError": "errors", "RunCancelledError": "errors", "RunFailedError": "errors",
    "Client": "sync", "RunHandle": "sync", "StartRequest": "sync", "connect": "sync",
    "Outcome": "views", "OutputEntry": "views", "QuestionInfo": "views", "ReportInfo": "views",
    "RunsPage": "views", "RunStatus": "views", "RunSummary": "views", "BulkSummary": "views",
    "RunFilter": ".engine.selection",
}

__all__ = [
    "AsyncClient",
    "AsyncRunHandle",
    "BulkSummary",
    "Client",
    "Outcome",
    "OutputEntry",
    "QuestionInfo",
    "ReportInfo",
    "ResultTimeoutError",
    "RunCancelledError",
    "RunFailedError",
    "RunFilter",
    "RunHandle",
    "RunStatus",
    "RunSummary",
    "RunsPage",
    "StartRequest",
    "connect",
    "connect_async",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
