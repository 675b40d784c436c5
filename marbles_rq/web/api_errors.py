"""How the HTTP API refuses: one JSON object ``{"error": {"code", "message"}}``, its HTTP
status read from one table keyed by the error's stable code.

The codes of the engine's refusals are the `code` of their MarblesError subclass (the same
exception the Python client raises, with the message the CLI prints); the API adds its own
for what only HTTP can get wrong (a body that is not JSON, a missing token ...).
"""

from __future__ import annotations

import logging

import msgspec
import redis
from redis.exceptions import RedisClusterException
from starlette.responses import Response

from ..errors import MarblesError, RedisUnavailableError
from ..store.redis_errors import one_line
from .api_models import ErrorBody, ErrorDetail

log = logging.getLogger("marbles_rq.web.api")

# The one table: code -> HTTP status. A MarblesError whose code is not here answers 409 (a
# refusal of what the run's state allows); anything else unexpected answers 500 "internal".
STATUS: dict[str, int] = {
    # the request itself
    "malformed_json": 400,  # the body is not JSON
    "invalid_request": 400,  # JSON of the wrong shape, a bad query parameter
    "invalid_id": 400,  # a run id, key or cursor outside its pattern
    "unauthorized": 401,  # no bearer token, or the wrong one
    "api_disabled": 403,  # bound beyond loopback without MARBLES_API_TOKEN
    "forbidden": 403,  # tokenless on loopback: a browser (Origin) or a foreign Host name
    "not_found": 404,  # no such API path
    "method_not_allowed": 405,
    "timeout": 408,  # the result's long-poll ended before the run finished
    "body_timeout": 408,  # the body did not arrive in time (a trickle)
    "payload_too_large": 413,  # the body, or an input or payload in it, is over the limit
    "throttled": 429,  # too many wrong tokens from this address
    "busy": 503,  # too many waiting requests (long-polls, output streams) at once
    # the engine's refusals (MarblesError.code)
    "invalid_input": 422,
    "input_too_deep": 422,
    "invalid_event": 422,
    "unknown_workflow": 422,
    "answer_refused": 422,
    "invalid_signal": 422,  # a signal name outside its pattern, a payload that is not JSON
    "invalid_filter": 400,  # a bulk operation's filter that cannot select
    "invalid_tag": 400,  # a tag key or value outside its pattern, too many tags
    "run_not_found": 404,
    "unknown_rate_limit": 404,  # a rate limit no workflow declares and no run took
    "invalid_rate": 400,  # a rate string or burst outside its pattern
    "unknown_question": 404,
    "not_published": 404,  # the run has not published that key (or finished without it)
    "published_wait_timeout": 408,
    "invalid_publish": 400,  # a key outside its pattern
    "already_answered": 409,
    "run_settled": 409,
    "not_paused": 409,
    "not_failed_step": 409,  # retry / fail of a run not paused on a failed step
    "debouncing": 409,  # an action on a debounce window's run before the window closes
    "patch_refused": 422,  # an input patch that does not fit the step's arguments
    "signal_buffer_full": 409,  # the run holds 10,000 untaken signals of that name
    "session_not_found": 404,  # sessions (marbles_rq/sessions/)
    "session_corrupt": 409,  # its record cannot be decoded: repair or delete it
    "invalid_message": 422,  # a session message that is not a JSON object
    "invalid_artifact": 400,  # an artifact name outside its pattern, meta that is not JSON
    "unknown_artifact": 404,
    "unknown_artifact_version": 404,
    "artifact_conflict": 409,  # a put's expect_version is not the latest version
    "redis_unavailable": 503,
    "key_missing": 409,  # a payload sealed with a key this server's MARBLES_KEYS lacks
    "internal": 500,
}
DEFAULT_STATUS = 409


class ApiError(Exception):
    """A refusal the API itself makes (not the engine's)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def error_response(code: str, message: str, *, headers: dict[str, str] | None = None
                   ) -> Response:
    status = STATUS.get(code, DEFAULT_STATUS)
    if status == 413:  # the body may be unread: close rather than read it as a request
        headers = {**(headers or {}), "Connection": "close"}
    body = msgspec.json.encode(ErrorBody(ErrorDetail(code, message)))
    return Response(body, status, headers=headers, media_type="application/json")


def response_for(exc: BaseException) -> Response:
    """The reply to an exception a handler raised."""
    if isinstance(exc, ApiError):
        return error_response(exc.code, exc.message)
    if isinstance(exc, RedisUnavailableError):
        return error_response("redis_unavailable", str(exc))
    if isinstance(exc, MarblesError):
        return error_response(exc.code, str(exc))
    if isinstance(exc, (redis.RedisError, RedisClusterException)):
        return error_response("redis_unavailable", f"Redis: {one_line(exc)}")
    log.exception("API request failed", exc_info=exc)
    return error_response("internal", f"internal error ({type(exc).__name__}); the "
                                      f"server's log has the traceback")
