"""Redis replies as Python values."""

from __future__ import annotations

from typing import Any


def as_text(value: object) -> str:
    """A reply (bytes from a client that does not decode, or anything else) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def server_ms(client: Any) -> int:
    """The server's clock (TIME) in epoch milliseconds: leases, due times and indexes are
    scored in it, so whatever compares with them reads it, not the local clock."""
    secs, micros = client.time()
    return int(secs) * 1000 + int(micros) // 1000
