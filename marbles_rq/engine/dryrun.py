"""Dry runs: a workflow executed in this process by the in-memory engine
(engine/memory_engine.py: the real executor over runs kept in memory, on a virtual clock;
the test kit, marbles_rq/testing, is the same engine). Nothing is written to Redis, and
Redis need not be up.

What differs from a run on Redis (and is said in the README):

* a question is answered by `answer(question)` (the CLI prompts on a terminal) or, when
  that returns None (stdin is not a terminal), the run is cancelled at the question, as
  Marbles does;
* durable timers do not sleep: the dry run's clock jumps to the timer's due time, so a
  workflow that waits an hour finishes at once, seeing the time it would see then (a
  timeout of a signal or event wait, and the workflow's timeout_s, come due the same way);
* a child run is executed right here, in the same engine;
* nobody sends a dry run a signal or an event: a wait for one without a timeout cancels it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .authoring import REGISTRY, Registry
from .context import Limits
from .memory_engine import MemoryEngine
from .memory_store import MemoryRuns, MemoryWaits
from .ops import RunRequest, prepare
from .runs import TERMINAL, OutputEvent, RunView
from .waits import Question

DRY_WORKER = "dry-run"  # the worker its output and `--json` name
MAX_WAITS = 10_000  # a guard against a workflow that never stops waiting

# An answer to a question, or None to cancel the run at it (stdin is not a terminal).
Answerer = Callable[[Question], Any]


@dataclass(frozen=True)
class DryRun:
    view: RunView
    runs: MemoryRuns


def dry_run(name: str, raw_input: bytes, *, answer: Answerer | None = None,
            on_event: Callable[[str, OutputEvent], None] | None = None,
            on_note: Callable[[str], None] | None = None, registry: Registry = REGISTRY,
            run_id: str | None = None, limits: Limits | None = None) -> DryRun:
    """Execute a run of workflow `name` in this process, in memory (see the module's note).
    The input is validated as `enqueue` validates it (strictly). Returns the finished run."""
    request = RunRequest(name, raw_input, run_id or f"dry-{uuid.uuid4().hex[:12]}",
                         strict=True)
    record = prepare(request, registry)
    engine = MemoryEngine(registry, limits=limits or Limits.from_env(), worker=DRY_WORKER,
                          on_event=on_event)
    engine.store.record(record)
    _drive(engine, record.id, answer, on_note or (lambda text: None))
    view = engine.store.get(record.id)
    assert view is not None
    return DryRun(view, engine.store)


def _drive(engine: MemoryEngine, run_id: str, answer: Answerer | None,
           note: Callable[[str], None]) -> None:
    """Deliver until the run settles, doing in between what a person and the controller
    would: answer questions (the run's and its children's), move the clock to what comes
    due next."""
    store = engine.store
    waits = store.waits()
    for _ in range(MAX_WAITS):
        engine.run_until_idle()
        run = store.runs[run_id]
        if run.status in TERMINAL:
            return
        if _answer_open(engine, run_id, answer, waits):
            continue
        if store.runs[run_id].status in TERMINAL:
            return
        due = engine.next_due_ms()
        if due is None:
            waiting = [r for r in store.runs.values() if r.status == "waiting"]
            reason = waiting[-1].wait_reason if waiting else run.status
            engine.cancel(run_id, f"dry run: cannot wait for {reason}")
            return
        note(f"timer due {_iso(due)}: a dry run does not wait, its clock jumps there")
        engine.advance_to(due)
    engine.cancel(run_id, "dry run: too many waits")


def _answer_open(engine: MemoryEngine, run_id: str, answer: Answerer | None,
                 waits: MemoryWaits) -> bool:
    """Answer the open questions of the runs waiting for one; False when there were none.
    Without an answer the run is cancelled at the question."""
    asked = False
    for rid, run in list(engine.store.runs.items()):
        if run.status != "waiting" or run.wait_reason != "question":
            continue
        for question in waits.questions(rid):
            if question.state != "open":
                continue
            value = None if answer is None else answer(question)
            if value is None:
                engine.cancel(run_id, f"question {question.key!r} was asked and stdin is "
                                      f"not a terminal to answer it")
                return True
            waits.answer(rid, question.key, value)
            asked = True
    return asked


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


__all__ = ["DryRun", "dry_run"]
