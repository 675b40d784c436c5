"""The stored document of a session (store/records.py rules: a required version, defaults
left out). Its counters and times live in fields of the session's hash beside it (written by
the scripts, on the server's clock), so an append never rewrites the document."""

from __future__ import annotations

from ..store.records import Record


class SessionRecord(Record, tag="session", kw_only=True, frozen=True):
    """A session (a conversation transcript) under its id."""

    id: str
    # The session this one is a child of: a session a run opens under another id is a child
    # of the run's own session (whose id is the run's id); a child run's own session is a
    # child of its parent run's.
    parent: str = ""
    # Who created it: "run:<run id>" or "client" (a client's is kept until deleted).
    origin: str = ""
