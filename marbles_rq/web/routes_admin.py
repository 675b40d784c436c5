"""The dashboard's own pages: the system page, signing in and out, the home redirect, the
health check, and the answer to a path no route takes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from . import reads
from .endpoint import Web, local_target, read_form, readable, set_flash
from .security import CSRF_FIELD, SESSION_COOKIE, SESSION_TTL_S


def system_context(web: Web) -> dict[str, Any]:
    from ..flow.rate_store import catalog_rates

    runs = web.settings.runs(read_only=True)
    return dict(system=reads.system(web.settings),
                rate_limits=runs.rates().list(catalog_rates(runs.client, runs.keys)),
                locks=runs.locks().list())


def routes(web: Web) -> list[BaseRoute]:
    guard = web.guard

    @readable(web)
    def system_page(request: Request) -> Response:
        from .routes_runs import charts_of

        return web.render(request, "system.html", title="System", live="system",
                          live_query="", **system_context(web),
                          **charts_of(web, request, "/system"))

    def login_page(request: Request) -> Response:
        return web.render(request, "login.html", title="Sign in",
                          next=local_target(request.query_params.get("next"), "/runs"))

    async def login(request: Request) -> Response:
        from .security import csrf_refusal

        form = await read_form(request)
        target = local_target(form.get("next"), "/runs")
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
        set_flash(response, True, "signed in")
        return response

    async def logout(request: Request) -> Response:
        from .security import csrf_refusal

        form = await read_form(request)
        if csrf_refusal(request, form.get(CSRF_FIELD)) is not None:
            return PlainTextResponse("refused", 403)
        guard.sign_out(request)  # a copy of the cookie is refused from now on
        response = RedirectResponse("/runs", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    return [
        Route("/", home),
        Route("/healthz", healthz),
        Route("/system", system_page),
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
    ]


def fragments(web: Web) -> dict[str, Callable[[Request], str]]:
    return {"system": lambda r: web.fragment("_system.html", **system_context(web))}


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
        target = local_target(path.rstrip("/"), "/runs")
        if request.url.query:
            target += "?" + request.url.query
        return RedirectResponse(target, status_code=307)
    return PlainTextResponse("Not Found", 404)

