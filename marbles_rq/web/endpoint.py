"""What every page and write of the dashboard shares: the app's state and templates
(`Web`), the read guard of a page (`readable`), a write with its refusals and its reply
(`write`), the form reader, the flash message, and what a page says when Redis fails it.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

import anyio
import jinja2
import markupsafe
import redis
from redis.exceptions import RedisClusterException
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)

from ..deployment import Settings
from ..engine.authoring import InputError
from ..engine.execution import RunNotFoundError
from ..engine.rerun import new_run_id
from ..engine.runs import STATUSES, TERMINAL
from ..engine.waits import AlreadyAnsweredError
from ..errors import InvalidIdError, MarblesError, RedisUnavailableError
from ..store.redis_errors import one_line
from ..triggers.schedules import UnknownScheduleError
from . import reads
from .actions import Actions
from .security import CSRF_COOKIE, CSRF_FIELD, Guard, new_csrf
from .webhooks import BODY_TIMEOUT_S, Webhooks

log = logging.getLogger("marbles_rq.web")

HERE = Path(__file__).parent
FLASH_COOKIE = "mrq_flash"
MAX_FORM = 64 * 1024
# A fragment is rendered once for every viewer of the same view, with CSRF_MARK where a form
# carries the viewer's CSRF value; each stream puts its own value in (web/routes_live.py).
CSRF_MARK = "mrq-csrf-" + secrets.token_hex(16)  # unguessable: no run can write it


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
        self.env.globals["ledger_keys"] = reads.ledger_keys  # steps a rerun may start from
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


def set_flash(response: Response, ok: bool, message: str) -> None:
    raw = base64.urlsafe_b64encode(json.dumps({"ok": ok, "msg": message[:500]}).encode())
    response.set_cookie(FLASH_COOKIE, raw.decode(), max_age=60, httponly=True,
                        samesite="strict", path="/")


def local_target(target: str | None, default: str) -> str:
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


def why_for(exc: BaseException, detail: bool) -> str:
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


def readable(web: Web) -> Callable[[Callable[[Request], Response]],
                                   Callable[[Request], Response]]:
    """A page's endpoint behind the read guard; Redis failing it is still a page (503)."""
    guard = web.guard

    def wrap(fn: Callable[[Request], Response]) -> Callable[[Request], Response]:
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
                    else why_for(exc, False)))
            except TROUBLE as exc:  # a refusal, a cluster without a master, a mismatch
                log.warning("%s: %s", request.url.path, _why(exc))
                return web.render(request, "error.html", 503, message="cannot read this "
                                  f"page now: {why_for(exc, guard.authenticated(request))}")
        return endpoint

    return wrap


async def write(web: Web, request: Request,
                do: Callable[[dict[str, str]], str | tuple[str, str]], back: str) -> Response:
    """A write from a form (or a script with the token): refused without a session and its
    CSRF value; a redirect with a flash message to a browser, JSON to a script."""
    form = await read_form(request)
    guard = web.guard
    refusal = guard.write_refusal(request, form.get(CSRF_FIELD))
    target = local_target(form.get("next"), back)
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


async def read_form(request: Request) -> dict[str, str]:
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


def redirect_flash(target: str, ok: bool, message: str) -> Response:
    response = RedirectResponse(target, status_code=303)
    set_flash(response, ok, message)
    return response


def _write_reply(request: Request, target: str, ok: bool, message: str, status: int
                 ) -> Response:
    if _wants_json(request) or request.headers.get("authorization"):
        return JSONResponse({"ok": ok, "message" if ok else "error": message},
                            status_code=status)
    return redirect_flash(target, ok, message)
