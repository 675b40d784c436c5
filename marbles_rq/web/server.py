"""uvicorn's HTTP/1.1 protocol with a deadline on a request's headers.

uvicorn bounds how long an idle keep-alive connection stays open, but not how long a client
may take to send a request's headers: a client trickling one header line every few seconds
(slowloris) held its connection, and its file descriptor, forever, and a few thousand of
them stop the server from accepting anyone (webhooks included). Here a connection whose
request line and headers are not complete within HEADER_TIMEOUT_S is closed. (Bodies have
their own deadline where they are read: `web.endpoint.read_form`, `web.webhooks`.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


class HeaderDeadlineH11(H11Protocol):
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the request's headers are in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()  # the next request on this connection gets the same deadline

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
