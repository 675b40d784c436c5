"""Validation of the names that end up inside Redis keys."""

from __future__ import annotations

import re

from ..errors import InvalidIdError

# Ids become part of key names and of `|`-separated index members, so `|`, braces and
# whitespace are excluded; the set matches the run-id rule of the CLI.
ID_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
KIND_PATTERN = re.compile(r"[a-z][a-z0-9_.]{0,63}")


def check_id(value: str, what: str = "id") -> str:
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise InvalidIdError(f"invalid {what} {value!r}: expected [A-Za-z0-9_.:-]{{1,128}}")
    return value


def check_kind(value: str) -> str:
    if not KIND_PATTERN.fullmatch(value):
        raise InvalidIdError(f"invalid record kind {value!r}: expected [a-z][a-z0-9_.]{{0,63}}")
    return value
