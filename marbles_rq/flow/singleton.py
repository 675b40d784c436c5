"""A singleton's pointer to its key's unfinished run (flow/enqueue_gates.py decides with
it): read, and cleared when the run finishes. Imports nothing of the engine: the run store's
settle calls `cleared`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from ..store.replies import as_text

if TYPE_CHECKING:
    from ..store.records import RunRecord


def pointed(raw: Any) -> str:
    """The run id a pointer's value ("<run id>|<set at ms>|<cancelled>") names; "" none."""
    return "" if raw is None else as_text(raw).split("|", 1)[0]


def cleared(runs: Any, record: RunRecord) -> None:
    """A singleton's run finished (settled or cancelled): free its key, if still its own.
    A failure here costs nothing lasting: the next enqueue finds the run finished."""
    if not record.singleton or not hasattr(runs.keys, "singleton_pointer"):
        return
    with contextlib.suppress(Exception):
        runs.scripts.clear_singleton(pointer=runs.keys.singleton_pointer(record.singleton),
                                     run_id=record.id)
