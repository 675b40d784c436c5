"""The asyncio client: `Client`'s methods as coroutines, for Starlette/FastAPI apps.

What waits (result, watch, output with a block) reads the run's output stream on
redis.asyncio, so a thousand requests waiting for results hold no thread. The writes run the
sync client's code in a worker thread: one code path per operation, shared with the CLI and
the dashboard, each a single script call on a server that fsyncs it.
"""

from __future__ import annotations

import asyncio
import functools
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from ..engine.authoring import WorkflowDef
from ..engine.execution import RunNotFoundError
from ..engine.runs import OutputEvent
from ..engine.selection import RunFilter
from ..payloads.fields import open_event
from ..store.connection import connect_async as connect_redis_async
from ..store.ids import check_id
from .errors import ResultTimeoutError
from .outage import typed_outages
from .sync import (
    BLOCK_SLICE_MS,
    Client,
    RunHandle,
    StartAt,
    StartRequest,
    connect,
    entry_of,
    settle,
    wait_seconds,
)
from .views import BulkSummary, Outcome, OutputEntry, QuestionInfo, RunsPage, RunStatus

if TYPE_CHECKING:
    from ..artifacts.handle import AsyncArtifact
    from ..artifacts.records import ArtifactInfo
    from ..engine.history import History
    from ..flow.gate_specs import Decision
    from ..flow.lock_store import LockInfo
    from ..flow.rate_store import RateLimitInfo
    from ..sessions import AsyncSession, Message, SessionInfo, SessionListing

T = TypeVar("T")


def connect_async(redis_url: str | None = None, prefix: str | None = None, *,
                  buckets: int | None = None, lanes: int | None = None,
                  source: str | None = None, rq_url: str | None = None) -> AsyncClient:
    """`mr.connect`'s asyncio twin: the same settings and environment variables."""
    return AsyncClient(connect(redis_url, prefix, buckets=buckets, lanes=lanes, source=source,
                               rq_url=rq_url))


@typed_outages(lambda self: self.sync.settings.redis_url)
class AsyncClient:
    def __init__(self, client: Client) -> None:
        self.sync = client
        # redis.asyncio connections belong to the loop that opened them: a client used from
        # a second loop (asyncio.run twice, a thread with its own loop) needs its own.
        self._aio_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary())

    @property
    def aio(self) -> Any:
        """The redis.asyncio client of the running event loop."""
        loop = asyncio.get_running_loop()
        opened = self._aio_by_loop.get(loop)
        if opened is None:
            opened = self._aio_by_loop[loop] = _connect_async(self.sync.settings.redis_url)
        return opened

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(functools.partial(fn, *args, **kwargs))

    async def aclose(self) -> None:
        """Close this loop's connections and the sync client's (both open again if used)."""
        opened = self._aio_by_loop.pop(asyncio.get_running_loop(), None)
        if opened is not None:
            await opened.aclose()
        await self._call(self.sync.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- writes and reads (the sync client's code) -------------------------------------------

    async def start(self, workflow: str | WorkflowDef, input: Any = None, *,
                    id: str | None = None, queue: str | None = None,
                    priority: int | None = None, input_json: bytes | str | None = None,
                    start_at: StartAt = None,
                    signal: tuple[str, Any] | None = None) -> AsyncRunHandle:
        handle = await self._call(self.sync.start, workflow, input, id=id, queue=queue,
                                  priority=priority, input_json=input_json, start_at=start_at,
                                  signal=signal)
        return self._wrap(handle)

    async def start_many(self, requests: Iterable[StartRequest]) -> list[AsyncRunHandle]:
        handles = await self._call(self.sync.start_many, list(requests))
        return [self._wrap(h) for h in handles]

    def _wrap(self, handle: RunHandle) -> AsyncRunHandle:
        wrapped = AsyncRunHandle(self, handle.id, created=handle.created,
                                 workflow=handle.workflow, queue=handle.queue,
                                 initial_status=handle.initial_status)
        wrapped.decision = handle.decision  # as RunHandle's
        return wrapped

    def handle(self, run_id: str) -> AsyncRunHandle:
        return AsyncRunHandle(self, check_id(run_id, "run id"))

    async def status(self, run_id: str) -> RunStatus:
        return await self._call(self.sync.status, run_id)

    async def export(self, *run_ids: str) -> list[History]:
        return await self._call(self.sync.export, *run_ids)

    async def runs(self, **filters: Any) -> RunsPage:
        return await self._call(self.sync.runs, **filters)

    async def locks(self) -> list[LockInfo]:
        return await self._call(self.sync.locks)
    def artifact(self, name: str, media_type: str | None = None) -> AsyncArtifact:
        """`Client.artifact`'s handle with coroutine methods (and `chunks`, an async
        iterator of the content)."""
        from ..artifacts.handle import AsyncArtifact

        return AsyncArtifact(self, self.sync.artifact(name, media_type))

    async def artifacts(self) -> list[ArtifactInfo]:
        return await self._call(self.sync.artifacts)

    async def rate_limits(self) -> list[RateLimitInfo]:
        return await self._call(self.sync.rate_limits)

    async def set_rate_limit(self, name: str, rate: str,
                             burst: int | None = None) -> RateLimitInfo:
        return await self._call(self.sync.set_rate_limit, name, rate, burst)

    async def reset_rate_limit(self, name: str) -> RateLimitInfo:
        return await self._call(self.sync.reset_rate_limit, name)

    async def feed(self, limit: int = 100) -> list[QuestionInfo]:
        return await self._call(self.sync.feed, limit)

    def select(self, **criteria: Any) -> RunFilter:
        return self.sync.select(**criteria)

    async def count(self, target: RunFilter, sample: int = 10) -> tuple[int, list[str]]:
        return await self._call(self.sync.count, target, sample)

    async def bulk(self, action: str, target: RunFilter | Iterable[str],
                   **options: Any) -> BulkSummary:
        """`Client.bulk` in a worker thread (each run is one script call, as there)."""
        return await self._call(self.sync.bulk, action, target, **options)

    async def cancel_many(self, target: RunFilter | Iterable[str],
                          **options: Any) -> BulkSummary:
        return await self.bulk("cancel", target, **options)

    async def pause_many(self, target: RunFilter | Iterable[str],
                         **options: Any) -> BulkSummary:
        return await self.bulk("pause", target, **options)

    async def resume_many(self, target: RunFilter | Iterable[str],
                          **options: Any) -> BulkSummary:
        return await self.bulk("resume", target, **options)

    async def rerun_many(self, target: RunFilter | Iterable[str],
                         **options: Any) -> BulkSummary:
        return await self.bulk("rerun", target, **options)

    async def approve_many(self, target: RunFilter | Iterable[str], key: str | None = None,
                           note: str | None = None, **options: Any) -> BulkSummary:
        return await self.bulk("approve", target, key=key, note=note, **options)

    async def reject_many(self, target: RunFilter | Iterable[str], key: str | None = None,
                          note: str | None = None, **options: Any) -> BulkSummary:
        return await self.bulk("reject", target, key=key, note=note, **options)

    async def cancel(self, run_id: str, *, compensate: bool = False) -> Outcome:
        return await self._call(self.sync.cancel, run_id, compensate=compensate)

    async def pause(self, run_id: str) -> Outcome:
        return await self._call(self.sync.pause, run_id)

    async def resume(self, run_id: str) -> Outcome:
        return await self._call(self.sync.resume, run_id)

    async def retry(self, run_id: str, input_patch: Any = None) -> Outcome:
        return await self._call(self.sync.retry, run_id, input_patch)

    async def fail(self, run_id: str, reason: str | None = None) -> Outcome:
        return await self._call(self.sync.fail, run_id, reason)

    async def answer(self, run_id: str, key: str, value: Any) -> Outcome:
        return await self._call(self.sync.answer, run_id, key, value)

    async def approve(self, run_id: str, key: str, note: str | None = None) -> Outcome:
        return await self._call(self.sync.approve, run_id, key, note)

    async def reject(self, run_id: str, key: str, note: str | None = None) -> Outcome:
        return await self._call(self.sync.reject, run_id, key, note)

    async def send_event(self, source: str, id: str, type: str | None = None,
                         payload: Any = None) -> Any:
        return await self._call(self.sync.send_event, source, id, type, payload)

    async def batch(self, run_id: str) -> dict[str, Any] | None:
        return await self._call(self.sync.batch, run_id)

    async def open_batches(self) -> list[Any]:
        return await self._call(self.sync.open_batches)

    async def signal_with_start(self, workflow: str | WorkflowDef, input: Any = None, *,
                                id: str, signal: tuple[str, Any], **options: Any) -> Any:
        return await self._call(self.sync.signal_with_start, workflow, input, id=id,
                                signal=signal, **options)

    async def signal(self, run_id: str, name: str, payload: Any = None, *,
                     payload_json: bytes | None = None, request_id: str | None = None) -> Any:
        return await self._call(self.sync.signal, run_id, name, payload,
                                payload_json=payload_json, request_id=request_id)

    async def get(self, run_id: str, key: str) -> Any:
        return await self._call(self.sync.get, run_id, key)

    async def wait_for(self, run_id: str, key: str, timeout: float = 60.0) -> Any:
        """As Client.wait_for, without holding a thread while it waits."""
        from ..engine.authoring import InputError
        from ..engine.published import NotPublishedError, PublishedWaitTimeoutError, check_key

        check_id(run_id, "run id")
        check_key(key)
        if wait_seconds(timeout) is None or timeout < 0:
            raise InputError(f"timeout must be a finite number of seconds >= 0, not "
                             f"{timeout!r}")
        deadline = time.monotonic() + timeout
        last = await self.aio.xrevrange(self.sync.reader.keys.output(run_id), count=1)
        after = last[0][0].decode() if last else "0-0"
        try:
            return await self.get(run_id, key)
        except NotPublishedError:
            if last and last[0][1].get(b"t") == b"final":
                raise NotPublishedError(f"run {run_id} finished without publishing "
                                        f"{key!r}") from None
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise PublishedWaitTimeoutError(
                    f"run {run_id} did not publish {key!r} within {timeout:g} s")
            for entry in await self.output(run_id, after=after,
                                           block_ms=min(left_ms, BLOCK_SLICE_MS)):
                after = entry.id
                if entry.type == "final" or (entry.type == "published" and isinstance(
                        entry.data, dict) and entry.data.get("key") == key):
                    return await self.get(run_id, key)  # NotPublishedError after a final

    # -- waiting, on redis.asyncio -----------------------------------------------------------

    async def output(self, run_id: str, *, after: str = "0-0", block_ms: int | None = None,
                     count: int = 1000) -> list[OutputEntry]:
        key = self.sync.reader.keys.output(check_id(run_id, "run id"))
        if block_ms is None:
            rows = await self.aio.xrange(key, min=f"({after}" if after != "0-0" else "-",
                                         count=count)
        else:
            reply = await self.aio.xread({key: after}, count=count, block=block_ms)
            rows = reply[0][1] if reply else []
        return [_entry(self.sync.reader.store, eid, fields) for eid, fields in rows]

    async def result(self, run_id: str, timeout: float | None = None, *,
                     type: Any = Any) -> Any:
        """As Client.result, without holding a thread while it waits."""
        check_id(run_id, "run id")
        timeout = wait_seconds(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        key = self.sync.reader.keys.output(run_id)
        rows = await self.aio.xrevrange(key, count=1)
        last = _entry(self.sync.reader.store, *rows[0]) if rows else None
        while True:
            if last is not None and last.type == "final":
                return settle(run_id, last.data, type)
            left_ms = BLOCK_SLICE_MS if deadline is None else int(
                (deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise ResultTimeoutError(f"run {run_id} did not finish within {timeout} s")
            entries = await self.output(run_id, after="0-0" if last is None else last.id,
                                        block_ms=max(1, min(left_ms, BLOCK_SLICE_MS)))
            for entry in entries:
                last = entry
                if entry.type == "final":
                    break
            if not entries and last is None and not await self.aio.exists(
                    self.sync.reader.keys.run(run_id)):
                raise RunNotFoundError(f"no run with id {run_id!r}")

    async def watch(self, run_id: str, *, after: str = "0-0", follow: bool = True
                    ) -> AsyncIterator[OutputEntry]:
        while True:
            entries = await self.output(run_id, after=after,
                                        block_ms=BLOCK_SLICE_MS if follow else None)
            for entry in entries:
                yield entry
                after = entry.id
                if entry.type == "final":
                    return
            if not follow and len(entries) < 1000:
                return

    # -- sessions (marbles_rq/sessions/) -----------------------------------------------------

    async def session(self, session_id: str) -> AsyncSession:
        """Create-or-get the session `session_id` (see Client.session); its `follow` is an
        async iterator on redis.asyncio."""
        from ..sessions import AsyncSession

        return AsyncSession(await self._call(self.sync.session, session_id),
                            lambda: self.aio)

    async def sessions(self, *, limit: int | None = None) -> SessionListing:
        return await self._call(self.sync.sessions, limit=limit)

    async def session_info(self, session_id: str) -> SessionInfo:
        return await self._call(self.sync.session_info, session_id)

    async def session_messages(self, session_id: str, *, after: int = 0,
                               limit: int | None = None) -> list[Message]:
        return await self._call(self.sync.session_messages, session_id, after=after,
                                limit=limit)

    async def delete_session(self, session_id: str) -> int:
        return await self._call(self.sync.delete_session, session_id)

    async def run_sessions(self, run_id: str) -> list[str]:
        return await self._call(self.sync.run_sessions, run_id)


def _connect_async(url: str) -> Any:
    return connect_redis_async(url)


def _entry(store: Any, eid: bytes, fields: dict[bytes, bytes]) -> OutputEntry:
    ident = eid.decode()
    try:
        event = OutputEvent(ident, fields[b"t"].decode(), int(fields[b"a"]),
                            open_event(store, msgspec.json.decode(fields[b"d"])))
    except (KeyError, ValueError, UnicodeDecodeError, msgspec.DecodeError) as exc:
        event = OutputEvent(ident, "unreadable", 0, {"error": repr(exc)})
    return entry_of(event)


class AsyncRunHandle:
    def __init__(self, client: AsyncClient, run_id: str, *, created: bool | None = None,
                 workflow: str | None = None, queue: str | None = None,
                 initial_status: str | None = None) -> None:
        self.client, self.id, self.created, self.workflow = client, run_id, created, workflow
        self.queue, self.initial_status = queue, initial_status  # as RunHandle's
        self.decision: Decision | None = None

    def __repr__(self) -> str:
        return f"AsyncRunHandle({self.id!r}, created={self.created})"

    async def status(self) -> RunStatus:
        return await self.client.status(self.id)

    async def result(self, timeout: float | None = None, *, type: Any = Any) -> Any:
        return await self.client.result(self.id, timeout, type=type)

    async def cancel(self, *, compensate: bool = False) -> Outcome:
        return await self.client.cancel(self.id, compensate=compensate)

    async def pause(self) -> Outcome:
        return await self.client.pause(self.id)

    async def resume(self) -> Outcome:
        return await self.client.resume(self.id)

    async def retry(self, input_patch: Any = None) -> Outcome:
        return await self.client.retry(self.id, input_patch)

    async def fail(self, reason: str | None = None) -> Outcome:
        return await self.client.fail(self.id, reason)

    async def answer(self, key: str, value: Any) -> Outcome:
        return await self.client.answer(self.id, key, value)

    async def approve(self, key: str, note: str | None = None) -> Outcome:
        return await self.client.approve(self.id, key, note)

    async def reject(self, key: str, note: str | None = None) -> Outcome:
        return await self.client.reject(self.id, key, note)

    def watch(self, *, after: str = "0-0", follow: bool = True) -> AsyncIterator[OutputEntry]:
        return self.client.watch(self.id, after=after, follow=follow)

    async def get(self, key: str) -> Any:
        return await self.client.get(self.id, key)

    async def signal(self, name: str, payload: Any = None, *,
                     request_id: str | None = None) -> Any:
        return await self.client.signal(self.id, name, payload, request_id=request_id)

    async def wait_for(self, key: str, timeout: float = 60.0) -> Any:
        return await self.client.wait_for(self.id, key, timeout)
