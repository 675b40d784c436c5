"""The HTTP API's session endpoints (rows of web/routes_api.ROUTES): list, one session's
messages, append. Each is one client call (client/aio.py), so the API, the CLI and the
Python client never disagree."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ..store.ids import check_id
from .api_errors import ApiError


class SessionSummary(msgspec.Struct, frozen=True):
    """A session: its parent (a session opened in a run is a child of the run's own), its
    message count, created and last message at (epoch ms), the runs that own it (it goes
    with the last of them) and whether a client keeps it (until deleted)."""

    id: str
    parent: str | None
    origin: str
    messages: int
    created_ms: int
    last_ms: int
    kept: bool
    owners: list[str]


class SessionList(msgspec.Struct, frozen=True):
    """Sessions, newest activity first; `skipped`: the Redis keys of session records that
    cannot be decoded (left as they are)."""

    sessions: list[SessionSummary]
    skipped: list[str]


class SessionMessage(msgspec.Struct, frozen=True):
    position: int
    at_ms: int
    message: dict[str, Any]


class SessionDetail(msgspec.Struct, frozen=True):
    """A session and its messages after `after` (at most `limit`)."""

    session: SessionSummary
    messages: list[SessionMessage]


class MessageBody(msgspec.Struct, forbid_unknown_fields=True):
    """A message to append (a JSON object). `key`: an idempotency key; a resend with it
    appends nothing and answers the first append's position."""

    message: msgspec.Raw
    key: str | None = None


class MessageAppended(msgspec.Struct, frozen=True):
    session: str
    position: int
    at_ms: int
    duplicate: bool  # a resend with the same key: nothing appended


SESSION_REFUSALS = ("invalid_id", "session_not_found", "session_corrupt")


def _reply(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type="application/json")


def _int(request: Request, name: str, default: int | None, high: int) -> int | None:
    text = request.query_params.get(name)
    if text is None or text == "":
        return default
    if not text.isdigit() or int(text) > high:
        raise ApiError("invalid_request", f"{name} must be an integer 0..{high}, not "
                                          f"{text[:40]!r}")
    return int(text)


def _session_id(request: Request) -> str:
    return check_id(request.path_params["id"], "session id")


async def sessions(api: Any, request: Request) -> Response:
    limit = _int(request, "limit", None, 100_000)
    found = await api.client.sessions(limit=limit or None)
    return _reply(SessionList([msgspec.convert(s.to_json(), SessionSummary)
                               for s in found.sessions], found.corrupt))


async def session(api: Any, request: Request) -> Response:
    sid = _session_id(request)
    after = _int(request, "after", 0, 1 << 62) or 0
    limit = _int(request, "limit", 1000, 100_000)
    info = await api.client.session_info(sid)
    messages = await api.client.session_messages(sid, after=after, limit=limit)
    return _reply(SessionDetail(msgspec.convert(info.to_json(), SessionSummary),
                                [SessionMessage(m.position, m.at_ms, m.data)
                                 for m in messages]))


async def append_message(api: Any, request: Request) -> Response:
    """Append to a session, creating it if it does not exist (kept until deleted)."""
    from ..sessions.store import decode_message_text

    sid = _session_id(request)
    body: MessageBody = await api.json(request, MessageBody)
    value = decode_message_text(bytes(body.message))
    handle = await api.client.session(sid)
    done = await asyncio.to_thread(functools.partial(handle.sync.append_entry, value,
                                                     key=body.key))
    return _reply(MessageAppended(sid, done.position, done.at_ms, done.duplicate),
                  201 if not done.duplicate else 200)
