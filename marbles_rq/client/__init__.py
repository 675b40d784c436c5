"""The public client: `mr.connect()` (sync) and `mr.connect_async()` (asyncio)."""

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
