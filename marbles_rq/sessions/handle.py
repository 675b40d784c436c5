"""A session as the code using it holds it: `Session` (a run body, the sync client) and
`AsyncSession` (the asyncio client). Both are thin: every call is one store call
(sessions/store.py)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from ..engine.context import awaitable_here
from .store import BLOCK_SLICE_MS, READ_PAGE, Appended, Message, SessionInfo, SessionStore, _rows


class Session:
    """One session. `append(message)` -> its position; `read(after=0)` -> the messages
    after that position; `follow()` -> each message, then each new one as it arrives.

    In a run body the appends carry automatic idempotency keys (the run id and the call's
    place in its frame), so a body re-executed after a kill, or a step re-executed before it
    committed, appends nothing twice; in an async body `append` and `read` are awaited."""

    def __init__(self, store: SessionStore, session_id: str, *, parent: str = "",
                 created: bool = False, owner: str = "",
                 auto_key: Callable[[], str] | None = None) -> None:
        self.store = store
        self.id = session_id
        self.parent = parent
        self.created = created  # created by this open (else it existed)
        self._owner = owner
        self._auto_key = auto_key

    def __repr__(self) -> str:
        return f"<Session {self.id}>"

    def append(self, message: dict[str, Any], *, key: str | None = None) -> Any:
        """Append `message` (a JSON object): its position (1, 2, ...). With `key` (or, in a
        run body, always), a resend returns the first append's position, appending nothing.
        """
        if key is None and self._auto_key is not None:
            key = self._auto_key()
        return awaitable_here(self.append_entry(message, key=key).position)

    def append_entry(self, message: dict[str, Any], *, key: str | None = None) -> Appended:
        """`append`, with when it was appended and whether it was a resend."""
        return self.store.append(self.id, message, key=key, owner=self._owner)

    def read(self, after: int | None = 0, *, limit: int | None = None) -> Any:
        """The messages after position `after`, in order."""
        return awaitable_here(self.store.read(self.id, after=after or 0, limit=limit))

    def follow(self, after: int | None = 0, *, timeout: float | None = None
               ) -> Iterator[Message]:
        """Each message after `after`, then each new one as it is appended; ends after
        `timeout` seconds without one (None: never) or when the session is deleted."""
        return self.store.follow(self.id, after=after or 0, timeout=timeout)

    def info(self) -> SessionInfo:
        return self.store.info(self.id)


class AsyncSession:
    """A session on the asyncio client: writes run the sync code in a thread; `follow`
    blocks on redis.asyncio (XREAD BLOCK), holding no thread."""

    def __init__(self, sync: Session, aio: Any) -> None:
        self.sync = sync
        self.id = sync.id
        self.parent = sync.parent
        self.created = sync.created
        self._aio = aio

    def __repr__(self) -> str:
        return f"<AsyncSession {self.id}>"

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(functools.partial(fn, *args, **kwargs))

    async def append(self, message: dict[str, Any], *, key: str | None = None) -> int:
        appended: Appended = await self._call(self.sync.append_entry, message, key=key)
        return appended.position

    async def read(self, after: int | None = 0, *, limit: int | None = None
                   ) -> list[Message]:
        result: list[Message] = await self._call(self.sync.store.read, self.id,
                                                 after=after or 0, limit=limit)
        return result

    async def info(self) -> SessionInfo:
        result: SessionInfo = await self._call(self.sync.info)
        return result

    async def follow(self, after: int | None = 0, *, timeout: float | None = None
                     ) -> AsyncIterator[Message]:
        store = self.sync.store
        last = after or 0
        for message in await self.read(last):
            last = message.position
            yield message
        aio = self._aio()
        key = store.keys.session_messages(self.id)
        quiet_since = time.monotonic()
        while True:
            left = None if timeout is None else timeout - (time.monotonic() - quiet_since)
            if left is not None and left <= 0:
                return
            block = BLOCK_SLICE_MS if left is None else max(1, min(BLOCK_SLICE_MS,
                                                                     int(left * 1000)))
            rows = _rows(await aio.xread({key: f"0-{last}"}, count=READ_PAGE, block=block))
            if not rows:
                if not await aio.exists(store.keys.session(self.id)):
                    return
                continue
            quiet_since = time.monotonic()
            for eid, f in rows:
                message = store._message(self.id, eid, f)
                last = message.position
                yield message
