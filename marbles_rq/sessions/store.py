"""Sessions in Redis: create-or-get, append, read, follow, list, delete, release.

Every key of one session carries the session id's bucket tag (store/keys.py), so each change
is one script on one slot, on a server or a cluster:

* ``ses:<id>`` hash: the SessionRecord (`doc`), the message count `n`, `created_ms`,
  `last_ms`, `keep` (created by a client: kept until deleted);
* ``sesmsg:<id>`` stream: the messages, entry id ``0-<position>`` (1, 2, 3 ...), so a reader
  asks for what follows a position and a follower blocks on XREAD from it;
* ``seskey:<id>`` hash: idempotency key -> position (kept for the session's lifetime);
* ``sesown:<id>`` set: the runs that opened it (retention: it goes with the last);
* ``idx:ses`` in the bucket: the listing.

A run's side (its bucket) is ``runses:<run id>``, the sessions it opened, which the
controller's pruning releases before it purges the run (cross-slot: not one script).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..engine.json_values import changed_by_json
from ..errors import CorruptRecordError, UnsupportedRecordVersionError
from ..payloads.codec import decode_payload, encode_payload
from ..store.ids import check_id
from ..store.records import decode, encode
from ..store.replies import as_text
from .errors import InvalidMessageError, SessionCorruptError, SessionNotFoundError
from .records import SessionRecord

log = logging.getLogger("marbles_rq.sessions")

# A blocking read is cut in slices shorter than any sane socket timeout.
BLOCK_SLICE_MS = 1000
READ_PAGE = 1000
MAX_KEY = 256  # an idempotency key's length


@dataclass(frozen=True)
class Message:
    """One message of a session: its position (1, 2, ...), when it was appended (server
    epoch ms) and its JSON object."""

    position: int
    at_ms: int
    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"position": self.position, "at_ms": self.at_ms, "message": self.data}


@dataclass(frozen=True)
class SessionInfo:
    """A session as listings show it."""

    id: str
    parent: str
    origin: str
    messages: int
    created_ms: int
    last_ms: int
    kept: bool  # created by a client: kept until deleted
    owners: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "parent": self.parent or None, "origin": self.origin,
                "messages": self.messages, "created_ms": self.created_ms,
                "last_ms": self.last_ms, "kept": self.kept, "owners": self.owners}


@dataclass(frozen=True)
class SessionListing:
    """Every readable session, newest activity first, and the keys of those skipped
    because their record cannot be decoded (each worth one warning line)."""

    sessions: list[SessionInfo]
    corrupt: list[str]


@dataclass(frozen=True)
class Appended:
    position: int
    at_ms: int
    duplicate: bool  # a resend of an append with the same key: nothing appended


def encode_message(message: Any) -> bytes:
    """A message as JSON text: a JSON object under the payload limit, else
    InvalidMessageError (nothing appended)."""
    from ..engine.ops import max_payload

    if not isinstance(message, dict):
        raise InvalidMessageError(f"a session message must be a JSON object (a dict), not "
                                  f"{type(message).__name__}")
    try:
        data = msgspec.json.encode(message)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise InvalidMessageError(f"the message is not JSON: {exc}") from None
    if changed_by_json(message, data):
        raise InvalidMessageError("the message is not JSON: it holds NaN or an infinity")
    limit = max_payload()
    if len(data) > limit:
        raise InvalidMessageError(f"the message is {len(data):,} bytes, over the limit of "
                                  f"{limit:,} (MARBLES_MAX_PAYLOAD); nothing was appended")
    return data


def decode_message_text(text: bytes | str) -> dict[str, Any]:
    """The JSON text of a message (the HTTP API's body, the CLI's argument) as a message."""
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise InvalidMessageError(f"the message is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidMessageError(f"a session message must be a JSON object, not "
                                  f"{type(value).__name__}")
    return value


def check_key(key: str | None) -> str:
    if key is None:
        return ""
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY or not key.isprintable():
        raise InvalidMessageError(f"invalid idempotency key {key!r}: 1 to {MAX_KEY} "
                                  f"printable characters")
    return key


class SessionStore:
    """Sessions of one deployment. `runs` is a RunStore (or anything with its `store`,
    `keys`, `scripts` and `client`)."""

    def __init__(self, runs: Any) -> None:
        self.runs = runs
        self.keys = runs.keys
        self.client = runs.client

    @property
    def scripts(self) -> Any:
        return self.runs.scripts

    # -- writes --------------------------------------------------------------------------

    def open(self, session_id: str, *, parent: str = "", owner: str = "",
             origin: str = "client") -> tuple[SessionRecord, int, bool]:
        """Create-or-get `session_id`: (its record, its message count, created now). A
        client's (no owner) is kept until deleted; a run's (owner: the run id) goes with the
        last run that opened it. SessionCorruptError when its record cannot be decoded."""
        check_id(session_id, "session id")
        doc = encode(SessionRecord(version=SessionRecord.VERSION, id=session_id,
                                   parent=parent, origin=origin))
        keys = self.keys
        reply = self.scripts.open_session(
            session=keys.session(session_id), owners=keys.session_owners(session_id),
            listing=keys.listing("ses", keys.bucket_of(session_id)), session_id=session_id,
            doc=doc, owner=owner, keep=not owner)
        if reply.status == "corrupt":
            raise self._corrupt(session_id)
        record = self._record(session_id, reply.values[0])
        return record, int(reply.values[1]), reply.status == "created"

    def append(self, session_id: str, message: Any, *, key: str | None = None,
               owner: str = "") -> Appended:
        """Append `message` (a JSON object) to the session: its position. With `key`, a
        resend returns the first append's position and appends nothing."""
        check_id(session_id, "session id")
        idem = check_key(key)
        data = encode_payload(self.runs.store, encode_message(message),
                              holder=f"ses:{session_id}")
        keys = self.keys
        request_id = uuid.uuid4().hex
        reply = self.scripts.append_session(
            session=keys.session(session_id), messages=keys.session_messages(session_id),
            idem=keys.session_idem(session_id), owners=keys.session_owners(session_id),
            marker=keys.request_marker(session_id, request_id), message=data, key=idem,
            owner=owner, request_id=request_id)
        if reply.status == "missing":
            raise SessionNotFoundError(f"no session with id {session_id!r}")
        if reply.status == "corrupt":
            raise self._corrupt(session_id, "nothing was appended")
        return Appended(int(reply.values[0]), int(reply.values[1]),
                        reply.status == "duplicate")

    def delete(self, session_id: str) -> int:
        """Delete the session and its messages (whoever uses it): how many it held.
        SessionNotFoundError when there is none."""
        check_id(session_id, "session id")
        keys = self.keys
        reply = self.scripts.delete_session(
            session=keys.session(session_id), messages=keys.session_messages(session_id),
            idem=keys.session_idem(session_id), owners=keys.session_owners(session_id),
            listing=keys.listing("ses", keys.bucket_of(session_id)), session_id=session_id)
        if reply.status == "missing":
            raise SessionNotFoundError(f"no session with id {session_id!r}")
        return int(reply.values[0])

    def release(self, session_id: str, owner: str) -> str:
        """Run `owner` no longer holds the session: kept | deleted | missing."""
        keys = self.keys
        status: str = self.scripts.release_session(
            session=keys.session(session_id), messages=keys.session_messages(session_id),
            idem=keys.session_idem(session_id), owners=keys.session_owners(session_id),
            listing=keys.listing("ses", keys.bucket_of(session_id)), session_id=session_id,
            owner=owner)
        return status

    def release_run(self, run_id: str) -> int:
        """Release every session run `run_id` opened, then forget them on the run's side
        (the controller's pruning, before it purges the run): idempotent, so a kill -9 at
        any point is finished by the next pass. The sessions deleted."""
        side = self.keys.run_sessions(run_id)
        deleted = 0
        for sid in sorted(as_text(m) for m in self.client.smembers(side)):
            deleted += self.release(sid, run_id) == "deleted"
        self.client.delete(side)
        return deleted

    # -- reads ---------------------------------------------------------------------------

    def info(self, session_id: str) -> SessionInfo:
        """The session's summary. SessionNotFoundError, SessionCorruptError."""
        check_id(session_id, "session id")
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.keys.session(session_id), ["doc", "n", "created_ms", "last_ms", "keep"])
        pipe.smembers(self.keys.session_owners(session_id))
        fields, owners = pipe.execute()
        if fields[0] is None:
            raise SessionNotFoundError(f"no session with id {session_id!r}")
        found = self._info(session_id, fields, owners)
        if found is None:
            raise self._corrupt(session_id)
        return found

    def read(self, session_id: str, *, after: int = 0, limit: int | None = None
             ) -> list[Message]:
        """The messages after position `after` (0: from the first), in order; at most
        `limit`. SessionNotFoundError when there is no such session."""
        check_id(session_id, "session id")
        after = _position(after)
        pipe = self.client.pipeline(transaction=False)
        pipe.exists(self.keys.session(session_id))
        pipe.xrange(self.keys.session_messages(session_id), min=f"0-{after + 1}",
                    count=limit if limit is not None else None)
        exists, rows = pipe.execute()
        if not exists:
            raise SessionNotFoundError(f"no session with id {session_id!r}")
        return [self._message(session_id, eid, f) for eid, f in rows]

    def follow(self, session_id: str, *, after: int = 0, timeout: float | None = None,
               stop: Any = None) -> Iterator[Message]:
        """The messages after `after`, then each new one as it is appended (XREAD BLOCK: no
        polling). Ends after `timeout` seconds without a new message (None: never), when
        `stop()` is true, or when the session is deleted."""
        last = _position(after)
        for message in self.read(session_id, after=last):
            last = message.position
            yield message
        key = self.keys.session_messages(session_id)
        quiet_since = time.monotonic()
        while stop is None or not stop():
            left = None if timeout is None else timeout - (time.monotonic() - quiet_since)
            if left is not None and left <= 0:
                return
            block = BLOCK_SLICE_MS if left is None else max(1, min(BLOCK_SLICE_MS,
                                                                     int(left * 1000)))
            reply: Any = self.client.xread({key: f"0-{last}"}, count=READ_PAGE, block=block)
            rows = _rows(reply)
            if not rows:
                if not self.client.exists(self.keys.session(session_id)):
                    return  # deleted (or pruned) while followed
                continue
            quiet_since = time.monotonic()
            for eid, f in rows:
                message = self._message(session_id, eid, f)
                last = message.position
                yield message

    def listing(self, *, limit: int | None = None) -> SessionListing:
        """Every session (newest activity first, at most `limit`); the keys of records that
        cannot be decoded are listed apart (skipped, never overwritten)."""
        keys = self.keys
        pipe = self.client.pipeline(transaction=False)
        for bucket in range(keys.buckets):
            pipe.zrange(keys.listing("ses", bucket), 0, -1)
        ids = sorted({as_text(m) for members in pipe.execute() for m in members})
        return self.infos(ids, limit=limit)

    def infos(self, ids: list[str], *, limit: int | None = None) -> SessionListing:
        """The summaries of `ids` (missing ones left out), newest activity first."""
        pipe = self.client.pipeline(transaction=False)
        for sid in ids:
            pipe.hmget(self.keys.session(sid), ["doc", "n", "created_ms", "last_ms", "keep"])
            pipe.smembers(self.keys.session_owners(sid))
        replies = pipe.execute() if ids else []
        found, corrupt = [], []
        for sid, fields, owners in zip(ids, replies[0::2], replies[1::2], strict=True):
            if fields[0] is None:
                continue
            info = self._info(sid, fields, owners)
            if info is None:
                corrupt.append(self.keys.session(sid))
            else:
                found.append(info)
        found.sort(key=lambda s: (-s.last_ms, s.id))
        return SessionListing(found[:limit] if limit is not None else found, corrupt)

    def of_run(self, run_id: str) -> list[str]:
        """The ids of the sessions run `run_id` opened (sorted)."""
        return sorted(as_text(m) for m in self.client.smembers(self.keys.run_sessions(run_id)))

    # -- decoding ------------------------------------------------------------------------

    def _record(self, session_id: str, doc: Any) -> SessionRecord:
        try:
            return decode(SessionRecord, doc, self.keys.session(session_id))
        except (CorruptRecordError, UnsupportedRecordVersionError):
            raise self._corrupt(session_id) from None

    def _info(self, session_id: str, fields: list[Any], owners: Any) -> SessionInfo | None:
        doc, n, created, last, keep = fields
        try:
            record = decode(SessionRecord, doc, self.keys.session(session_id))
        except (CorruptRecordError, UnsupportedRecordVersionError):
            return None
        return SessionInfo(id=session_id, parent=record.parent, origin=record.origin,
                           messages=int(n or 0), created_ms=int(created or 0),
                           last_ms=int(last or 0), kept=as_text(keep or b"") == "1",
                           owners=sorted(as_text(o) for o in owners))

    def _message(self, session_id: str, eid: Any, f: dict[bytes, bytes]) -> Message:
        position = int(as_text(eid).split("-", 1)[1])
        data = msgspec.json.decode(decode_payload(self.runs.store, f[b"m"]))
        return Message(position, int(f[b"t"]), data)

    def _corrupt(self, session_id: str, consequence: str = "nothing was changed"
                 ) -> SessionCorruptError:
        return SessionCorruptError(
            f"session {session_id!r}: its record {self.keys.session(session_id)} cannot be "
            f"decoded; {consequence} (repair it, or delete it: marbles-rq sessions delete "
            f"{session_id})")


def _position(after: Any) -> int:
    if after is None:
        return 0
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise InvalidMessageError(f"after must be a message position >= 0, not {after!r}")
    return after


def _rows(reply: Any) -> list[Any]:
    if not reply:
        return []
    if isinstance(reply, dict):  # RESP3 shape
        rows = next(iter(reply.values()))
        return rows[0] if rows and isinstance(rows[0], list) else list(rows)
    return list(reply[0][1])
