"""The dashboard's ASGI app: `create_app(settings, ...)`.

Pages are rendered on the server (Jinja2, autoescaped: everything a run wrote is text, never
markup). Each page's live part is a fragment that /sse/<page> renders again every second and
sends when it changed; a run's output is its own stream (/sse/run/<id>/output), appended as
it grows, like `marbles-rq watch`. Endpoints are plain functions that Starlette runs in its
thread pool, because every store call is blocking redis-py.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import anyio
import jinja2
import markupsafe
import redis
from redis.exceptions import RedisClusterException
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..deployment import Settings
from ..engine.authoring import REGISTRY, InputError
from ..engine.execution import RunNotFoundError
from ..engine.paging import Cursor, Filters, RunPager
from ..engine.rerun import new_run_id
from ..engine.runs import STATUSES, TERMINAL
from ..engine.waits import AlreadyAnsweredError, WaitStore
from ..errors import InvalidIdError, MarblesError, RedisUnavailableError
from ..store.ids import check_id
from ..store.redis_errors import one_line
from ..triggers.events import Events
from ..triggers.monitors import MONITORS, list_monitors
from ..triggers.schedules import SCHEDULES, UnknownScheduleError, list_schedules
from . import reads
from .actions import Actions
from .security import (
    CSRF_COOKIE,
    CSRF_FIELD,
    SESSION_COOKIE,
    SESSION_TTL_S,
    Guard,
    loopback_host_header,
    new_csrf,
)
from .webhooks import BODY_TIMEOUT_S, Webhooks

log = logging.getLogger("marbles_rq.web")

HERE = Path(__file__).parent
FLASH_COOKIE = "mrq_flash"
PAGE_SIZE = 50
LIVE_EVERY_S = 1.0
WINDOWS = {"15m": 15 * 60_000, "1h": 3_600_000, "24h": 86_400_000, "7d": 7 * 86_400_000}


class Web:
    """The app's state: settings (Redis, source), the guard, the templates."""

    def __init__(self, settings: Settings, guard: Guard, webhooks: Webhooks) -> None:
        self.settings = settings
        self.guard = guard
        self.webhooks = webhooks
        self.actions = Actions(settings)
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,  # every value is text: a run id or an output line is never markup
            trim_blocks=True, lstrip_blocks=True)
        self.env.globals.update(iso=reads.iso, ago=reads.ago, duration=reads.duration,
                                pretty=reads.pretty, statuses=STATUSES, terminal=TERMINAL)
        self.env.globals["when"] = _when
        self.env.globals["new_run_id"] = new_run_id  # the rerun form's id (Actions.rerun)
        self.env.filters["qs"] = lambda d: urlencode({k: v for k, v in d.items() if v})

    # -- rendering ---------------------------------------------------------------------------

    def render(self, request: Request, template: str, status_code: int = 200,
               **context: Any) -> HTMLResponse:
        csrf = request.cookies.get(CSRF_COOKIE) or ""
        fresh = not csrf
        if fresh:
            csrf = new_csrf()
        flash = _read_flash(request)
        for name in ("live", "live_query", "error", "login", "next"):
            context.setdefault(name, "")
        html = self.env.get_template(template).render(
            request=request, csrf=csrf, csrf_field=CSRF_FIELD, flash=flash,
            signed_in=self.guard.authenticated(request), writable=self.guard.writable,
            now_ms=int(time.time() * 1000), nav=request.url.path, **context)
        response = HTMLResponse(html, status_code=status_code)
        if fresh:
            response.set_cookie(CSRF_COOKIE, csrf, httponly=True, samesite="strict",
                                path="/")
        if flash is not None:
            response.delete_cookie(FLASH_COOKIE, path="/")
        _headers(response)
        return response

    def fragment(self, template: str, **context: Any) -> str:
        return self.env.get_template(template).render(
            now_ms=int(time.time() * 1000), writable=self.guard.writable, **context)


def _when(ms: int | None) -> markupsafe.Markup:
    """A time that live.js shows as "5s ago" (UTC on hover). The markup itself does not
    change as time passes, so a live fragment is sent again only when its data changed."""
    if ms is None:
        return markupsafe.Markup("-")
    return markupsafe.Markup('<time data-ago="{}" title="{} UTC">{}</time>').format(
        ms, reads.iso(ms), reads.iso(ms)[5:19])


def _headers(response: Response) -> None:
    # No inline script runs (only /static/live.js), no framing (clickjacking on the
    # buttons), no sniffing: a second line of defence behind escaping.
    response.headers["Content-Security-Policy"] = (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "frame-ancestors 'none'; form-action 'self'; base-uri 'none'")
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers["Cache-Control"] = "no-store"


def _read_flash(request: Request) -> dict[str, Any] | None:
    raw = request.cookies.get(FLASH_COOKIE)
    if not raw:
        return None
    try:
        value = json.loads(base64.urlsafe_b64decode(raw.encode()))
    except (ValueError, TypeError):
        return None
    return value if isinstance(value, dict) else None


def _flash(response: Response, ok: bool, message: str) -> None:
    raw = base64.urlsafe_b64encode(json.dumps({"ok": ok, "msg": message[:500]}).encode())
    response.set_cookie(FLASH_COOKIE, raw.decode(), max_age=60, httponly=True,
                        samesite="strict", path="/")


def _local(target: str | None, default: str) -> str:
    """A redirect target that stays on this server (no //host, no scheme)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return default
    return target


# Redis cannot be reached (or the store could not be opened because of it): 503, retry later.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, RedisUnavailableError)
# Anything else Redis or the store may raise while a page reads: still a page, never a 500.
TROUBLE = (redis.RedisError, RedisClusterException, MarblesError)


def _why(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, MarblesError) else one_line(exc)


def _why_for(exc: BaseException, detail: bool) -> str:
    """What a page says went wrong: the error itself to whoever holds the token, and to
    anyone else a line without the Redis host, port or user it may name (logged)."""
    if detail:
        return _why(exc)
    log.warning("%s", _why(exc))
    if isinstance(exc, UNREACHABLE):
        return "Redis is not answering (cannot reach Redis; the server's log says why)"
    return "Redis refused a read (the server's log says why)"


def _wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


# -- the app ---------------------------------------------------------------------------------

def create_app(settings: Settings, guard: Guard, webhooks: Webhooks | None = None) -> Any:
    web = Web(settings, guard, webhooks or Webhooks({}, settings))

    def readable(fn: Callable[[Request], Response]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            if not guard.may_read(request):
                if request.method == "GET" and not request.url.path.startswith("/sse/"):
                    return RedirectResponse("/login?" + urlencode(
                        {"next": request.url.path}), status_code=303)
                return PlainTextResponse("sign in first: reads need the token here", 401)
            try:
                return fn(request)
            except UNREACHABLE as exc:
                return web.render(request, "error.html", 503, message=(
                    f"Redis is not answering: {_why(exc)}" if guard.authenticated(request)
                    else _why_for(exc, False)))
            except TROUBLE as exc:  # a refusal, a cluster without a master, a mismatch
                log.warning("%s: %s", request.url.path, _why(exc))
                return web.render(request, "error.html", 503, message="cannot read this "
                                  f"page now: {_why_for(exc, guard.authenticated(request))}")
        return endpoint

    # -- pages -----------------------------------------------------------------------------

    def runs_params(request: Request) -> dict[str, Any]:
        """The filters and the cursor of a Runs page, as read (whatever else is in the
        query)."""
        q = request.query_params
        status = q.get("status") or None
        if status not in STATUSES:
            status = None
        window = q.get("window") or ""
        if window not in WINDOWS:
            window = ""
        try:
            after = Cursor.decode(q.get("after"))
        except ValueError:
            after = None
        return dict(status=status, workflow=q.get("workflow") or None,
                    queue=q.get("queue") or None, window=window,
                    after=after.encode() if after is not None else "")

    def runs_context(request: Request) -> dict[str, Any]:
        p = runs_params(request)
        status, window = p["status"], p["window"]
        since = int(time.time() * 1000) - WINDOWS[window] if window else None
        filters = Filters(status=status, workflow=p["workflow"], queue=p["queue"],
                          since_ms=since)
        after = Cursor.decode(p["after"]) if p["after"] else None
        t0 = time.perf_counter()
        page = RunPager(settings.runs(read_only=True)).page(limit=PAGE_SIZE, after=after,
                                                             filters=filters)
        took_ms = (time.perf_counter() - t0) * 1000
        params = {"status": status or "", "workflow": filters.workflow or "",
                  "queue": filters.queue or "", "window": window if since else ""}
        return dict(page=page, params=params, took_ms=took_ms, first=after is None,
                    workflows=sorted(REGISTRY.workflows), windows=list(WINDOWS))

    @readable
    def runs_page(request: Request) -> Response:
        search = (request.query_params.get("id") or "").strip()
        if search:
            try:
                check_id(search, "run id")
            except InvalidIdError as exc:
                return _redirect_flash("/runs", False, str(exc))
            if settings.runs(read_only=True).get(search) is not None:
                return RedirectResponse(f"/runs/{search}", status_code=303)
            return _redirect_flash("/runs", False, f"no run with id {search!r}")
        ctx = runs_context(request)
        response = web.render(request, "runs.html", title="Runs", live="runs",
                              live_query=request.url.query, **ctx)
        # What the page's reads cost, for a browser's network panel and the bench.
        response.headers["Server-Timing"] = f"runs;dur={ctx['took_ms']:.1f}"
        return response

    @readable
    def run_page(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        try:
            page = reads.run_page(settings, check_id(run_id, "run id"))
        except InvalidIdError as exc:
            return web.render(request, "error.html", 400, message=str(exc))
        if page is None:
            return web.render(request, "error.html", 404,
                              message=f"no run with id {run_id!r} (finished runs are pruned "
                                      f"once their retention ends)")
        return web.render(request, "run.html", title=f"Run {run_id}", live="run",
                          live_query=urlencode({"id": run_id}), run=page, run_id=run_id)

    def feed_context() -> dict[str, Any]:
        waits = WaitStore(settings.runs(read_only=True))
        return dict(questions=waits.feed(200), reports=waits.reports(30))

    @readable
    def feed_page(request: Request) -> Response:
        return web.render(request, "feed.html", title="Feed", live="feed", live_query="",
                          **feed_context())

    def schedules_context() -> dict[str, Any]:
        return dict(schedules=list_schedules(settings.runs(read_only=True), SCHEDULES,
                                             sources_known=bool(settings.source)))

    @readable
    def schedules_page(request: Request) -> Response:
        return web.render(request, "schedules.html", title="Schedules", live="schedules",
                          live_query="", **schedules_context())

    def monitors_context() -> dict[str, Any]:
        return dict(monitors=list_monitors(settings.reader(), MONITORS))

    @readable
    def monitors_page(request: Request) -> Response:
        return web.render(request, "monitors.html", title="Monitors", live="monitors",
                          live_query="", **monitors_context())

    def events_context() -> dict[str, Any]:
        return dict(events=Events(settings.runs(read_only=True)).recent(100),
                    sources=sorted(web.webhooks.sources()))

    @readable
    def events_page(request: Request) -> Response:
        return web.render(request, "events.html", title="Events", live="events",
                          live_query="", **events_context())

    def system_context() -> dict[str, Any]:
        return dict(system=reads.system(settings))

    @readable
    def system_page(request: Request) -> Response:
        return web.render(request, "system.html", title="System", live="system",
                          live_query="", **system_context())

    # -- live fragments --------------------------------------------------------------------

    # A fragment is rendered once for every viewer of the same view, with CSRF_MARK where
    # a form carries the viewer's CSRF value; each stream puts its own value in.
    def run_fragment(request: Request) -> str:
        run_id = check_id(request.query_params.get("id", ""), "run id")
        page = reads.run_page(settings, run_id)
        if page is None:
            return "<p class=empty>This run is gone (pruned).</p>"
        return web.fragment("_run.html", run=page, run_id=run_id, csrf=CSRF_MARK,
                            csrf_field=CSRF_FIELD)

    fragments: dict[str, Callable[[Request], str]] = {
        "runs": lambda r: web.fragment("_runs.html", **runs_context(r)),
        "run": run_fragment,
        "feed": lambda r: web.fragment("_feed.html", csrf=CSRF_MARK, csrf_field=CSRF_FIELD,
                                       **feed_context()),
        "schedules": lambda r: web.fragment("_schedules.html", csrf=CSRF_MARK,
                                            csrf_field=CSRF_FIELD, **schedules_context()),
        "monitors": lambda r: web.fragment("_monitors.html", **monitors_context()),
        "events": lambda r: web.fragment("_events.html", **events_context()),
        "system": lambda r: web.fragment("_system.html", **system_context()),
    }

    def view_key(page: str, request: Request) -> tuple[Any, ...]:
        """What a fragment depends on, as the server reads it (never the raw query or a
        cookie): streams asking for the same view share one render."""
        if page == "run":
            return (page, request.query_params.get("id", ""))
        if page != "runs":
            return (page,)
        params = runs_params(request)
        return (page, *(params[k] for k in sorted(params)))

    shared = SharedRenders()
    streams = StreamSlots(MAX_STREAMS, MAX_VIEWS)

    def live_refusal(request: Request) -> Response | None:
        if _foreign(request):
            # A page of another site may open streams (EventSource needs no CORS to be
            # sent): it cannot read them, but each one costs this server work.
            return PlainTextResponse("live views answer only pages of this dashboard "
                                     "(Origin does not match)", 403)
        if not guard.may_read(request):
            return PlainTextResponse("sign in first", 401)
        return None

    async def live(request: Request) -> Response:
        refusal = live_refusal(request)
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
                    yield _sse("problem", _why_for(exc, detail))
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

    async def run_output(request: Request) -> Response:
        refusal = live_refusal(request)
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
                    yield _sse("problem", _why_for(exc, detail))
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

    # -- writes ----------------------------------------------------------------------------

    async def write(request: Request, do: Callable[[dict[str, str]], str | tuple[str, str]],
                    back: str) -> Response:
        form = await _form(request)
        refusal = guard.write_refusal(request, form.get(CSRF_FIELD))
        target = _local(form.get("next"), back)
        if refusal is not None:
            if _wants_json(request) or guard._bearer(request) is not None:
                return JSONResponse({"ok": False, "error": refusal}, status_code=403)
            return web.render(request, "error.html", 403, message=f"refused: {refusal}",
                              login=True, next=target)
        try:
            message = await run_in_threadpool(do, form)
        except (RunNotFoundError, UnknownScheduleError) as exc:
            return _write_reply(request, target, False, str(exc), 404)
        except AlreadyAnsweredError as exc:
            return _write_reply(request, target, False, str(exc), 409)
        except RedisUnavailableError as exc:
            return _write_reply(request, target, False, str(exc), 503)
        except (InputError, InvalidIdError) as exc:
            return _write_reply(request, target, False, str(exc), 400)
        except MarblesError as exc:
            return _write_reply(request, target, False, str(exc), 409)
        except (redis.RedisError, RedisClusterException) as exc:
            return _write_reply(request, target, False, f"Redis: {one_line(exc)}", 503)
        if isinstance(message, tuple):  # (where to go now, what to say): a rerun
            target, message = message
        return _write_reply(request, target, True, message, 200)

    def run_action(name: str) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            run_id = request.path_params["run_id"]

            def do(form: dict[str, str]) -> str | tuple[str, str]:
                if name == "rerun":
                    new_id, message = web.actions.rerun(run_id, form.get("from_step"),
                                                        form.get("new_id"))
                    return f"/runs/{quote(new_id)}", message
                if name == "answer":
                    key = form.get("key", "")
                    decision = form.get("decision")
                    if decision in ("approve", "reject"):
                        return web.actions.answer(
                            run_id, key, {"approved": decision == "approve",
                                          "note": form.get("note") or None},
                            kind="approval", what="approved" if decision == "approve"
                            else "rejected")
                    value = form.get("value", "")
                    return web.actions.answer(run_id, key, value, kind="question",
                                              what=f"answered {value!r}")
                action: Callable[[str], str] = getattr(web.actions, name)
                return action(run_id)

            return await write(request, do, f"/runs/{run_id}")
        return endpoint

    def schedule_action(paused: bool) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            key = request.path_params["key"]
            return await write(request, lambda form: web.actions.pause_schedule(key, paused),
                               "/schedules")
        return endpoint

    # -- signing in ------------------------------------------------------------------------

    def login_page(request: Request) -> Response:
        return web.render(request, "login.html", title="Sign in",
                          next=_local(request.query_params.get("next"), "/runs"))

    async def login(request: Request) -> Response:
        from .security import csrf_refusal

        form = await _form(request)
        target = _local(form.get("next"), "/runs")
        refusal = csrf_refusal(request, form.get(CSRF_FIELD))
        if refusal is None and not guard.writable:
            refusal = "this dashboard is read-only: no token is configured"
        if refusal is None:
            wait_s = guard.throttled_s(request)
            if wait_s > 0:  # refused before the token is compared: no oracle
                return web.render(request, "login.html", 429, title="Sign in", next=target,
                                  error=f"too many wrong tokens: try again in "
                                        f"{math.ceil(wait_s)} s")
            if not guard.try_token(request, form.get("token", "")):
                refusal = "wrong token"
        if refusal is not None:
            return web.render(request, "login.html", 403, title="Sign in", next=target,
                              error=refusal)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(SESSION_COOKIE, guard.session_cookie(), httponly=True,
                            samesite="strict", path="/", max_age=SESSION_TTL_S)
        _flash(response, True, "signed in")
        return response

    async def logout(request: Request) -> Response:
        from .security import csrf_refusal

        form = await _form(request)
        if csrf_refusal(request, form.get(CSRF_FIELD)) is not None:
            return PlainTextResponse("refused", 403)
        guard.sign_out(request)  # a copy of the cookie is refused from now on
        response = RedirectResponse("/runs", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    def home(request: Request) -> Response:
        return RedirectResponse("/runs", status_code=303)

    def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    def elsewhere(request: Request) -> Response:
        """No route: a path with a trailing slash goes to the one without, by a relative
        redirect (Starlette's own builds an absolute URL from the Host header, which in
        public mode is whatever the client sent); anything else is 404."""
        path = request.url.path
        if request.method in ("GET", "HEAD") and path.endswith("/") and path != "/":
            target = _local(path.rstrip("/"), "/runs")
            if request.url.query:
                target += "?" + request.url.query
            return RedirectResponse(target, status_code=307)
        return PlainTextResponse("Not Found", 404)

    routes = [
        Route("/", home),
        Route("/healthz", healthz),
        Route("/runs", runs_page),
        Route("/runs/{run_id}", run_page),
        *[Route(f"/runs/{{run_id}}/{name}", run_action(name), methods=["POST"])
          for name in ("cancel", "pause", "resume", "rerun", "answer")],
        Route("/feed", feed_page),
        Route("/schedules", schedules_page),
        Route("/schedules/{key}/pause", schedule_action(True), methods=["POST"]),
        Route("/schedules/{key}/resume", schedule_action(False), methods=["POST"]),
        Route("/monitors", monitors_page),
        Route("/events", events_page),
        Route("/events/{source}", web.webhooks.endpoint, methods=["POST"]),
        Route("/system", system_page),
        Route("/sse/run/{run_id}/output", run_output),
        Route("/sse/{page}", live),
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        Route("/{rest:path}", elsewhere, methods=["GET", "HEAD", "POST", "PUT", "PATCH",
                                                 "DELETE", "OPTIONS"]),
    ]
    app = Starlette(routes=routes)
    app.router.redirect_slashes = False
    throttled = Throttled(app, guard)
    return LoopbackHosts(throttled) if not guard.public else throttled


class LoopbackHosts:
    """Bound to loopback (reads need nothing), answer only requests whose Host names the
    loopback: a browser pointed here by DNS rebinding sends the attacker's host name, and
    would otherwise read every run as its own origin. Webhooks (POST /events/<source>) are
    exempt: their signature is their credential, and a proxy may forward them as they came."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not (scope["method"] == "POST"
                                            and scope["path"].startswith("/events/")):
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            if not loopback_host_header(host):
                response = PlainTextResponse(
                    "this dashboard is bound to loopback and answers only for localhost, "
                    "127.0.0.1 or [::1] (to serve another host name, bind it with "
                    "MARBLES_WEB_TOKEN set)", 403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Throttled:
    """A client that sent too many wrong tokens is answered 429 on anything that carries a
    token (a bearer header, the sign-in form) until its wait is over, before the token is
    compared: no answer tells a guess right from wrong meanwhile."""

    def __init__(self, app: Any, guard: Guard) -> None:
        self.app, self.guard = app, guard

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.guard.writable:
            request = Request(scope)
            if self.guard._bearer(request) is not None:  # (/login answers for itself)
                wait_s = self.guard.throttled_s(request)
                if wait_s > 0:
                    response = PlainTextResponse(
                        f"too many wrong tokens: try again in {math.ceil(wait_s)} s", 429,
                        headers={"Retry-After": str(math.ceil(wait_s))})
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


MAX_FORM = 64 * 1024
MAX_STREAMS = 128  # live connections (SSE) at once; more are refused (503), pages still load
MAX_VIEWS = 16  # distinct live views (a page, a filter, a run) at once; more are refused
LIVE_SHARE = 0.25  # at most this share of one thread's time goes to rendering live views
OUTPUT_POLLS_PER_S = 20.0  # output streams' reads of Redis a second, all streams together
HEARTBEAT_S = 15.0  # a comment on a quiet stream, so a vanished client's stream ends
CSRF_MARK = "mrq-csrf-" + secrets.token_hex(16)  # unguessable: no run can write it


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


async def _form(request: Request) -> dict[str, str]:
    """A urlencoded form (the only kind the pages send), at most MAX_FORM bytes; anything
    else reads as empty, which every write then refuses (no CSRF value)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in ("", "application/x-www-form-urlencoded"):
        return {}
    body = bytearray()
    try:
        with anyio.fail_after(BODY_TIMEOUT_S):  # a form trickled in (slowloris) is dropped
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_FORM:
                    return {}
    except (TimeoutError, ClientDisconnect):
        return {}
    try:
        pairs = parse_qsl(body.decode(), keep_blank_values=True, max_num_fields=50)
    except (UnicodeDecodeError, ValueError):
        return {}
    return dict(pairs)


def _redirect_flash(target: str, ok: bool, message: str) -> Response:
    response = RedirectResponse(target, status_code=303)
    _flash(response, ok, message)
    return response


def _write_reply(request: Request, target: str, ok: bool, message: str, status: int
                 ) -> Response:
    if _wants_json(request) or request.headers.get("authorization"):
        return JSONResponse({"ok": ok, "message" if ok else "error": message},
                            status_code=status)
    return _redirect_flash(target, ok, message)


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
