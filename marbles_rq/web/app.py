"""The dashboard's ASGI app: `create_app(settings, ...)`, assembled from its route modules.

Pages are rendered on the server (Jinja2, autoescaped: everything a run wrote is text, never
markup). Each page's live part is a fragment that /sse/<page> renders again every second and
sends when it changed; a run's output is its own stream (/sse/run/<id>/output), appended as
it grows, like `marbles-rq watch`. Endpoints are plain functions that Starlette runs in its
thread pool, because every store call is blocking redis-py.

What every endpoint shares is in web/endpoint.py; the pages, their live fragments and their
writes are in web/routes_runs.py, routes_waits.py, routes_triggers.py and routes_admin.py;
the live streams in web/routes_live.py.
"""

from __future__ import annotations

import math
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .. import tracing
from ..deployment import Settings
from . import (
    routes_admin,
    routes_artifacts,
    routes_live,
    routes_runs,
    routes_sessions,
    routes_triggers,
    routes_waits,
)
from .api_auth import ApiGuard
from .endpoint import HERE, Web
from .routes_api import create_api
from .security import Guard, loopback_host_header
from .webhooks import Webhooks


def create_app(settings: Settings, guard: Guard, webhooks: Webhooks | None = None, *,
               api_token: str | None = None) -> Any:
    """The dashboard, its webhooks and the HTTP API (/api/, web/routes_api.py, with its own
    token `api_token`: see web/api_auth.py)."""
    web = Web(settings, guard, webhooks or Webhooks({}, settings))
    fragments = {**routes_runs.fragments(web), **routes_waits.fragments(web),
                 **routes_triggers.fragments(web), **routes_admin.fragments(web)}
    routes = [
        *routes_admin.routes(web),
        *routes_runs.routes(web),
        *routes_waits.routes(web),
        *routes_triggers.routes(web),
        *routes_sessions.routes(web),
        *routes_artifacts.routes(web),
        *routes_live.routes(web, fragments),
        create_api(settings, ApiGuard(api_token, guard.public, guard.throttle),
                   web.webhooks.limit),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        Route("/{rest:path}", routes_admin.elsewhere,
              methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]),
    ]
    app = Starlette(routes=routes)
    app.router.redirect_slashes = False
    throttled = Throttled(app, guard)
    # A server span per API and webhook request, when tracing is on (tracing.py).
    return tracing.asgi(LoopbackHosts(throttled) if not guard.public else throttled)


class LoopbackHosts:
    """Bound to loopback (reads need nothing), answer only requests whose Host names the
    loopback: a browser pointed here by DNS rebinding sends the attacker's host name, and
    would otherwise read every run as its own origin. Webhooks (POST /events/<source>) are
    exempt: their signature is their credential, and a proxy may forward them as they came.
    The API (/api/) makes the same check itself, answering JSON (web/api_auth.py)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not (scope["method"] == "POST"
                                            and scope["path"].startswith("/events/")
                                            ) and not scope["path"].startswith("/api/"):
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
        if scope["type"] == "http" and self.guard.writable and not scope["path"].startswith(
                "/api/"):  # the API throttles its own token (web/api_auth.py)
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
