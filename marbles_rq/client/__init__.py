"""The public client: `mr.connect()` (sync) and `mr.connect_async()` (asyncio)."""

from .aio import AsyncClient, AsyncRunHandle, connect_async
from .errors import ResultTimeoutError, RunCancelledError, RunFailedError
from .sync import Client, RunHandle, StartRequest, connect
from .views import Outcome, OutputEntry, QuestionInfo, ReportInfo, RunsPage, RunStatus, RunSummary

__all__ = [
    "AsyncClient",
    "AsyncRunHandle",
    "Client",
    "Outcome",
    "OutputEntry",
    "QuestionInfo",
    "ReportInfo",
    "ResultTimeoutError",
    "RunCancelledError",
    "RunFailedError",
    "RunHandle",
    "RunStatus",
    "RunSummary",
    "RunsPage",
    "StartRequest",
    "connect",
    "connect_async",
]
