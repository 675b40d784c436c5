"""A run's compensations as `status` shows them, read from its ledger alone (so every
reader agrees with the executor): the registered undos in the order they run (the reverse
of registration), each with its status, and whether the run is compensating now."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import msgspec

from ..store.records import StepRecord
from .undo_refs import FRAME, MARKER_KEY, UNDO

COMPENSATING = "compensating"


def is_registration(record: StepRecord) -> bool:
    """A ledger entry that registered an undo: a ctx.compensate call, or the success of a
    step declared with compensate=."""
    if record.name == UNDO:
        return record.status == "registered"
    return record.status == "succeeded" and bytes(record.undo) not in (b"", b"null")


def undo_doc(record: StepRecord) -> dict[str, Any]:
    """The registration's document: fn (its reference), name, args, kwargs, passes_result."""
    raw = record.result if record.name == UNDO else record.undo
    doc: dict[str, Any] = msgspec.json.decode(bytes(raw))
    return doc


def plan(registrations: list[StepRecord]) -> list[tuple[StepRecord, str]]:
    """Each registration, in the order its undo runs (the last registered first), with the
    ledger key its undo step is recorded under in the compensate frame."""
    counters: defaultdict[str, int] = defaultdict(int)
    out = []
    for record in reversed(registrations):
        name = str(undo_doc(record)["name"])
        out.append((record, f"{FRAME}.{name}#{counters[name]}"))
        counters[name] += 1
    return out


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


def compensations_json(steps: list[StepRecord], run_status: str
                       ) -> tuple[str | None, list[dict[str, Any]]]:
    """(phase, compensations) of a run whose ledger, in commit order, is `steps`. phase is
    "compensating" while the run is not finished and its compensations have begun."""
    by_key = {s.key: s for s in steps}
    marker = by_key.get(MARKER_KEY)
    finished = run_status in ("succeeded", "failed", "cancelled")
    out = []
    for record, key in plan([s for s in steps if is_registration(s)]):
        ran = by_key.get(key)
        status = "pending"
        if ran is not None and ran.status == "succeeded":
            status = "done"
        elif ran is not None and ran.status == "failed":
            status = "failed"
        elif ran is not None and ran.status == "running" and not finished:
            status = "running"
        elif finished:
            status = "not_run"  # it succeeded, or a plain cancel stopped it first
        doc = undo_doc(record)
        out.append({
            "name": doc["name"], "undo": doc["fn"], "registered_by": record.key,
            "status": status, "attempts": ran.attempts if ran is not None else 0,
            "at": _iso(ran.at_ms) if ran is not None and status in ("done", "failed")
            and ran.at_ms else None,
            "error": None if status != "failed" or ran is None or ran.error is None
            else f"{ran.error.type}: {ran.error.message}"})
    phase = COMPENSATING if marker is not None and not finished else None
    return phase, out
