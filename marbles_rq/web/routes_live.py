"""The dashboard's live views: each page's live part is a fragment that /sse/<page> renders
again every second and sends when it changed (one render per view, shared by every viewer);
a run's output is its own stream (/sse/run/<id>/output), appended as it grows. What these
cost one process is bounded whatever clients ask (StreamSlots, SharedRenders).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import anyio
import markupsafe
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from ..errors import InvalidIdError
from ..store.ids import check_id
from . import reads
from .endpoint import CSRF_MARK, TROUBLE, Web, why_for
from .routes_runs import runs_params
from .security import CSRF_COOKIE, Guard

LIVE_EVERY_S = 1.0
MAX_STREAMS = 128  # live connections (SSE) at once; more are refused (503), pages still load
MAX_VIEWS = 16  # distinct live views (a page, a filter, a run) at once; more are refused
LIVE_SHARE = 0.25  # at most this share of one thread's time goes to rendering live views
OUTPUT_POLLS_PER_S = 20.0  # output streams' reads of Redis a second, all streams together
HEARTBEAT_S = 15.0  # a comment on a quiet stream, so a vanished client's stream ends

Endpoint = Callable[[Request], Awaitable[Response]]


def view_key(page: str, request: Request) -> tuple[Any, ...]:
    """What a fragment depends on, as the server reads it (never the raw query or a
    cookie): streams asking for the same view share one render."""
    if page == "run":
        return (page, request.query_params.get("id", ""))
    if page != "runs":
        return (page,)
    params = runs_params(request)
    return (page, *(params[k] for k in sorted(params)))


def routes(web: Web, fragments: dict[str, Callable[[Request], str]]) -> list[BaseRoute]:
    """/sse/<page> for the pages whose fragments are `fragments`, and a run's output; both
    take their slots from one StreamSlots."""
    streams = StreamSlots(MAX_STREAMS, MAX_VIEWS)
    return [
        Route("/sse/run/{run_id}/output", output_stream(web, streams)),
        Route("/sse/{page}", page_stream(web, fragments, SharedRenders(), streams)),
    ]


def _refusal(guard: Guard, request: Request) -> Response | None:
    if _foreign(request):
        # A page of another site may open streams (EventSource needs no CORS to be
        # sent): it cannot read them, but each one costs this server work.
        return PlainTextResponse("live views answer only pages of this dashboard "
                                 "(Origin does not match)", 403)
    if not guard.may_read(request):
        return PlainTextResponse("sign in first", 401)
    return None


def page_stream(web: Web, fragments: dict[str, Callable[[Request], str]],
                shared: SharedRenders, streams: StreamSlots) -> Endpoint:
    guard = web.guard

    async def live(request: Request) -> Response:
        refusal = _refusal(guard, request)
        if refusal is not None:
            return refusal
        page = request.path_params["page"]
        render = fragments.get(page)
        if render is None:
            return PlainTextResponse("no such page", 404)
        if page == "run":
            try:
                check_id(request.query_params.get("id", ""), "run id")
            except InvalidIdError as exc:
                return PlainTextResponse(str(exc), 400)
        key = view_key(page, request)
        if not streams.take(key):
            return _too_many(streams)
        csrf = str(markupsafe.escape(request.cookies.get(CSRF_COOKIE, "")))
        detail = guard.authenticated(request)

        async def stream() -> AsyncIterator[str]:
            last = ""
            quiet_since = time.monotonic()
            yield "retry: 2000\n\n"
            while not await request.is_disconnected():
                try:
                    html = await shared.get(key, lambda: render(request))
                except TROUBLE as exc:
                    yield _sse("problem", why_for(exc, detail))
                else:
                    html = html.replace(CSRF_MARK, csrf)
                    digest = hashlib.sha256(html.encode()).hexdigest()
                    if digest != last:
                        last = digest
                        quiet_since = time.monotonic()
                        yield _sse("refresh", html)
                if time.monotonic() - quiet_since > HEARTBEAT_S:
                    quiet_since = time.monotonic()
                    yield ": still here\n\n"  # a peer gone without a FIN is found out
                await anyio.sleep(LIVE_EVERY_S)

        return _stream(stream(), streams, key)

    return live


def output_stream(web: Web, streams: StreamSlots) -> Endpoint:
    guard = web.guard
    settings = web.settings

    async def run_output(request: Request) -> Response:
        refusal = _refusal(guard, request)
        if refusal is not None:
            return refusal
        try:
            run_id = check_id(request.path_params["run_id"], "run id")
        except InvalidIdError as exc:
            return PlainTextResponse(str(exc), 400)
        after = (request.headers.get("last-event-id") or request.query_params.get("after")
                 or "0-0")
        if not _ENTRY_ID.fullmatch(after):  # else Redis refuses it, four times a second
            return PlainTextResponse(f"invalid output entry id {after[:40]!r}: expected "
                                     f"<ms>-<seq>", 400)

        key = ("output", run_id)
        if not streams.take(key):
            return _too_many(streams)
        detail = guard.authenticated(request)

        async def stream() -> AsyncIterator[str]:
            nonlocal after
            quiet_since = time.monotonic()
            yield "retry: 2000\n\n"
            while not await request.is_disconnected():
                try:
                    rows = await run_in_threadpool(reads.output_after, settings, run_id,
                                                   after)
                except TROUBLE as exc:
                    yield _sse("problem", why_for(exc, detail))
                    rows = []
                for entry_id, kind, text, at_ms in rows:
                    after = entry_id
                    quiet_since = time.monotonic()
                    yield _sse("line", json.dumps({"id": entry_id, "type": kind,
                                                   "text": text,
                                                   "at": reads.iso(at_ms)[11:]}), entry_id)
                    if kind == "final":
                        yield _sse("final", kind)
                        return  # the page closes its stream on it; nothing follows
                if time.monotonic() - quiet_since > HEARTBEAT_S:
                    quiet_since = time.monotonic()
                    yield ": still here\n\n"
                if not rows:
                    # At most OUTPUT_POLLS_PER_S polls a second for all streams together.
                    await anyio.sleep(max(0.25, streams.count("output") / OUTPUT_POLLS_PER_S))

        return _stream(stream(), streams, key)

    return run_output


class SharedRenders:
    """One render of a live fragment per view and second, shared by every stream that asks
    for it meanwhile (a hundred idle tabs, or a hundred idle scripts, cost one render).
    Renders of all views take turns, each followed by a pause three times as long as it
    took: live views cost at most LIVE_SHARE of a thread however many views are open and
    however slow their reads are (a slow view is refreshed less often, not more work)."""

    def __init__(self) -> None:
        self._last: dict[Any, tuple[float, asyncio.Future[str]]] = {}
        self._turn = asyncio.Lock()
        self._next_at = 0.0

    async def get(self, key: Any, render: Callable[[], str]) -> str:
        now = time.monotonic()
        hit = self._last.get(key)
        if hit is None or (hit[1].done() and now - hit[0] >= LIVE_EVERY_S * 0.9):
            if len(self._last) > 1000:
                self._last = {k: v for k, v in self._last.items() if now - v[0] < 5}
            hit = self._last[key] = (now, asyncio.ensure_future(self._render(render)))
        return await asyncio.shield(hit[1])

    async def _render(self, render: Callable[[], str]) -> str:
        async with self._turn:
            pause = self._next_at - time.monotonic()
            if pause > 0:
                await anyio.sleep(pause)
            t0 = time.monotonic()
            try:
                return await run_in_threadpool(render)
            finally:
                took = time.monotonic() - t0
                self._next_at = time.monotonic() + took * (1 / LIVE_SHARE - 1)


class StreamSlots:
    """Live streams at once (at most `size`) and the distinct views they show (at most
    `views`): what one process spends on live views is bounded whatever clients ask."""

    def __init__(self, size: int, views: int) -> None:
        self.size, self.views, self.used = size, views, 0
        self.by_view: dict[Any, int] = {}

    def take(self, key: Any) -> bool:
        if self.used >= self.size:
            return False
        views = sum(1 for k in self.by_view if k[0] != "output")
        if key[0] != "output" and key not in self.by_view and views >= self.views:
            return False
        self.used += 1
        self.by_view[key] = self.by_view.get(key, 0) + 1
        return True

    def give(self, key: Any) -> None:
        self.used -= 1
        left = self.by_view.get(key, 1) - 1
        if left > 0:
            self.by_view[key] = left
        else:
            self.by_view.pop(key, None)

    def count(self, kind: str) -> int:
        return sum(n for k, n in self.by_view.items() if k[0] == kind)


def _too_many(slots: StreamSlots) -> Response:
    return PlainTextResponse(f"too many live connections or views (at most {slots.size} "
                             f"streams, {slots.views} distinct views): reload later", 503,
                             headers={"Retry-After": "10"})


def _foreign(request: Request) -> bool:
    """A request a browser sent for a page of another origin (Origin, or Sec-Fetch-Site)."""
    origin = request.headers.get("origin")
    if origin is not None and (origin == "null" or urlsplit(origin).netloc.lower()
                               != request.headers.get("host", "").lower()):
        return True
    return request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin",
                                                                         "none")


_SSE_LINES = re.compile(r"\r\n|\r|\n")
_ENTRY_ID = re.compile(r"[0-9]{1,19}-[0-9]{1,19}")


def _sse(event: str, data: str, entry_id: str | None = None) -> str:
    lines = [f"event: {event}"]
    if entry_id:
        lines.append(f"id: {entry_id}")
    # Every line break SSE knows (CR LF, CR, LF) starts a new data line: a bare CR in a
    # question or an error (text the page escapes, but does not strip) would otherwise end
    # the field and let the rest be read as one of its own ("event: ...", "retry: ...").
    lines += [f"data: {line}" for line in _SSE_LINES.split(data)]
    return "\n".join(lines) + "\n\n"


class _SlotStream(StreamingResponse):
    """An event stream that gives its slot back however it ends (even when the client left
    before its first byte, and the generator never started)."""

    slots: StreamSlots
    key: Any

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slots.give(self.key)


def _stream(gen: AsyncIterator[str], slots: StreamSlots, key: Any) -> StreamingResponse:
    response = _SlotStream(gen, media_type="text/event-stream",
                           headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
    response.slots, response.key = slots, key
    return response
