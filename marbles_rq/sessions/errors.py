"""What a session refuses, each a typed MarblesError with a stable code (the CLI exits 2 on
each, the HTTP API answers the status its code maps to in web/api_errors.py)."""

from __future__ import annotations

from ..engine.authoring import InputError


class SessionError(InputError):
    """Base of the sessions' refusals (an InputError: the CLI's exit 2)."""

    code = "session_error"


class SessionNotFoundError(SessionError):
    """No session with that id (never created, or deleted, or pruned with its runs)."""

    code = "session_not_found"


class SessionCorruptError(SessionError):
    """The session's record cannot be decoded: it is never overwritten, and changing it
    fails until it is repaired (or deleted: `marbles-rq sessions delete ID`)."""

    code = "session_corrupt"


class InvalidMessageError(SessionError):
    """A message that is not a JSON object, or over the payload limit; nothing appended."""

    code = "invalid_message"
