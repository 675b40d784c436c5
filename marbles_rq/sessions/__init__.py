"""Sessions: conversation transcripts, appended to by runs and clients (see store.py for the
keys, body.py for `mr.session` in a run body, handle.py for the handles)."""

from __future__ import annotations

from .errors import (
    InvalidMessageError,
    SessionCorruptError,
    SessionError,
    SessionNotFoundError,
)
from .handle import AsyncSession, Session
from .store import Message, SessionInfo, SessionListing, SessionStore

__all__ = ["AsyncSession", "InvalidMessageError", "Message", "Session", "SessionCorruptError",
           "SessionError", "SessionInfo", "SessionListing", "SessionNotFoundError",
           "SessionStore"]
