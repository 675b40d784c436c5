"""Values that JSON cannot carry unchanged.

msgspec encodes a float NaN or infinity as ``null``: sent as a run's input, a signal's
payload, an event's payload or a published value, it would arrive as None, silently. Every
encoder of such a value asks `changed_by_json` and refuses instead."""

from __future__ import annotations

import math
from typing import Any

_DEEPEST = 200  # deeper nesting is refused by the encoders themselves


def changed_by_json(value: Any, encoded: bytes) -> bool:
    """Did encoding `value` (as `encoded`) turn a NaN or an infinity into null? Only an
    encoding that holds a null is walked: the common case costs one substring search."""
    return b"null" in encoded and _non_finite(value, 0)


def _non_finite(value: Any, depth: int) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if depth > _DEEPEST:
        return False
    if isinstance(value, dict):
        return any(_non_finite(v, depth + 1) for v in value.values())
    if isinstance(value, list | tuple | set | frozenset):
        return any(_non_finite(v, depth + 1) for v in value)
    return False
