"""The dashboard's triggers: schedules (and pausing or resuming one), monitors, inbound
events, and the webhook endpoint that records them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ..triggers.batches import Batches
from ..triggers.events import Events
from ..triggers.monitors import MONITORS, list_monitors
from ..triggers.schedules import SCHEDULES, list_schedules
from .endpoint import CSRF_MARK, Web, readable, write
from .security import CSRF_FIELD


def schedules_context(web: Web) -> dict[str, Any]:
    settings = web.settings
    return dict(schedules=list_schedules(settings.runs(read_only=True), SCHEDULES,
                                         sources_known=bool(settings.source)))


def monitors_context(web: Web) -> dict[str, Any]:
    settings = web.settings
    return dict(monitors=list_monitors(settings.reader(), MONITORS))


def events_context(web: Web) -> dict[str, Any]:
    settings = web.settings
    return dict(events=Events(settings.runs(read_only=True)).recent(100),
                sources=sorted(web.webhooks.sources()),
                batches=Batches(settings.runs(read_only=True)).open())


def routes(web: Web) -> list[BaseRoute]:
    @readable(web)
    def schedules_page(request: Request) -> Response:
        return web.render(request, "schedules.html", title="Schedules", live="schedules",
                          live_query="", **schedules_context(web))

    @readable(web)
    def monitors_page(request: Request) -> Response:
        return web.render(request, "monitors.html", title="Monitors", live="monitors",
                          live_query="", **monitors_context(web))

    @readable(web)
    def events_page(request: Request) -> Response:
        return web.render(request, "events.html", title="Events", live="events",
                          live_query="", **events_context(web))

    def schedule_action(paused: bool) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            key = request.path_params["key"]
            return await write(web, request, lambda form: web.actions.pause_schedule(key, paused),
                               "/schedules")
        return endpoint

    return [
        Route("/schedules", schedules_page),
        Route("/schedules/{key}/pause", schedule_action(True), methods=["POST"]),
        Route("/schedules/{key}/resume", schedule_action(False), methods=["POST"]),
        Route("/monitors", monitors_page),
        Route("/events", events_page),
        Route("/events/{source}", web.webhooks.endpoint, methods=["POST"]),
    ]


def fragments(web: Web) -> dict[str, Callable[[Request], str]]:
    return {
        "schedules": lambda r: web.fragment("_schedules.html", csrf=CSRF_MARK,
                                            csrf_field=CSRF_FIELD, **schedules_context(web)),
        "monitors": lambda r: web.fragment("_monitors.html", **monitors_context(web)),
        "events": lambda r: web.fragment("_events.html", **events_context(web)),
    }
