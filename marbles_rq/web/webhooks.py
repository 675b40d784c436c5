"""Signed inbound events: ``POST /events/<source>``.

The body is a JSON envelope ``{"id": ..., "type": ..., "payload": ...}`` (type optional),
signed as a whole: header ``X-Marbles-Signature: sha256=<hex HMAC-SHA256 of the raw body>``
with the source's secret. Because the id is inside what is signed, a captured request can
only be replayed as itself, which the event's stable key makes a no-op.

Secrets: environment variable ``MARBLES_WEBHOOK_SECRET_<SOURCE>`` (the source upper-cased,
every character outside A-Z 0-9 turned into ``_``), read when `web` starts. A source without
a secret is unknown (404). Order of checks, all before anything is written: known source
(404), body size (413), signature (401), envelope (400), then the same validation as
`marbles-rq events send` (400). Then the event is journaled exactly as `events send` does
(`Events.send`: the triggers of --source, else those the workers declared; none: unmatched,
still delivered to waiting runs): 202 with the event key when it is new, 200 when it was
received before (nothing new is created).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import anyio
import msgspec
import redis
from redis.exceptions import RedisClusterException
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ..deployment import Settings
from ..engine.authoring import InputError, UnknownWorkflowError
from ..engine.ops import MAX_DEPTH, json_depth_exceeds, max_payload
from ..errors import ConfigError, InvalidIdError, RedisUnavailableError
from ..store.redis_errors import one_line
from ..triggers.events import SOURCE_PATTERN, TRIGGERS, Events

log = logging.getLogger("marbles_rq.web")

SECRET_ENV_PREFIX = "MARBLES_WEBHOOK_SECRET_"
SIGNATURE_HEADER = "x-marbles-signature"
MIN_SECRET = 16
BODY_TIMEOUT_S = 15.0  # the whole body, once the headers are in
BODY_BUDGET = 16 << 20  # bytes of unsigned bodies held at once, all requests together
ENVELOPE_SLACK = 4096  # the envelope's own bytes (id, type, keys) on top of the payload limit


def secret_env(source: str) -> str:
    return SECRET_ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", source.upper())


def secrets_from_env(environ: Mapping[str, str] | None = None) -> dict[str, bytes]:
    """{env suffix: secret} of every MARBLES_WEBHOOK_SECRET_* variable that is set."""
    environ = os.environ if environ is None else environ
    found = {name[len(SECRET_ENV_PREFIX):]: value.encode()
             for name, value in environ.items()
             if name.startswith(SECRET_ENV_PREFIX) and value}
    for suffix, value in found.items():
        # No source maps to a name with a lower-case letter (or nothing after the prefix):
        # such a secret would be listed as configured, and its source answered 404.
        if not re.fullmatch(r"[A-Z0-9_]+", suffix):
            raise ConfigError(f"{SECRET_ENV_PREFIX}{suffix} names no event source: the source "
                              f"is upper-cased with every character outside A-Z 0-9 turned "
                              f"into _ (source {suffix.lower()!r} -> "
                              f"{secret_env(suffix.lower() or 'name')})")
        if len(value) < MIN_SECRET:
            # One captured request is enough to guess a short key offline.
            raise ConfigError(f"{SECRET_ENV_PREFIX}{suffix} is too short: use at least "
                              f"{MIN_SECRET} characters (e.g. `openssl rand -hex 24`)")
    return found


def declared_sources() -> set[str]:
    """The sources the loaded triggers (@on_event) declare."""
    return {trigger.source for trigger in TRIGGERS.by_key.values()}


def sign(secret: bytes, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


class Envelope(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    payload: msgspec.Raw = msgspec.Raw(b"null")
    type: str = ""


class Webhooks:
    def __init__(self, secrets: dict[str, bytes], settings: Settings,
                 max_body: int | None = None) -> None:
        self.secrets = secrets  # keyed by the env suffix: secret_env(source) minus the prefix
        self.settings = settings
        # Read once, when `web` starts (a bad MARBLES_MAX_PAYLOAD is refused there).
        self.limit = (max_payload() if max_body is None else max_body) + ENVELOPE_SLACK
        # A body is read whole before its signature can be checked: what all unsigned
        # bodies in flight may hold together is bounded, beyond it 503 (try again).
        self.budget = max(BODY_BUDGET, self.limit)
        self.buffered = 0

    def sources(self) -> list[str]:
        return sorted(self.secrets)

    def secret(self, source: str) -> bytes | None:
        """The secret of `source`, if it is a source this server accepts: the one spelling
        of its variable's name in lower case (`MARBLES_WEBHOOK_SECRET_GITHUB` -> `github`),
        or a source a trigger declares. The signature covers the body, not the URL: were
        every spelling that maps to the variable accepted (`GitHub`, `GITHUB`, `git_hub`
        ...), one captured request could be replayed as a new event under each of them.
        When a trigger declares a source of this secret, that is the one spelling (`git-hub`
        declared: `git_hub` is refused)."""
        if not SOURCE_PATTERN.fullmatch(source):
            return None
        suffix = secret_env(source)[len(SECRET_ENV_PREFIX):]
        declared = {s for s in declared_sources()
                    if secret_env(s)[len(SECRET_ENV_PREFIX):] == suffix}
        if source not in (declared or {suffix.lower()}):
            return None
        return self.secrets.get(suffix)

    def check(self) -> None:
        """Refuse (ConfigError) two declared sources that share one secret: a request signed
        for one would be accepted, as a new event, by the other."""
        by_suffix: dict[str, list[str]] = {}
        for source in sorted(declared_sources()):
            by_suffix.setdefault(secret_env(source)[len(SECRET_ENV_PREFIX):], []).append(source)
        for suffix, sources in by_suffix.items():
            if len(sources) > 1 and suffix in self.secrets:
                raise ConfigError(
                    f"event sources {' and '.join(map(repr, sources))} share "
                    f"{SECRET_ENV_PREFIX}{suffix}: a request signed for one would be accepted "
                    f"by the other; rename one of them")

    async def endpoint(self, request: Request) -> Response:
        source = request.path_params["source"]
        secret = self.secret(source)
        if secret is None:
            return _refuse(404, f"unknown event source {source!r} (no secret is configured "
                                f"for it)")
        limit = self.limit
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return _refuse(413, f"the body is larger than {limit} bytes")
        held = int(declared) if declared is not None else limit
        if self.buffered + held > self.budget:
            return _refuse(503, "too many webhook bodies arriving at once: retry later")
        self.buffered += held
        try:
            body = bytearray()
            try:
                with anyio.fail_after(BODY_TIMEOUT_S):  # a body trickled in (slowloris)
                    async for chunk in request.stream():
                        body += chunk
                        if len(body) > limit:  # a lying or absent Content-Length: stop here
                            return _refuse(413, f"the body is larger than {limit} bytes")
            except ClientDisconnect:
                return _refuse(400, "the client went away")
            except TimeoutError:
                return _refuse(408, f"the body did not arrive within {BODY_TIMEOUT_S:.0f} s")
            return await self._signed(request, source, secret, bytes(body))
        finally:
            self.buffered -= held

    async def _signed(self, request: Request, source: str, secret: bytes,
                      body: bytes) -> Response:
        given = request.headers.get(SIGNATURE_HEADER, "")
        if not given:
            return _refuse(401, "missing signature (X-Marbles-Signature: sha256=<hex>)")
        if not hmac.compare_digest(given.encode(), sign(secret, body).encode()):
            return _refuse(401, "bad signature")
        if json_depth_exceeds(body, MAX_DEPTH + 1):  # the decoder would recurse to a crash
            return _refuse(400, f"the body nests arrays or objects deeper than "
                                f"{MAX_DEPTH + 1} levels")
        try:
            envelope = msgspec.json.decode(body, type=Envelope)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _refuse(400, f"the body is not an event envelope {{id, type, payload}}: "
                                f"{exc}")
        try:
            sent = await run_in_threadpool(self._send, source, envelope)
        except (InputError, InvalidIdError, UnknownWorkflowError) as exc:
            # Unknown workflow: a trigger the workers declared names a workflow none declared.
            return _refuse(400, str(exc))
        except (redis.RedisError, RedisClusterException, RedisUnavailableError) as exc:
            # The sender is not the operator: where Redis is (host, port, user) stays in the
            # log. (RedisUnavailableError: the store could not even be opened.)
            log.warning("webhook %s: %s", source, one_line(exc))
            return _refuse(503, "cannot reach Redis now: retry later")
        reply: dict[str, Any] = {"event": sent.key, "created": sent.created, "state": sent.state,
                                 "workflow": sent.workflow or None, "run": sent.run_id or None}
        return JSONResponse(reply, status_code=202 if sent.created else 200)

    def _send(self, source: str, envelope: Envelope) -> Any:
        payload = bytes(envelope.payload)
        Events.validate(source, envelope.id, type=envelope.type, payload=payload)
        return Events(self.settings.runs(), self.settings.rq()).send(
            source, envelope.id, type=envelope.type, payload=payload)


def _refuse(status: int, message: str) -> Response:
    # The body may be unread (413, 408): close rather than parse what follows as a request.
    headers = {"Connection": "close"} if status in (408, 413) else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)
