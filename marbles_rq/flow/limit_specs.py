"""What a concurrency limit or a priority is, without the store: the checks of a workflow's
options and a run's priority, a limit's id and the run hash's `limit` field, and the names
of priority bands (flow/limits.py explains both; it enforces them).

Definitions (engine/authoring.py) and runs in the store (engine/runs.py) use these; neither
needs the slots, so this module imports nothing of the engine.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..store.records import RunRecord

PRIORITY_MIN, PRIORITY_MAX = -100, 100
BAND_SEP = "~"
_BAND = re.compile(r"(.+)~(-?[1-9][0-9]{0,2})")
MAX_KEY_VALUE = 256  # characters of a concurrency key's value


def priority_problem(value: Any) -> str | None:
    if type(value) is not int or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        return (f"invalid priority {value!r}: use a whole number from {PRIORITY_MIN} to "
                f"{PRIORITY_MAX} (higher runs first; default 0)")
    return None


def definition_problem(concurrency: Any, key: Any, priority: Any) -> str | None:
    """Why these workflow options are invalid, or None."""
    if concurrency is not None and (type(concurrency) is not int or concurrency < 1):
        return (f"invalid concurrency {concurrency!r}: use a whole number >= 1 (omit it for "
                f"no limit)")
    if key is not None:
        if concurrency is None:
            return "concurrency_key needs concurrency=N (the limit per key)"
        if not isinstance(key, str) or not key:
            return f"invalid concurrency_key {key!r}: name a field of the workflow's input"
    return priority_problem(priority)


def limit_id(name: str, label: str) -> str:
    """The id of a limit's keys: a digest, so any workflow name or key value makes a valid,
    fixed-length hash tag."""
    return hashlib.sha1(f"{name}\0{label}".encode()).hexdigest()[:20]


def limit_field(record: RunRecord) -> str:
    """The run hash's `limit` field for `record` ("" without a limit)."""
    if not record.concurrency:
        return ""
    return f"{record.concurrency}|{limit_id(record.name, record.concurrency_label)}|" \
           f"{record.concurrency_label or record.name}"


def band_queue(queue: str, priority: int) -> str:
    """The marbles-side name of the RQ queue carrying runs of `priority` on `queue`."""
    return queue if priority == 0 else f"{queue}{BAND_SEP}{priority}"


def delivery_queue(record: RunRecord) -> str:
    return band_queue(record.queue, record.priority)


def parse_band(name: str) -> tuple[str, int]:
    """(queue, priority) of a band's name; (name, 0) for a queue's own."""
    match = _BAND.fullmatch(name)
    if match is None:
        return name, 0
    return match.group(1), int(match.group(2))
