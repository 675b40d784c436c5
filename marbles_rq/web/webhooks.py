"""Signed inbound events: ``POST /events/<source>``.

The body is a JSON envelope ``{"id": ..., "type": ..., "payload": ...}`` (type optional),
signed as a whole: header ``X-Marbles-Signature: sha256=<hex HMAC-SHA256 of the raw body>``
with the source's secret. Because the id is inside what is signed, a captured request can
only be replayed as itself, which the event's stable key makes a no-op.

Secrets: environment variable ``MARBLES_WEBHOOK_SECRET_<SOURCE>`` (the source upper-cased,
every character outside A-Z 0-9 turned into ``_``), read when `web` starts. A source without
a secret is unknown (404). Order of checks, all before anything is written: known source
(404), body size (413), signature (401), envelope (400), then the same validation as
`marbles-rq events send` (400; 503 when no trigger is declared at all). Then the event is
journaled exactly as `events send` does (`Events.send`): 202 with the event key when it is
new, 200 when it was received before (nothing new is created).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Mapping
from typing import Any

import msgspec
import redis
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ..cli import Settings
from ..engine.authoring import InputError
from ..engine.ops import max_payload
from ..errors import InvalidIdError
from ..store.redis_errors import one_line
from ..triggers.events import SOURCE_PATTERN, TRIGGERS, Events

SECRET_ENV_PREFIX = "MARBLES_WEBHOOK_SECRET_"
SIGNATURE_HEADER = "x-marbles-signature"
ENVELOPE_SLACK = 4096  # the envelope's own bytes (id, type, keys) on top of the payload limit


def secret_env(source: str) -> str:
    return SECRET_ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", source.upper())


def secrets_from_env(environ: Mapping[str, str] | None = None) -> dict[str, bytes]:
    """{env suffix: secret} of every MARBLES_WEBHOOK_SECRET_* variable that is set."""
    environ = os.environ if environ is None else environ
    return {name[len(SECRET_ENV_PREFIX):]: value.encode()
            for name, value in environ.items()
            if name.startswith(SECRET_ENV_PREFIX) and value}


def sign(secret: bytes, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


class Envelope(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    payload: msgspec.Raw = msgspec.Raw(b"null")
    type: str = ""


class Webhooks:
    def __init__(self, secrets: dict[str, bytes], settings: Settings) -> None:
        self.secrets = secrets  # keyed by the env suffix: secret_env(source) minus the prefix
        self.settings = settings

    def sources(self) -> list[str]:
        return sorted(self.secrets)

    def secret(self, source: str) -> bytes | None:
        if not SOURCE_PATTERN.fullmatch(source):
            return None
        return self.secrets.get(secret_env(source)[len(SECRET_ENV_PREFIX):])

    async def endpoint(self, request: Request) -> Response:
        source = request.path_params["source"]
        secret = self.secret(source)
        if secret is None:
            return _refuse(404, f"unknown event source {source!r} (no secret is configured "
                                f"for it)")
        limit = max_payload() + ENVELOPE_SLACK
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return _refuse(413, f"the body is larger than {limit} bytes")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:  # a lying or absent Content-Length: stop reading here
                    return _refuse(413, f"the body is larger than {limit} bytes")
        except ClientDisconnect:
            return _refuse(400, "the client went away")
        given = request.headers.get(SIGNATURE_HEADER, "")
        if not given:
            return _refuse(401, "missing signature (X-Marbles-Signature: sha256=<hex>)")
        if not hmac.compare_digest(given.encode(), sign(secret, bytes(body)).encode()):
            return _refuse(401, "bad signature")
        try:
            envelope = msgspec.json.decode(bytes(body), type=Envelope)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _refuse(400, f"the body is not an event envelope {{id, type, payload}}: "
                                f"{exc}")
        if not TRIGGERS.by_key:
            return _refuse(503, "no event triggers are declared: start web with the --source "
                                "that declares them")
        try:
            sent = await run_in_threadpool(self._send, source, envelope)
        except (InputError, InvalidIdError) as exc:
            return _refuse(400, str(exc))
        except redis.RedisError as exc:
            return _refuse(503, f"Redis: {one_line(exc)}")
        reply: dict[str, Any] = {"event": sent.key, "created": sent.created, "state": sent.state,
                                 "workflow": sent.workflow or None, "run": sent.run_id or None}
        return JSONResponse(reply, status_code=202 if sent.created else 200)

    def _send(self, source: str, envelope: Envelope) -> Any:
        payload = bytes(envelope.payload)
        Events.validate(source, envelope.id, type=envelope.type, payload=payload)
        return Events(self.settings.runs(), self.settings.rq()).send(
            source, envelope.id, type=envelope.type, payload=payload)


def _refuse(status: int, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status)
