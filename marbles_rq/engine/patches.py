"""Patch markers: changing a workflow's code while runs of it are in flight.

``if mr.patched("charge-in-cents"): <new code> else: <old code>`` lets a deploy change what
a body does without failing the runs that already did part of it the old way. The first
time a run reaches the call, the decision is taken and recorded in its ledger:

* True when the run has recorded nothing past this point of its frame (a new run, or one
  that had not come this far): it takes the new code;
* False when the ledger already holds calls made after this point, by the code that had no
  patch here: the run goes on the old way, which its recorded calls follow.

Every later replay of that run returns the recorded decision, whatever code replays it. The
decision is a ledger entry of its own (name ``|patch:<id>``, at ``<frame>.|patch:<id>#<n>``,
outside the frame's positions: a patch added under a run does not move the positions of the
calls recorded after it), held for the execution's next write like a step's success: were
it lost to a crash, nothing recorded after it was lost with it, and the same decision is
taken again.

``mr.deprecate_patch(id)`` replaces ``patched(id)`` once the old branch is deleted: a run that
recorded False there (or recorded nothing there but is past that point) cannot go on (it
fails with NonDeterminism, naming the patch) instead of running code its ledger does not
follow. ``marbles-rq replay --check`` says which patches
still have runs on their old branch (engine/replay_check.py).
"""

from __future__ import annotations

import re

import msgspec

from ..errors import MarblesError
from ..store.records import StepRecord
from .context import Run, check_branch, check_not_in_foreign_thread, current, now_ms
from .waiting import NonDeterminismError, run_asks

PATCH_PREFIX = "|patch:"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,99}")
_TASK = re.compile(r"\.\|task#(\d+)")


class PatchIdError(MarblesError):
    code = "invalid_patch_id"


class DeprecatedPatchError(NonDeterminismError):
    """A run that took a patch's old branch reached the patch after that branch was
    deleted (``mr.deprecate_patch``)."""

    def __init__(self, frame: str, patch: str) -> None:
        BaseException.__init__(
            self, f"patch {patch!r} in {frame} is deprecated (its old branch was deleted), "
                  f"but this run took the old branch there; keep `mr.patched({patch!r})` and "
                  f"its old branch until no run is on it (marbles-rq replay --check says "
                  f"which runs are)")
        self.frame = frame


def patch_of(record: StepRecord) -> str | None:
    """The patch id of a ledger entry that records a patch decision, else None."""
    return record.name[len(PATCH_PREFIX):] if record.name.startswith(PATCH_PREFIX) else None


def decision_of(record: StepRecord) -> bool:
    return bool(msgspec.json.decode(bytes(record.result)))


def check_id(patch: str) -> str:
    if not isinstance(patch, str) or not _ID.fullmatch(patch):
        raise PatchIdError(f"invalid patch id {patch!r}: 1 to 100 characters, letters, digits "
                           f"and . _ : / - (starting with a letter or digit)")
    return patch


def patched(patch: str) -> bool:
    """True for a run that reaches this point in the new code, False for one whose ledger
    already passed it without the patch; recorded, so every replay of the run agrees."""
    run = current("mr.patched")
    return _patched(run, check_id(patch))


def deprecate_patch(patch: str) -> None:
    """Mark a patch whose old branch is gone: the new code runs for every run that reaches
    it, and a run that had recorded the old branch fails (NonDeterminism) rather than run
    code its ledger does not follow."""
    run = current("mr.deprecate_patch")
    check_id(patch)
    key, recorded = _place(run, patch)
    if recorded is None:
        # No decision recorded: a run past this place without one would have taken the
        # old branch here had it been patched, so it cannot take the new one either.
        if _passed(run):
            run.ex.patches_seen.add(key)
            raise DeprecatedPatchError(run.frame.path, patch)
        return
    run.ex.patches_seen.add(key)
    if not decision_of(recorded):
        raise DeprecatedPatchError(run.frame.path, patch)


def _place(run: Run, patch: str) -> tuple[str, StepRecord | None]:
    """The ledger key of this occurrence of `patch` in the frame, and its recorded entry."""
    check_not_in_foreign_thread(f"patch {patch!r}")
    check_branch()
    frame = run.frame
    name = PATCH_PREFIX + patch
    key = f"{frame.path}.{name}#{frame.counters[name]}"
    frame.counters[name] += 1
    return key, run.ex.ledger.get(key)


def _patched(run: Run, patch: str) -> bool:
    key, recorded = _place(run, patch)
    run.ex.patches_seen.add(key)
    if recorded is not None:
        return decision_of(recorded)
    new = not _passed(run)
    record = StepRecord(version=1, key=key, name=PATCH_PREFIX + patch, status="succeeded",
                        attempts=0, result=msgspec.Raw(b"true" if new else b"false"),
                        at_ms=now_ms())
    run.hold_entry(record, "patched", {"step": key, "patch": patch, "new": new})
    return new


def _passed(run: Run) -> bool:
    """Has the run recorded calls of this frame made after this point: a position at or past
    the frame's next one, one in an async task the frame had not yet started here, or a
    question the frame had not yet asked here (questions are kept beside the ledger, in the
    order a frame asks them; there are none before the run's first park)?"""
    frame = run.frame
    if run.ex.resumptions and sum(1 for q in run_asks(run).values()
                                  if q.get("step") == frame.path) > frame.counters["|ask"]:
        return True
    path, seq, tasks = frame.path, frame.seq, frame.counters["|task"]
    for record in run.ex.ledger.values():
        if record.name.startswith(PATCH_PREFIX):
            continue
        cut = record.key.rfind(f".{record.name}#")
        if cut == len(path) and record.seq >= seq and record.key.startswith(path):
            return True
        if record.key.startswith(path):
            task = _TASK.match(record.key, len(path))
            if task is not None and int(task.group(1)) >= tasks:
                return True
    return False


__all__ = ["PATCH_PREFIX", "DeprecatedPatchError", "PatchIdError", "decision_of",
           "deprecate_patch", "patch_of", "patched"]
