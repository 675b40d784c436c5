"""The HTTP API of `marbles-rq web`: JSON endpoints under /api/, for services in any
language. Each endpoint is one call of the Python client (the AsyncClient: what waits -- a
result's long-poll, a run's output as server-sent events -- reads Redis on redis.asyncio and
holds no thread), so the API, the CLI and the dashboard never disagree.

ROUTES is the one table of the API: Starlette's routes and the OpenAPI document
(web/openapi.py) are both made from it. Who may call is decided in web/api_auth.py before any
route runs; every refusal is one JSON object (web/api_errors.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Mount, Route

from ..client import AsyncClient, Client, StartRequest
from ..client.errors import RunCancelledError, RunFailedError
from ..client.views import Outcome, OutputEntry, RunError, RunsPage, RunStatus
from ..deployment import Settings
from ..engine.ops import MAX_DEPTH, json_depth_exceeds
from ..engine.runs import STATUSES
from ..store.ids import check_id
from ..store.redis_errors import one_line
from . import api_sessions
from .api_auth import ApiGuard
from .api_errors import ApiError, error_response, log, response_for
from .api_models import (
    AnswerBody,
    ArtifactDetail,
    ArtifactRemoved,
    Artifacts,
    ArtifactSummary,
    ArtifactVersionInfo,
    BulkBody,
    BulkDone,
    BulkFailureItem,
    EventBody,
    EventSent,
    FailBody,
    Feed,
    LockHolder,
    Locks,
    NoteBody,
    OpenBatches,
    OpenBatchInfo,
    RateLimit,
    RateLimitBody,
    RateLimits,
    RetryBody,
    RunResult,
    SignalBody,
    SignalSent,
    StartBatchBody,
    StartBody,
    Started,
    StartedBatch,
    State,
)
from .openapi import ApiRoute, Param, document
from .webhooks import BODY_TIMEOUT_S

S = TypeVar("S")

MAX_RESULT_WAIT_S = 60.0  # a result's long-poll waits at most this long (?timeout= is capped)
DEFAULT_RESULT_WAIT_S = 30.0
MAX_WAITING = 500  # long-polls and output streams at once: each holds a Redis connection
MAX_BATCH = 1000  # runs in one POST /api/runs:batch
MAX_BULK_IDS = 10_000  # ids in one POST /api/runs:bulk
BATCH_BODY = 16 << 20  # bytes of one batch body (each input is still held to the limit)
HEARTBEAT_S = 15.0  # a comment on a quiet output stream, so a vanished client's stream ends
SLICE_MS = 1000  # one blocking read of an output stream
ENTRY_ID = re.compile(r"\d{1,20}-\d{1,20}")


@dataclass
class Api:
    """The API's state: the client it calls, the body limit, the waiting requests."""

    client: AsyncClient
    guard: ApiGuard
    limit: int  # bytes of a body (one start, an answer, an event)
    waiting: int = 0
    openapi_doc: bytes | None = None
    max_waiting: int = MAX_WAITING

    # -- request helpers ------------------------------------------------------------------

    async def body(self, request: Request, limit: int | None = None) -> bytes:
        """The request's body, refused (413) once it passes `limit`: from its Content-Length
        before a byte is read, else as it arrives; never read whole beyond the limit."""
        limit = self.limit if limit is None else limit
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise ApiError("payload_too_large", _too_large(limit))
        body = bytearray()
        try:
            with anyio.fail_after(BODY_TIMEOUT_S):  # a body trickled in (slowloris)
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise ApiError("payload_too_large", _too_large(limit))
        except ClientDisconnect:
            raise ApiError("invalid_request", "the client went away") from None
        except TimeoutError:
            raise ApiError("body_timeout", f"the body did not arrive within "
                                           f"{BODY_TIMEOUT_S:.0f} s") from None
        return bytes(body)

    async def json(self, request: Request, model: type[S], *, limit: int | None = None,
                   empty: S | None = None) -> S:
        """The body decoded as `model` (`empty` stands for an empty body, when given)."""
        raw = await self.body(request, limit)
        if not raw.strip():
            if empty is not None:
                return empty
            raise ApiError("malformed_json", f"the body is empty: expected a JSON "
                                             f"{model.__name__} object")
        # The decoder would recurse to a crash; an input sits at most 3 levels down (a batch).
        if json_depth_exceeds(raw, MAX_DEPTH + 3):
            raise ApiError("input_too_deep", f"the body nests arrays or objects deeper "
                                             f"than {MAX_DEPTH + 3} levels")
        try:
            msgspec.json.decode(raw)  # JSON at all? (a typed decode stops at the first misfit)
        except msgspec.DecodeError as exc:
            raise ApiError("malformed_json", f"the body is not JSON: {exc}") from None
        try:
            return msgspec.json.decode(raw, type=model)
        except msgspec.DecodeError as exc:
            raise ApiError("invalid_request", f"the body does not match {model.__name__}: "
                                              f"{exc}") from None

    def take_slot(self) -> None:
        if self.waiting >= self.max_waiting:
            raise ApiError("busy", f"{self.max_waiting} requests are waiting already "
                                   f"(long-polls, output streams): retry later")
        self.waiting += 1

    def give_slot(self) -> None:
        self.waiting -= 1

    # -- starting runs ----------------------------------------------------------------------

    async def start(self, request: Request) -> Response:
        body = await self.json(request, StartBody)
        if body.signal is not None:
            if body.id is None:
                raise ApiError("invalid_request", "signal-with-start needs an id (it makes "
                                                  "the start idempotent)")
            started = await self.client.signal_with_start(
                body.workflow, id=body.id, signal=(body.signal.name, None),
                payload_json=_raw(body.signal.payload), queue=body.queue,
                priority=body.priority, input_json=_input(body))
            return reply(Started(started.run_id, started.created, started.record.name,
                                 started.record.queue, started.status),
                         201 if started.created else 200)
        handle = await self.client.start(body.workflow, id=body.id, queue=body.queue,
                                         priority=body.priority, input_json=_input(body))
        decision = getattr(handle, "decision", None)
        if decision is not None:
            return _gated_reply(handle, decision)
        return reply(_started(handle), 201 if handle.created else 200)

    async def signal(self, request: Request) -> Response:
        run_id = _run_id(request)
        body = await self.json(request, SignalBody, empty=SignalBody())
        sent = await self.client.signal(run_id, request.path_params["name"],
                                        payload_json=_raw(body.payload),
                                        request_id=body.request_id)
        return reply(SignalSent(run_id, sent.name, sent.seq, sent.woken, sent.dispatched))

    async def start_batch(self, request: Request) -> Response:
        batch = await self.json(request, StartBatchBody, limit=max(BATCH_BODY, self.limit))
        if not 1 <= len(batch.runs) <= MAX_BATCH:
            raise ApiError("invalid_request", f"a batch holds 1 to {MAX_BATCH} runs, not "
                                              f"{len(batch.runs)}")
        handles = await self.client.start_many([
            StartRequest(b.workflow, None, id=b.id, queue=b.queue, priority=b.priority,
                         input_json=_input(b)) for b in batch.runs])
        return reply(StartedBatch([_started(h) for h in handles]))

    # -- reading ----------------------------------------------------------------------------

    async def status(self, request: Request) -> Response:
        return reply(await self.client.status(_run_id(request)))

    async def history(self, request: Request) -> Response:
        histories = await self.client.export(_run_id(request))
        return reply(histories[0])

    async def result(self, request: Request) -> Response:
        run_id = _run_id(request)
        timeout = _number(request, "timeout", DEFAULT_RESULT_WAIT_S, 0.0, float("inf"))
        timeout = min(timeout, MAX_RESULT_WAIT_S)
        self.take_slot()
        try:
            waited = await until_disconnected(request,
                                              self.client.result(run_id, timeout=timeout))
        except RunFailedError as exc:
            return reply(RunResult(run_id, "failed", error=_run_error(exc.error)))
        except RunCancelledError as exc:
            return reply(RunResult(run_id, "cancelled", reason=exc.reason))
        finally:
            self.give_slot()
        if waited is _GONE:
            return Response(status_code=499)  # nobody reads it
        return reply(RunResult(run_id, "succeeded", result=waited))

    async def state(self, request: Request) -> Response:
        run_id, key = _run_id(request), request.path_params["key"]
        wait = _number(request, "wait", 0.0, 0.0, float("inf"))
        if not wait:
            return reply(State(run_id, key, await self.client.get(run_id, key)))
        self.take_slot()
        try:
            value = await until_disconnected(request, self.client.wait_for(
                run_id, key, min(wait, MAX_RESULT_WAIT_S)))
        finally:
            self.give_slot()
        if value is _GONE:
            return Response(status_code=499)
        return reply(State(run_id, key, value))

    async def runs(self, request: Request) -> Response:
        q = request.query_params
        if q.get("status") and q["status"] not in STATUSES:
            raise ApiError("invalid_request", f"status must be one of {', '.join(STATUSES)}, "
                                              f"not {q['status'][:40]!r}")
        page: RunsPage = await self.client.runs(
            status=q.get("status") or None, workflow=q.get("workflow") or None,
            queue=q.get("queue") or None,
            since=_number(request, "since", None, 0.0, 1e12),
            until=_number(request, "until", None, 0.0, 1e12),
            limit=int(_number(request, "limit", 50, 1, 10_000, integer=True) or 50),
            cursor=q.get("cursor") or None, tag=q.getlist("tag"))
        return reply(page)

    async def rate_limits(self, request: Request) -> Response:
        found = await self.client.rate_limits()
        return reply(RateLimits([msgspec.convert(i.to_dict(), RateLimit) for i in found]))

    async def set_rate_limit(self, request: Request) -> Response:
        body = await self.json(request, RateLimitBody)
        info = await self.client.set_rate_limit(request.path_params["name"], body.rate,
                                                body.burst)
        return reply(msgspec.convert(info.to_dict(), RateLimit))

    async def reset_rate_limit(self, request: Request) -> Response:
        info = await self.client.reset_rate_limit(request.path_params["name"])
        return reply(msgspec.convert(info.to_dict(), RateLimit))

    async def locks(self, request: Request) -> Response:
        found = await self.client.locks()
        return reply(Locks([msgspec.convert(i.to_dict(), LockHolder) for i in found]))
    # -- artifacts (marbles_rq/artifacts) ----------------------------------------------------

    async def artifacts(self, request: Request) -> Response:
        found = await self.client.artifacts()
        return reply(Artifacts([msgspec.convert(i.to_json(), ArtifactSummary)
                                for i in found]))

    async def artifact(self, request: Request) -> Response:
        handle = self.client.artifact(request.path_params["artifact"])
        versions = await handle.versions()
        info = await self.client._call(self.client.sync.artifact_info, handle.name)
        return reply(ArtifactDetail(info.name, info.latest, info.media_type, [
            msgspec.convert(v.to_json(), ArtifactVersionInfo) for v in versions]))

    async def artifact_content(self, request: Request) -> Response:
        handle = self.client.artifact(request.path_params["artifact"])
        raw = request.path_params.get("version")
        version = None if raw is None else _artifact_version(raw)
        return await artifact_download(handle, version, attachment=False)

    async def put_artifact(self, request: Request) -> Response:
        handle = self.client.artifact(request.path_params["artifact"])
        q = request.query_params
        expect = None if q.get("expect_version") in (None, "") else int(_number(
            request, "expect_version", 0, 0, 1e15, integer=True) or 0)
        meta: Any = None
        if q.get("meta"):
            try:
                meta = msgspec.json.decode(q["meta"])
            except msgspec.DecodeError as exc:
                raise ApiError("invalid_request", f"meta is not JSON: {exc}") from None
        media_type = request.headers.get("content-type") or None
        data = await self.body(request, max(self.limit, ARTIFACT_BODY))
        version = await handle.put(data, expect_version=expect, media_type=media_type,
                                   meta=meta)
        found = await handle.version(version)
        return reply(msgspec.convert(found.to_json(), ArtifactVersionInfo), 201)

    async def delete_artifact(self, request: Request) -> Response:
        handle = self.client.artifact(request.path_params["artifact"])
        raw = request.query_params.get("version")
        removed = await handle.delete(None if not raw else _artifact_version(raw))
        return reply(ArtifactRemoved(handle.name, removed))

    async def feed(self, request: Request) -> Response:
        limit = int(_number(request, "limit", 100, 1, 1000, integer=True) or 100)
        return reply(Feed(await self.client.feed(limit)))

    async def output(self, request: Request) -> Response:
        """The run's output as server-sent events: one event per entry (`id` the entry's id,
        `event` its type, `data` the OutputEntry), ending after `final`. A reconnect that
        sends Last-Event-ID (or ?after=) resumes after that entry."""
        run_id = _run_id(request)
        after = (request.headers.get("last-event-id") or request.query_params.get("after")
                 or "0-0").strip()
        if not ENTRY_ID.fullmatch(after):
            raise ApiError("invalid_id", f"invalid output entry id {after[:40]!r}: expected "
                                         f"<ms>-<seq>")
        keys = self.client.sync.reader.keys
        aio = self.client.aio
        if not await aio.exists(keys.run(run_id)):
            raise ApiError("run_not_found", f"no run with id {run_id!r}")
        newest = await aio.xrevrange(keys.output(run_id), count=1)
        last = _entry_key(newest[0][0].decode()) if newest else (0, 0)
        if _entry_key(after) > last and not (newest and newest[0][1].get(b"t") == b"final"):
            # Entries come in id order: one after an id never served would never be sent,
            # not even `final`, and the stream would never end.
            raise ApiError("invalid_id", f"output entry {after!r} is beyond the run's "
                                         f"output (newest {'-'.join(map(str, last))})")
        if newest and newest[0][1].get(b"t") == b"final" and (
                _entry_key(after) >= _entry_key(newest[0][0].decode())):
            done = True  # resumed after the final entry: nothing more will come
        else:
            done = False

        async def events() -> AsyncIterator[bytes]:
            nonlocal after
            yield b"retry: 1000\n\n"
            quiet_since = time.monotonic()
            while not done:
                try:
                    entries = await self.client.output(run_id, after=after,
                                                       block_ms=SLICE_MS)
                except Exception as exc:
                    # The status line is sent: the refusal travels as a last event, and the
                    # stream ends cleanly (an EventSource reconnects with Last-Event-ID)
                    # rather than being cut with a traceback in the server's log.
                    yield stream_error(exc)
                    return
                for entry in entries:
                    after = entry.id
                    yield sse(entry)
                    if entry.type == "final":
                        return
                if entries:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > HEARTBEAT_S:
                    quiet_since = time.monotonic()
                    yield b": still here\n\n"

        self.take_slot()
        return SlotStream(self, events(), media_type="text/event-stream", headers={
            "Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    # -- acting on runs ---------------------------------------------------------------------

    async def cancel(self, request: Request) -> Response:
        run_id = _run_id(request)
        raw = request.query_params.get("compensate")
        if raw not in (None, "true", "false", "1", "0"):
            raise ApiError("invalid_request", f"compensate must be true or false, not "
                                              f"{raw[:40]!r}")
        return reply(await self.client.cancel(run_id, compensate=raw in ("true", "1")))

    async def pause(self, request: Request) -> Response:
        return reply(await self.client.pause(_run_id(request)))

    async def resume(self, request: Request) -> Response:
        return reply(await self.client.resume(_run_id(request)))

    async def retry(self, request: Request) -> Response:
        run_id = _run_id(request)
        body = await self.json(request, RetryBody, empty=RetryBody())
        return reply(await self.client.retry(run_id, body.input_patch))

    async def fail(self, request: Request) -> Response:
        run_id = _run_id(request)
        body = await self.json(request, FailBody, empty=FailBody())
        return reply(await self.client.fail(run_id, body.reason))

    async def answer(self, request: Request) -> Response:
        run_id = _run_id(request)
        body = await self.json(request, AnswerBody)
        return reply(await self.client.answer(run_id, request.path_params["key"], body.value))

    async def approve(self, request: Request) -> Response:
        run_id = _run_id(request)
        body = await self.json(request, NoteBody, empty=NoteBody())
        return reply(await self.client.approve(run_id, request.path_params["key"], body.note))

    async def reject(self, request: Request) -> Response:
        run_id = _run_id(request)
        body = await self.json(request, NoteBody, empty=NoteBody())
        return reply(await self.client.reject(run_id, request.path_params["key"], body.note))

    async def bulk(self, request: Request) -> Response:
        from ..client.bulk import ACTIONS
        from ..engine.selection import RunFilter

        body = await self.json(request, BulkBody, limit=max(BATCH_BODY, self.limit))
        if body.action not in ACTIONS:
            raise ApiError("invalid_request", f"action must be one of {', '.join(ACTIONS)}, "
                                              f"not {body.action[:40]!r}")
        if (body.filter is None) == (body.ids is None):
            raise ApiError("invalid_request", "give a filter or ids (one of the two)")
        target: Any
        if body.filter is not None:
            f = body.filter
            target = RunFilter.build(status=f.status, workflow=f.workflow, queue=f.queue,
                                     since=f.since, until=f.until, tags=f.tags,
                                     question=f.question)
            # What is selected now: reruns made by this operation are not swept in.
            unpinned = target
            target = dataclasses.replace(target, until=time.time() if target.until is None
                                         else min(target.until, time.time()))
        else:
            target = unpinned = [check_id(i, "run id") for i in body.ids or []]
            if len(target) > MAX_BULK_IDS:
                raise ApiError("invalid_request", f"at most {MAX_BULK_IDS} ids at once")
        if body.dry_run:
            if isinstance(target, list):
                return reply(BulkDone(body.action, len(target), dry_run=True,
                                      sample=target[:10]))
            count, sample = await self.client.count(target, 10)
            return reply(BulkDone(body.action, count, dry_run=True, sample=sample))
        options: dict[str, Any] = {}
        if body.action in ("approve", "reject"):
            options = {"key": body.key, "note": body.note}
        elif body.action == "rerun":
            from ..client.bulk import rerun_key

            # Keyed by the filter as sent (before `until` was pinned): the same request
            # again finds the reruns it made.
            options = {"from_step": body.from_step,
                       "rerun_key": rerun_key(unpinned, body.from_step)}
        done = await self.client.bulk(body.action, target, **options)
        return reply(BulkDone(done.action, done.matched, done.done, done.skipped,
                              done.failed, [BulkFailureItem(f.run_id, f.message)
                                            for f in done.failures]))

    # -- events -----------------------------------------------------------------------------

    async def send_event(self, request: Request) -> Response:
        body = await self.json(request, EventBody, limit=self.limit)
        sent = await self.client.send_event(body.source, body.id, body.type, body.payload)
        return reply(EventSent(sent.key, sent.created, sent.state, sent.workflow or None,
                               sent.run_id or None), 202 if sent.created else 200)

    async def batches(self, request: Request) -> Response:
        found = await self.client.open_batches()
        return reply(OpenBatches([OpenBatchInfo(**b.to_json()) for b in found]))

    # -- the document -----------------------------------------------------------------------

    async def openapi(self, request: Request) -> Response:
        if self.openapi_doc is None:
            self.openapi_doc = msgspec.json.encode(document(ROUTES))
        return Response(self.openapi_doc, media_type="application/json")


# -- helpers -------------------------------------------------------------------------------

_GONE = object()


class SlotStream(StreamingResponse):
    """A stream that gives its waiting slot back however it ends (finished, the client
    gone, or never started)."""

    def __init__(self, api: Api, content: AsyncIterator[bytes], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.api = api

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.api.give_slot()


async def until_disconnected(request: Request, waiting: Awaitable[Any]) -> Any:
    """`waiting`'s value, or _GONE when the client hangs up first (the wait is cancelled:
    a long-poll nobody reads holds no Redis connection)."""
    task = asyncio.ensure_future(waiting)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return _GONE


def _too_large(limit: int) -> str:
    return f"the body is larger than {limit} bytes"


def reply(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type="application/json")


def sse(entry: OutputEntry) -> bytes:
    # JSON text holds no raw newline, so `data` is one line.
    return (f"id: {entry.id}\nevent: {entry.type}\ndata: ".encode()
            + msgspec.json.encode(entry) + b"\n\n")


def stream_error(exc: Exception) -> bytes:
    """The last event of an output stream that could not go on: `event: api_error`, `data`
    the API's one-line error object (an event named `error` would reach an EventSource's
    onerror, which is its connection's)."""
    reply = response_for(exc)
    log.warning("output stream ended: %s", one_line(exc))
    return b"event: api_error\ndata: " + bytes(reply.body) + b"\n\n"


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _run_id(request: Request) -> str:
    return check_id(request.path_params["id"], "run id")


def _raw(value: msgspec.Raw | msgspec.UnsetType) -> bytes:
    return bytes(value) if isinstance(value, msgspec.Raw) else b"null"


def _input(body: StartBody) -> bytes | None:
    if isinstance(body.input, msgspec.Raw) and bytes(body.input).strip() != b"null":
        return bytes(body.input)
    return None  # absent or null: the workflow's default input


def _gated_reply(handle: Any, decision: Any) -> Response:
    """A gated start's answer: 201 when it made a run or a window (started,
    cancelled_running), else 200 (merged, skipped, dropped: not an error, the decision says
    what happened; a drop carries Retry-After)."""
    started = Started(handle.id or "", bool(handle.created), handle.workflow,
                      getattr(handle, "queue", None), getattr(handle, "initial_status", None),
                      decision=decision.to_json())
    if decision.outcome == "dropped":
        wait = max(1, int(decision.to_json()["retry_after_s"] + 0.999))
        return Response(msgspec.json.encode(started), 200, media_type="application/json",
                        headers={"Retry-After": str(wait)})
    made = decision.outcome in ("started", "cancelled_running") and handle.created
    return reply(started, 201 if made else 200)


def _started(handle: Any) -> Started:
    return Started(handle.id, bool(handle.created), handle.workflow,
                   getattr(handle, "queue", None), getattr(handle, "initial_status", None))


def _run_error(error: dict[str, Any]) -> RunError:
    try:
        return msgspec.convert(error, RunError)
    except msgspec.ValidationError:
        return RunError(str(error.get("type", "?")), str(error.get("message", error)))


def _number(request: Request, name: str, default: Any, low: float, high: float, *,
            integer: bool = False) -> Any:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value: float = int(raw) if integer else float(raw)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:  # (NaN fails too)
        kind = "an integer" if integer else "a number"
        raise ApiError("invalid_request", f"{name} must be {kind} from {low:g} to {high:g}, "
                                          f"not {raw[:40]!r}")
    return value


async def artifact_download(handle: Any, version: int | None, *,
                            attachment: bool) -> Response:
    """A version's content streamed as it is read (the HTTP API, the dashboard's download):
    the version is looked up first, so an unknown one is refused before a byte is sent."""
    found, pieces = await handle.download(version)
    disposition = "attachment" if attachment else "inline"
    filename = f"{found.name}-v{found.version}"
    return StreamingResponse(pieces, media_type=found.media_type or "application/octet-stream",
                             headers={"Content-Length": str(found.size),
                                      "ETag": f'"{found.sha256}"',
                                      "X-Artifact-Version": str(found.version),
                                      "Content-Disposition":
                                          f'{disposition}; filename="{filename}"'})


def _artifact_version(raw: str) -> int:
    if not raw.isdigit() or len(raw) > 15 or int(raw) < 1:
        raise ApiError("invalid_request", f"an artifact version is a whole number >= 1, not "
                                          f"{raw[:40]!r}")
    return int(raw)


# -- the table -----------------------------------------------------------------------------

RUN_REFUSALS = ("invalid_id", "run_not_found")
BODY_REFUSALS = ("malformed_json", "invalid_request", "payload_too_large", "body_timeout",
                 "input_too_deep")
START_REFUSALS = (*BODY_REFUSALS, "invalid_input", "unknown_workflow", "invalid_id",
                  "invalid_signal", "run_settled")
ANSWER_REFUSALS = (*RUN_REFUSALS, *BODY_REFUSALS, "unknown_question", "answer_refused",
                   "already_answered")

ARTIFACT_REFUSALS = ("invalid_artifact", "unknown_artifact")
ARTIFACT_BODY = 256 << 20  # bytes of one artifact's content sent to PUT

ROUTES: list[ApiRoute] = [
    ApiRoute("POST", "/api/runs", Api.start, "Start a run (idempotent on `id`)",
             body=StartBody, reply=Started, status=(201, 200), refusals=START_REFUSALS),
    ApiRoute("POST", "/api/runs:batch", Api.start_batch,
             "Start many runs: all are checked first, one bad request starts none",
             body=StartBatchBody, reply=StartedBatch, refusals=START_REFUSALS),
    ApiRoute("GET", "/api/runs", Api.runs, "Runs, newest first, a page at a time",
             reply=RunsPage, query=(
                 Param("status", "string", "queued | running | waiting | succeeded | "
                                           "failed | cancelled"),
                 Param("workflow", "string", "the workflow's name"),
                 Param("queue", "string", "the queue's name"),
                 Param("since", "number", "created at or after (epoch seconds)"),
                 Param("until", "number", "created before (epoch seconds)"),
                 Param("limit", "integer", "runs a page, 1 to 10000 (default 50)"),
                 Param("cursor", "string", "the previous page's `cursor`"),
                 Param("tag", "string", "key=value: runs carrying this tag (repeat: "
                                        "every one)")),
             refusals=("invalid_request", "invalid_id", "invalid_input", "invalid_tag")),
    ApiRoute("POST", "/api/runs:bulk", Api.bulk,
             "Cancel, pause, resume, rerun, approve or reject many runs: those a filter "
             "selects, or a list of ids; runs with nothing to do are skipped with a reason",
             body=BulkBody, reply=BulkDone,
             refusals=(*BODY_REFUSALS, "invalid_filter", "invalid_tag", "invalid_id",
                       "invalid_input")),
    ApiRoute("GET", "/api/runs/{id}", Api.status,
             "A run's status (`marbles-rq status --json`)", reply=RunStatus,
             refusals=RUN_REFUSALS),
    ApiRoute("GET", "/api/runs/{id}/history", Api.history,
             "A run's history (`marbles-rq export`'s line): what `replay --check --from` "
             "replays against new code (`kind` history, `version` 1)",
             reply=dict[str, Any], refusals=RUN_REFUSALS),
    ApiRoute("GET", "/api/runs/{id}/result", Api.result,
             "Wait for a run to finish (long-poll) and answer its result, its error or "
             "its cancellation; 408 `timeout` if it has not finished in time",
             reply=RunResult, query=(Param("timeout", "number", (
                 f"seconds to wait (default {DEFAULT_RESULT_WAIT_S:g}, at most "
                 f"{MAX_RESULT_WAIT_S:g}; 0: answer at once)")),),
             refusals=(*RUN_REFUSALS, "invalid_request", "timeout", "busy")),
    ApiRoute("GET", "/api/runs/{id}/output", Api.output,
             "The run's output as server-sent events, ending after `final` (Last-Event-ID "
             "resumes)", reply=OutputEntry, stream=True,
             query=(Param("after", "string", "resume after this entry id (as "
                                             "Last-Event-ID)"),),
             refusals=(*RUN_REFUSALS, "busy")),
    ApiRoute("POST", "/api/runs/{id}/cancel", Api.cancel,
             "Cancel a run and its children", reply=Outcome,
             query=(Param("compensate", "string", "true: run the undos its steps registered "
                                                  "first, then end it cancelled"),),
             refusals=(*RUN_REFUSALS, "invalid_request")),
    ApiRoute("POST", "/api/runs/{id}/pause", Api.pause, "Pause a run", reply=Outcome,
             refusals=(*RUN_REFUSALS, "run_settled")),
    ApiRoute("POST", "/api/runs/{id}/resume", Api.resume, "Resume a paused run",
             reply=Outcome, refusals=(*RUN_REFUSALS, "run_settled", "not_paused")),
    ApiRoute("POST", "/api/runs/{id}/retry", Api.retry,
             "Run the failed step a run is paused on again (the body may be empty; "
             "`input_patch` changes its input first)", body=RetryBody, reply=Outcome,
             refusals=(*RUN_REFUSALS, *BODY_REFUSALS, "not_failed_step", "patch_refused")),
    ApiRoute("POST", "/api/runs/{id}/fail", Api.fail,
             "Give up the failed step a run is paused on (the body may be empty)",
             body=FailBody, reply=Outcome,
             refusals=(*RUN_REFUSALS, *BODY_REFUSALS, "not_failed_step", "invalid_input")),
    ApiRoute("POST", "/api/runs/{id}/questions/{key}/answer", Api.answer,
             "Answer a question (the first answer wins)", body=AnswerBody, reply=Outcome,
             refusals=ANSWER_REFUSALS),
    ApiRoute("POST", "/api/runs/{id}/questions/{key}/approve", Api.approve,
             "Approve an approval (the body may be empty)", body=NoteBody, reply=Outcome,
             refusals=ANSWER_REFUSALS),
    ApiRoute("POST", "/api/runs/{id}/questions/{key}/reject", Api.reject,
             "Reject an approval (the body may be empty)", body=NoteBody, reply=Outcome,
             refusals=ANSWER_REFUSALS),
    # -- signals and published state: added by that work, each one client call ------------
    ApiRoute("POST", "/api/runs/{id}/signals/{name}", Api.signal,
             "Send a signal to a run (the body may be empty: a null payload); a run parked "
             "for it is woken", body=SignalBody, reply=SignalSent,
             refusals=(*RUN_REFUSALS, *BODY_REFUSALS, "invalid_signal", "run_settled",
                       "signal_buffer_full")),
    ApiRoute("GET", "/api/runs/{id}/state/{key}", Api.state,
             "A value the run published under `key` (`ctx.publish`); with `wait`, wait "
             "until it is published (long-poll)", reply=State,
             query=(Param("wait", "number", (f"seconds to wait for it (at most "
                                             f"{MAX_RESULT_WAIT_S:g}; default 0: answer "
                                             f"at once)")),),
             refusals=(*RUN_REFUSALS, "invalid_request", "invalid_publish", "not_published",
                       "published_wait_timeout", "busy")),
    ApiRoute("GET", "/api/feed", Api.feed, "Open questions and approvals, oldest first",
             reply=Feed, query=(Param("limit", "integer", "1 to 1000 (default 100)"),),
             refusals=("invalid_request",)),
    ApiRoute("POST", "/api/events", Api.send_event,
             "Record an inbound event (202 new, 200 received before)", body=EventBody,
             reply=EventSent, status=(202, 200),
             refusals=(*BODY_REFUSALS, "invalid_event", "invalid_input")),
    ApiRoute("GET", "/api/events/batches", Api.batches,
             "Open event batches (`@mr.on_event(batch=...)`), oldest first", reply=OpenBatches),
    # -- rate limits (flow/rate_limits.py) -----------------------------------------------
    ApiRoute("GET", "/api/limits", Api.rate_limits, "Rate limits: rate, burst, held runs",
             reply=RateLimits),
    ApiRoute("PUT", "/api/limits/{name}", Api.set_rate_limit,
             "Set a rate limit's rate (or every limit of a workflow) until it is reset",
             body=RateLimitBody, reply=RateLimit,
             refusals=(*BODY_REFUSALS, "invalid_rate", "unknown_rate_limit")),
    ApiRoute("DELETE", "/api/limits/{name}", Api.reset_rate_limit,
             "Back to the rate the source declares", reply=RateLimit,
             refusals=("invalid_rate", "unknown_rate_limit")),
    # -- locks (flow/locks.py) ---------------------------------------------------------
    ApiRoute("GET", "/api/locks", Api.locks, "Locks: each one's holder and waiters in order",
             reply=Locks),
    # -- sessions (web/api_sessions.py) ------------------------------------------------------
    ApiRoute("GET", "/api/sessions", api_sessions.sessions,
             "Sessions (conversation transcripts), newest activity first",
             reply=api_sessions.SessionList, refusals=("invalid_request",),
             query=(Param("limit", "integer", "at most this many"),)),
    ApiRoute("GET", "/api/sessions/{id}", api_sessions.session,
             "A session and its messages after `after`", reply=api_sessions.SessionDetail,
             refusals=(*api_sessions.SESSION_REFUSALS, "invalid_request",
                       "invalid_message"),
             query=(Param("after", "integer", "only the messages after this position"),
                    Param("limit", "integer", "at most this many messages (1000)"))),
    ApiRoute("POST", "/api/sessions/{id}/messages", api_sessions.append_message,
             "Append a message (a JSON object) to a session, creating it if needed; "
             "idempotent on `key`", body=api_sessions.MessageBody,
             reply=api_sessions.MessageAppended, status=(201, 200),
             refusals=(*BODY_REFUSALS, *api_sessions.SESSION_REFUSALS, "invalid_message")),
    # -- artifacts (marbles_rq/artifacts) ------------------------------------------------
    ApiRoute("GET", "/api/artifacts", Api.artifacts,
             "Artifacts (versioned outputs): latest version, versions kept", reply=Artifacts),
    ApiRoute("GET", "/api/artifacts/{artifact}", Api.artifact,
             "An artifact and every version it keeps", reply=ArtifactDetail,
             refusals=ARTIFACT_REFUSALS),
    ApiRoute("GET", "/api/artifacts/{artifact}/content", Api.artifact_content,
             "The latest version's content (raw bytes, its media type)",
             raw="application/octet-stream",
             refusals=(*ARTIFACT_REFUSALS, "unknown_artifact_version")),
    ApiRoute("GET", "/api/artifacts/{artifact}/versions/{version}/content",
             Api.artifact_content, "A version's content (raw bytes, its media type)",
             raw="application/octet-stream",
             refusals=(*ARTIFACT_REFUSALS, "unknown_artifact_version", "invalid_request")),
    ApiRoute("PUT", "/api/artifacts/{artifact}/content", Api.put_artifact,
             "Store the body (raw bytes; Content-Type is the media type) as the next "
             "version; 409 `artifact_conflict` when `expect_version` is not the latest",
             reply=ArtifactVersionInfo, status=(201,), raw="application/octet-stream",
             query=(Param("expect_version", "integer", "write only if the latest version "
                                                       "is this one (0: none yet)"),
                    Param("meta", "string", "the version's metadata, JSON")),
             refusals=("invalid_artifact", "invalid_request", "payload_too_large",
                       "body_timeout", "artifact_conflict")),
    ApiRoute("DELETE", "/api/artifacts/{artifact}", Api.delete_artifact,
             "Remove a version (?version=N) or every version; numbers are not reused",
             reply=ArtifactRemoved, query=(Param("version", "integer", "only this one"),),
             refusals=(*ARTIFACT_REFUSALS, "unknown_artifact_version", "invalid_request")),
    ApiRoute("GET", "/api/openapi.json", Api.openapi,
             "This document (needs no token)", open=True),
]


# -- the app -------------------------------------------------------------------------------

def create_api(settings: Settings, guard: ApiGuard, limit: int) -> Mount:
    """The /api mount: the routes of ROUTES behind `guard`, every refusal JSON; `limit`:
    bytes of a request body (a batch may hold more, each input still held to its limit)."""
    api = Api(AsyncClient(Client(settings)), guard, limit)

    def endpoint(route: ApiRoute) -> Callable[[Request], Awaitable[Response]]:
        async def call(request: Request) -> Response:
            try:
                return await route.handler(api, request)
            except Exception as exc:  # every refusal is one JSON object, never a traceback
                return response_for(exc)
        return call

    async def not_found(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return error_response("method_not_allowed",
                                  f"{request.method} is not allowed on {request.url.path}")
        return error_response("not_found", f"no API endpoint {request.url.path}")

    inner = Starlette(routes=[Route(_routed(r.path), endpoint(r), methods=[r.method])
                              for r in ROUTES],
                      exception_handlers={404: not_found, 405: not_found})
    inner.router.redirect_slashes = False
    return Mount("/api", app=Guarded(inner, guard))


def _routed(path: str) -> str:
    """A route's path under the mount. Question keys, signal names and published keys may
    hold '/' (sent as %2F, which the server decodes before routing): they match it; run
    ids never hold one."""
    for name in ("key", "name"):
        path = path.replace(f"{{{name}}}", f"{{{name}:path}}")
    return path.removeprefix("/api")


class Guarded:
    """The API behind its guard: a refused request reaches no route (and reads no body)."""

    def __init__(self, app: Any, guard: ApiGuard) -> None:
        self.app, self.guard = app, guard

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self.guard.refusal(Request(scope))
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)
