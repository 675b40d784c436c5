"""The dashboard's sessions: the list (id, messages, last message, owners) and one
session's transcript. Read-only: sessions are appended to by runs and clients."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ..errors import InvalidIdError
from ..sessions import SessionCorruptError, SessionNotFoundError, SessionStore
from ..store.ids import check_id
from .endpoint import Web, readable

SHOWN = 1000  # messages on one page (the newest last); `?after=` pages on


def routes(web: Web) -> list[BaseRoute]:
    @readable(web)
    def sessions_page(request: Request) -> Response:
        listing = SessionStore(web.settings.runs(read_only=True)).listing(limit=500)
        return web.render(request, "sessions.html", title="Sessions",
                          sessions=listing.sessions, skipped=listing.corrupt)

    @readable(web)
    def session_page(request: Request) -> Response:
        store = SessionStore(web.settings.runs(read_only=True))
        try:
            sid = check_id(request.path_params["session_id"], "session id")
            after = int(request.query_params.get("after") or 0)
            info = store.info(sid)
            messages = store.read(sid, after=max(after, 0), limit=SHOWN)
        except (InvalidIdError, ValueError) as exc:
            return web.render(request, "error.html", 400, message=str(exc))
        except SessionNotFoundError as exc:
            return web.render(request, "error.html", 404, message=str(exc))
        except SessionCorruptError as exc:
            return web.render(request, "error.html", 409, message=str(exc))
        rows = [(m.position, m.at_ms, json.dumps(m.data, indent=1, ensure_ascii=False))
                for m in messages]
        return web.render(request, "session.html", title=f"Session {sid}",
                          info=info, messages=rows, more=len(rows) >= SHOWN,
                          last=rows[-1][0] if rows else after)

    return [Route("/sessions", sessions_page), Route("/sessions/{session_id}", session_page)]
