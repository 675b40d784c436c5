"""Bulk operations: one of cancel, pause, resume, rerun, approve, reject applied to the runs
a filter selects (engine/selection.py) or to a list of ids, in bounded batches.

Each run goes through the client's own one-run call (one script call each), so a bulk
cancel does exactly what `cancel RUN` does, run by run. What there is nothing to do for (an
already cancelled run, a run not paused, a question answered already) is counted as skipped
with its reason, not as a failure: the same operation again, after an interruption or
twice, does only what is left. An interruption is honoured between batches (`should_stop`),
so a batch is never cut in the middle. A Redis outage stops the operation with the error
(what was done stays done).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..engine.execution import RunNotFoundError
from ..engine.runs import TERMINAL
from ..engine.selection import BATCH, RunFilter, Selection
from ..errors import MarblesError, RunSettledError
from ..store.replies import as_text
from .views import BulkFailure, BulkSummary

# `client` below is a client/sync.py Client (not imported: it imports this module).
Client = Any

ACTIONS = ("cancel", "pause", "resume", "rerun", "approve", "reject")
MAX_FAILURES = 20  # failure messages kept in a summary (the counts are complete)
Target = RunFilter | Iterable[str]


def rerun_id(run_id: str, key: str) -> str:
    """The id of a bulk rerun of `run_id`: fixed by the operation's key, so running the
    same bulk rerun again finds the reruns it made instead of making more."""
    tail = f"-rerun-{key}"
    if len(run_id) + len(tail) <= 128:
        return run_id + tail
    # Cut to fit: a digest of the whole id keeps two ids alike in their first characters
    # apart (they would share one rerun id, and the second never be rerun).
    digest = hashlib.sha1(run_id.encode()).hexdigest()[:8]
    return f"{run_id[:128 - len(tail) - 9]}-{digest}{tail}"


def rerun_key(target: Target, from_step: str | None) -> str:
    """A bulk rerun's default key: a digest of its filter (ids: of the ids) and step."""
    what = (repr(sorted(target.to_json().items())) if isinstance(target, RunFilter)
            else ",".join(target if isinstance(target, list) else []))
    return hashlib.sha1(f"{what}|{from_step}".encode()).hexdigest()[:8]


def batches(client: Client, target: Target, batch: int) -> Iterator[list[str]]:
    if isinstance(target, RunFilter):
        yield from Selection(client.reader, target, batch=batch).batches()
        return
    from ..store.ids import check_id

    ids = [check_id(i, "run id") for i in target]  # every id checked before any is acted on
    for at in range(0, len(ids), batch):
        yield ids[at:at + batch]


def one(client: Client, action: str, run_id: str, *, key: str | None, note: str | None,
        from_step: str | None, new_key: str) -> tuple[str, str]:
    """Apply `action` to one run: ("done" | "skipped" | "failed", reason)."""
    from ..engine.rerun import RerunError
    from ..engine.waits import (
        AlreadyAnsweredError,
        NotPausedError,
        UnknownQuestionError,
    )

    try:
        if action == "cancel":
            outcome = client.cancel(run_id).outcome
            if outcome == "settled":
                return "skipped", _finished(client, run_id)
            return "done", outcome
        if action == "pause":
            outcome = client.pause(run_id).outcome
            return ("skipped", "already paused") if outcome == "already" else ("done", outcome)
        if action == "resume":
            return "done", client.resume(run_id).outcome
        if action == "rerun":
            if run_id.endswith(f"-rerun-{new_key}"):
                return "skipped", "a rerun made by this operation"
            status = client.reader.client.hget(client.reader.keys.run(run_id), "status")
            if status is None:
                return "skipped", "gone"
            if as_text(status) not in TERMINAL:
                return "skipped", "not finished"
            made = client.rerun(run_id, from_step=from_step, new_id=rerun_id(run_id, new_key))
            return ("done", "rerun") if made.created else ("skipped", "already rerun")
        if key is None:
            raise ValueError("approve and reject need the approval's key")
        (client.approve if action == "approve" else client.reject)(run_id, key, note)
        return "done", "answered"
    except RunNotFoundError:
        return "skipped", "gone"
    except RunSettledError:
        return "skipped", _finished(client, run_id)
    except NotPausedError:
        return "skipped", "not paused"
    except AlreadyAnsweredError:
        return "skipped", "already answered"
    except UnknownQuestionError:
        return "skipped", "no such question"
    except (RerunError, MarblesError) as exc:
        return "failed", f"{getattr(exc, 'code', '') or type(exc).__name__}|{exc}"


def _finished(client: Client, run_id: str) -> str:
    status = client.reader.client.hget(client.reader.keys.run(run_id), "status")
    return "already cancelled" if status == b"cancelled" else "already finished"


def run_bulk(client: Client, action: str, target: Target, *, key: str | None = None,
             note: str | None = None, from_step: str | None = None,
             rerun_key_: str | None = None, batch: int = BATCH,
             on_batch: Callable[[BulkSummary], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> BulkSummary:
    if action not in ACTIONS:
        raise ValueError(f"unknown bulk action {action!r}")
    if action in ("approve", "reject"):
        key = key or (target.question if isinstance(target, RunFilter) else None)
        if key is None:
            from ..engine.authoring import InputError

            raise InputError(f"{action} of many runs needs the approval's key (a filter's "
                             f"question, or key=)")
    if isinstance(target, str | bytes) or not isinstance(target, RunFilter | Iterable):
        # A lone id is iterable too: its characters would be acted on as ids.
        from ..engine.authoring import InputError

        raise InputError(f"the runs to {action} are a filter (client.select(...)) or a list "
                         f"of run ids, not {type(target).__name__}")
    if not isinstance(target, RunFilter):
        from ..store.ids import check_id

        target = [check_id(i, "run id") for i in target]  # all checked before any is acted on
    new_key = rerun_key_ or rerun_key(target, from_step)
    summary = BulkSummary(action)
    for ids in batches(client, target, batch):
        for run_id in ids:
            summary.matched += 1
            kind, reason = one(client, action, run_id, key=key, note=note,
                               from_step=from_step, new_key=new_key)
            if kind == "done":
                summary.done += 1
            elif kind == "skipped":
                summary.skipped[reason] = summary.skipped.get(reason, 0) + 1
            else:
                code, _, message = reason.partition("|")
                summary.failed[code] = summary.failed.get(code, 0) + 1
                if len(summary.failures) < MAX_FAILURES:
                    summary.failures.append(BulkFailure(run_id, message))
        if on_batch is not None:
            on_batch(summary)
        if should_stop is not None and should_stop():
            summary.stopped = True
            break
    return summary


def describe(target: Any) -> str:
    return target.describe() if isinstance(target, RunFilter) else "the ids given"
