"""Redis replies as Python values."""

from __future__ import annotations


def as_text(value: object) -> str:
    """A reply (bytes from a client that does not decode, or anything else) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
