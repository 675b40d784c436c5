"""Rerun: a new run of a finished run's workflow with its recorded input, from the top or
from a step. For the CLI (`marbles-rq rerun`) and the dashboard:

    rerun(runs, rq, "order-42", from_step="checkout.charge#0", new_id="order-42-again")

With `from_step`, the new run's ledger starts with the recorded results of the steps that
finished before that step in the old run, so a replay returns them instead of executing
them; that step and everything after it executes. "Before" is the ledger's order: the
order in which the store accepted the entries (each entry carries its execution's epoch
and write number, which the scripts only let grow), never a worker's clock: two steps
finishing in one millisecond, or on workers whose clocks disagree, keep the order they
were committed in. Steps nested inside `from_step` (its own
children) are not copied, since rerunning a step reruns its body; the steps that enclose it
finish after it, so they are not copied either and their bodies run again, replaying their
earlier children from the copied entries. Durable timers recorded before it are copied too
(their due time has passed: they fire at once), and so are child runs started before it
(the new run gathers the same children's results). Answers to questions are not part of
the ledger: a question asked before the step is asked again.

A rerun starts on the workflow's current version (what a new run starts on), not on the
version the old run recorded: a rerun usually follows a fix, and the old version may be
served by no worker any more. From a step, the copied entries are replayed against the
current code as a redelivery after a deploy would be: a step before `from_step` that the
new code calls in another order fails the rerun with NonDeterminism.

Only a finished run (succeeded, failed, cancelled) can be rerun: the ledger of a run that
still executes is still being written, and two live runs of the same work is what a user
asking for a rerun of a running run rarely means (cancel it first).

The new run and its copied ledger are written together (lua/seed_ledger.lua, in one
transaction with claim_run), and its first delivery is enqueued in the same call when the
store and RQ share one Redis: a crash leaves either nothing or the whole new run.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import msgspec

from ..flow.limit_specs import delivery_queue
from ..store.ids import check_id
from ..store.records import RunRecord, StepRecord
from ..transport.first_delivery import FirstDelivery
from ..transport.lanes import RQLike
from .authoring import REGISTRY, InputError, Registry
from .execution import RunNotFoundError
from .ops import check_origin
from .runs import TERMINAL, RunStore, RunView


class RerunError(InputError):
    """A rerun that cannot be made as asked (a run still executing, an unknown step);
    nothing was written. Bad input for the CLI: exit 2."""

    code = "rerun_refused"


@dataclass(frozen=True)
class Rerun:
    run_id: str
    created: bool  # False: a run with the new id existed; it was returned as it is
    status: str
    source: str  # the run it reruns
    from_step: str | None  # the ledger key it reran from, None for from the top
    copied: list[str]  # ledger keys copied from the old run
    dispatched: bool
    record: RunRecord

    def summary(self) -> str:
        """The one line `marbles-rq rerun` prints (and the dashboard shows)."""
        if not self.created:
            return (f"run {self.run_id} exists already ({self.record.name}, {self.status}); "
                    f"nothing written")
        where = f"from step {self.from_step}" if self.from_step else "from the top"
        copied = (f"; {len(self.copied)} step results copied, not executed again: "
                  + ", ".join(self.copied[:10]) + (" ..." if len(self.copied) > 10 else "")
                  if self.copied else "")
        return (f"run {self.run_id} queued: rerun of {self.source} {where}{copied}"
                + ("" if self.dispatched else "; the controller will dispatch it"))


def new_run_id() -> str:
    """The id of a rerun when none is given (the CLI's default; the dashboard's form carries
    one minted when the page was drawn, so a repeated POST is the same rerun)."""
    return uuid.uuid4().hex


def step_key(view: RunView, path: str) -> str:
    """The ledger key `path` names in `view`: `<path>#<n>` as given, or a bare path, which
    means its first call (`#0`). Raises RerunError listing the steps when there is none."""
    keys = [s.key for s in view.steps if not s.name.startswith("|")]
    wanted = path if "#" in path else f"{path}#0"
    if wanted in keys:
        return wanted
    listed = ", ".join(keys[:20]) + (" ..." if len(keys) > 20 else "")
    raise RerunError(f"run {view.record.id} has no step {path!r} (its steps: "
                     f"{listed or 'none'})")


def ledger_before(view: RunView, key: str) -> list[StepRecord]:
    """The finished entries recorded before step `key`, less the ones nested inside it."""
    ordered = view.steps  # RunStore sorts the ledger in commit order (records.ledger_order)
    position = next(i for i, s in enumerate(ordered) if s.key == key)
    inside = key + "."
    kept = [s for s in ordered[:position]
            # "registered": an undo registered with ctx.compensate (engine/compensation.py)
            if s.status in ("succeeded", "waiting", "fired", "registered")
            and not s.key.startswith(inside)]
    # In the new run they precede everything its executions write (epochs from 1), in the
    # order they had.
    return [msgspec.structs.replace(s, epoch=0, wseq=i) for i, s in enumerate(kept, 1)]


def rerun(runs: RunStore, rq: RQLike, run_id: str, *, from_step: str | None = None,
          new_id: str | None = None, registry: Registry = REGISTRY) -> Rerun:
    """Record and enqueue a rerun of `run_id` (see the module's note). Raises
    RunNotFoundError, RerunError, InvalidIdError or UnknownWorkflowError with nothing
    written. The same `new_id` again returns the existing run (`created` False) when it is
    this rerun (of `run_id`, from `from_step`); any other run under it is refused."""
    check_id(run_id, "run id")
    target = new_run_id() if new_id is None else check_id(new_id, "new run id")
    check_origin(target, "")
    view = runs.get(run_id)
    if view is None:
        raise RunNotFoundError(f"no run with id {run_id!r}")
    if view.status not in TERMINAL:
        raise RerunError(f"run {run_id} is {view.status}; only a finished run can be rerun "
                         f"(cancel it first, or wait for it)")
    old = view.record
    definition = registry.workflow(old.name)
    # The recorded input, checked against the workflow as it is now: a rerun of a run whose
    # input no longer fits would only fail in the worker.
    _, recorded_input = definition.parse_input(bytes(old.input))
    key = step_key(view, from_step) if from_step is not None else None
    copied = ledger_before(view, key) if key is not None else []
    record = RunRecord(version=1, id=target, name=definition.name, queue=old.queue,
                       input=msgspec.Raw(recorded_input),
                       requested_at_ms=int(time.time() * 1000),
                       timeout_s=definition.timeout_s,
                       max_deliveries=definition.max_deliveries,
                       retention_s=definition.retention_s, rerun_of=old.id,
                       rerun_from_step=key or "", priority=old.priority,
                       concurrency=old.concurrency, concurrency_label=old.concurrency_label,
                       wf_version=definition.version)
    band = delivery_queue(record)  # its priority band, as every delivery of it
    recorded, dispatched = FirstDelivery(rq, runs.keys, runs.client).record(
        lambda push: runs.record_seeded(record, copied, push), band, record.id)
    existing = recorded.record
    if not recorded.created and (existing.rerun_of, existing.rerun_from_step) != (
            old.id, record.rerun_from_step):
        # The id is taken by something else: answering "exists" would pass that run off as
        # the rerun asked for.
        what = (f"a rerun of {existing.rerun_of} "
                + (f"from step {existing.rerun_from_step}" if existing.rerun_from_step
                   else "from the top") if existing.rerun_of else f"a run of {existing.name}")
        raise RerunError(f"run {target} exists already and is {what}, not this rerun of "
                         f"{old.id}; choose another new id")
    return Rerun(recorded.record.id, recorded.created, recorded.status, old.id, key,
                 [s.key for s in copied] if recorded.created else [], dispatched,
                 recorded.record)
