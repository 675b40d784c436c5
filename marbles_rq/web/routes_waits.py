"""The dashboard's feed: the questions waiting runs ask, and what runs reported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ..engine.waits import WaitStore
from .endpoint import CSRF_MARK, Web, readable
from .security import CSRF_FIELD


def feed_context(web: Web) -> dict[str, Any]:
    settings = web.settings
    runs = settings.runs(read_only=True)
    waits = WaitStore(runs)
    from ..engine.failed_steps import feed_entries

    return dict(questions=waits.feed(200), reports=waits.reports(30),
                failed_steps=feed_entries(waits, runs.views, 200))


def routes(web: Web) -> list[BaseRoute]:
    @readable(web)
    def feed_page(request: Request) -> Response:
        return web.render(request, "feed.html", title="Feed", live="feed", live_query="",
                          **feed_context(web))

    return [Route("/feed", feed_page)]


def fragments(web: Web) -> dict[str, Callable[[Request], str]]:
    return {
        "feed": lambda r: web.fragment("_feed.html", csrf=CSRF_MARK, csrf_field=CSRF_FIELD,
                                       **feed_context(web)),
    }
