"""The chaos history checker: `check(history)` returns every violation it finds and the
numbers for the summary. It reads only the History (what the system recorded, what the
workloads and the harness wrote), never Redis, so tests can feed it hand-made histories.

What it asserts (each a violation kind, see KINDS):

* every accepted run is in the store (none lost) and reached exactly one terminal state
  (one ``final`` event, agreeing with the run's status, nothing after it), the one its
  workload must reach; nothing was recorded twice; no run exists that nobody asked for;
* no step result was committed twice, and no step body executed again once its result was
  committed (a body's executions are told apart by their epoch: a run's executions are
  ordered by it, and a step may run again only in an execution no newer than the one that
  committed it, i.e. one that was interrupted); a result names only committed steps;
* every effect was claimed under ``run:step`` (each repeat under the same key), won at most
  once, has its receipt in the store and reached the target exactly once;
* no schedule slot produced two runs (occurrences of one schedule are at least its interval
  apart); no inbound event produced two runs, and each one sent produced its run;
* every question was answered once (one ``answered`` event, one accepted answer, the
  recorded one is the harness's) and its run saw that answer;
* every timer fired exactly once and never early (woken at or after its due time, and the
  steps after it executed only in executions that started at or after it);
* every child ran once (one ``child_started`` each, no extra child runs) and its parent got
  exactly its result;
* no chaos process exited without being killed (unless excused);

and over the combinations (issue 16):

* a run the harness paused and then resumed (its last pause/resume call a resume) finished;
* a parent that gathers children kept one second (``cx_brief``) after sleeping past that
  got every child's outcome (a pruned child is fine once its parent has its result);
* no child of a cancelled parent started a step after the parent's cancel settled (its
  final event), by the step's execution receipt;
* no concurrency limit had more live holds in the store than its limit, in any sample;
* a rerun ``--from-step PATH`` executed none of the steps the source committed before PATH
  (in the server's commit order: the source's journal) and, once succeeded, every step from
  PATH on;
* every execution of a run came from its priority band's RQ queue (``<P>.<queue>`` or
  ``<P>.<queue>~<N>``), whatever redelivered, woke or held it;
and for signals:
* every signal the harness sent (each with its own request id, retried through outages) was
  taken into its run's ledger exactly once, in the order the store numbered them (1, 2, ...
  by the ledger's calls), and that order is the order the harness sent them in (one sender
  per run); a finished run took every signal sent to it before; none was invented;
and for published state and event waits (cx_publish_wait):
* a run's wait took exactly its matching event (type paid, order = its run id), never a
  decoy of the same source nor another run's, whether the event came before the wait opened
  (the lookback) or while it was parked; it was taken once (one ``event_received`` in the
  journal for the wait, naming the event its ledger holds); a run whose matching event the
  store accepted did not time out;
* each publish appears once per ledger position (one ``published`` journal entry for each
  ``|publish`` ledger entry, none without one), and a succeeded run's published state is
  the value it returned;
and for issue 23's records (see each rule's docstring):
* a session keeps each message of a run once, in the run's order (its own session and the
  shared one), and nothing nobody appended;
* an artifact's versions are 1..N with no gap; a finished run's put is exactly one version
  (the one its step returned), by compare-and-set too;
* no two valid holds of the mutex overlap (a hold valid when its fenced read and write both
  found it the lock's holder in the store); no fenced write accepted from an execution that
  did not hold it; no lost update; every finished run held it once.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.chaos.history import AnswerTry, Ev, Execution, History, PauseTry, Run
from tests.chaos.names import (
    ARTIFACT_CAS,
    ARTIFACT_PLAIN,
    ORDER_SOURCE,
    ORDER_TYPE,
    RATE_PER_S,
    RETRY_EXHAUST,
    RETRY_MAX_ATTEMPTS,
    RETRY_PATCH,
    SESSION_SHARED,
    STATE_KEY,
)

TERMINAL = ("succeeded", "failed", "cancelled")
KINDS: dict[str, str] = {
    "lost": "an accepted run, event, child or schedule run is missing from the store",
    "stuck": "a run (or an event) did not reach a terminal state before the deadline",
    "terminal": "a run has not exactly one final event, or its status disagrees with it",
    "outcome": "a run ended otherwise than its workload must",
    "after_final": "a run's journal goes on after its final event",
    "unexpected_run": "a run nobody asked for",
    "enqueued_twice": "a run was recorded twice (two queued events, or two creating enqueues)",
    "step_committed_twice": "a step's result was committed twice",
    "step_rerun": "a step body executed again after its result was committed",
    "step_lost": "a step the result names is not committed, or the ledger and journal differ",
    "effect_twice": "an effect key was won twice, or applied to its target twice",
    "effect_key": "an effect was claimed under another key than run:step, or two keys",
    "effect_missing": "a committed step's effect has no receipt, or never reached its target",
    "schedule_twice": "a schedule slot produced two runs",
    "event_twice": "an inbound event produced two runs (or was created twice)",
    "answer_twice": "a question was answered twice, or another answer than the accepted one "
                    "was recorded",
    "answer_unseen": "a run did not see its recorded answer",
    "patch_changed": "a replay took another patch decision than the run recorded",
    "timer_early": "a timer fired before it was due",
    "timer_once": "a timer did not fire exactly once",
    "child_twice": "a child was started twice, or an extra child run exists",
    "child_result": "a parent did not get its children's results",
    "zombie_write": "an execution's write (a step, an output line) was accepted while it did "
                    "not own its run (fencing failed)",
    "crash": "a chaos process exited without being killed",
    "pause_stranded": "a run paused and then resumed (the last call a resume) never finished",
    "child_pruned": "a parent that gathers late lost a child's outcome (pruned before it was "
                    "gathered)",
    "child_after_cancel": "a child of a cancelled parent started an execution after the "
                          "parent's cancel settled, or began more than the one step in "
                          "flight after its own cancel was asked",
    "limit_exceeded": "a concurrency limit had more live holds than its limit when sampled",
    "rerun_reran": "a rerun executed a step committed before its --from-step (it must be "
                   "copied)",
    "rerun_skipped": "a rerun did not execute its --from-step step or one committed after it",
    "band": "an execution came from another RQ queue than its run's priority band",
    "start_early": "a run asked to start later began an execution before its start time",
    "signal_twice": "a signal was taken into a run's ledger twice, or numbered twice",
    "signal_lost": "a signal the store accepted was never taken by its run, or one was "
                   "taken that nobody sent",
    "signal_order": "a run took its signals out of the order they were sent in",
    "wait_event_wrong": "an event wait took an event that does not match it (a decoy, "
                        "another run's, one nobody sent), or returned another than its ledger "
                        "holds",
    "wait_event_twice": "an event wait was delivered more than once (or taken without a "
                        "delivery in the journal)",
    "wait_event_lost": "a run timed out or finished without the matching event the store had "
                       "accepted",
    "published_twice": "a publish appears other than once for its ledger position in the "
                       "journal",
    "published_stale": "a finished run's published state is not the value it returned",
    "compensation": "a failed or compensation-cancelled run did not undo each registration "
                    "exactly once, in reverse order of registration",
    "retry": "a step under a retry policy did not end as planned: its successful try's "
             "effect not applied exactly once, fewer tries recorded than failures seen, "
             "paused or failed before its tries ran out, or a patched retry that did not "
             "use the patched input",
    "rate_limit": "more step starts of a rate-limited workflow in a one-second window than "
                  "its limit, for one key",
    "session": "a session lost a run's message, kept one twice or out of the run's order, "
               "holds one nobody appended, or cannot be read",
    "artifact": "an artifact's versions are not 1..N without a gap, or a run's put is "
                "missing, made twice, or not the version its step returned",
    "lock": "two valid holds of the mutex overlapped (each entered and left with the lock's "
            "holder in the store being its execution), a fenced write was accepted from "
            "an execution that did not hold it, the counter lost an update, or a finished "
            "run never held the lock",
}
# Journal entries only the execution that owns the run may write.
EXECUTION_WRITES = ("step_started", "step_succeeded", "step_failed", "step_retry", "output",
                    "log", "report", "child_started", "timer_fired", "published")
# Entries after which no execution owns the run until the next attempt_started.
OWNERSHIP_ENDS = ("redelivered", "parked", "final", "deferred", "woken", "compensating")
# Steps with an effect (claim + apply), by step name.
EFFECT_STEPS = ("cx_link", "cx_retry_try", "cx_retry_try_p")
RETRY_STEPS = ("cx_retry_try", "cx_retry_try_p")
RATE_STEP = "cx_rate.cx_link#0"
# Children kept one second after they finish (workloads.py): their outcome, which their
# parent must get even once they are pruned, is a function of their id and input.
BRIEF_CHILD = "cx_brief"
LATE_PARENT = "cx_late_parent"


@dataclass(frozen=True)
class Violation:
    kind: str
    run: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.run}: {self.detail}"


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    by_status: Counter[str] = field(default_factory=Counter)
    by_workflow: Counter[str] = field(default_factory=Counter)
    redeliveries: Counter[str] = field(default_factory=Counter)
    wakes: Counter[str] = field(default_factory=Counter)
    latencies_ms: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    requeue_ms: list[int] = field(default_factory=list)  # kill -> the run queued again
    unredelivered: int = 0  # interrupted executions whose run went on without a new attempt
    slowest: tuple[int, str, str] = (0, "", "")  # (ms, run, fault) of the slowest redelivery
    checked: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str, run: str, detail: str) -> None:
        assert kind in KINDS, kind
        self.violations.append(Violation(kind, run, detail))

    def kinds(self) -> set[str]:
        return {v.kind for v in self.violations}


def check(history: History) -> Report:
    report = Report()
    for run in history.runs.values():
        report.by_status[run.status] += 1
        report.by_workflow[run.name] += 1
        for ev in run.events:
            if ev.type == "redelivered":
                report.redeliveries[str(ev.data.get("reason", "?"))] += 1
            elif ev.type == "woken":
                report.wakes[str(ev.data.get("cause", "?"))] += 1
    _check_membership(history, report)
    cancelled = _cancel_targets(history)
    executions: dict[str, list[Execution]] = defaultdict(list)
    for ex in history.executions:
        executions[ex.run].append(ex)
    answers: dict[str, list[AnswerTry]] = defaultdict(list)
    for attempt in history.answers:
        answers[attempt.run].append(attempt)
    children: dict[str, list[str]] = defaultdict(list)
    for rid, r in history.runs.items():
        if r.parent:
            children[r.parent].append(rid)
    for run in history.runs.values():
        _check_terminal(run, history, cancelled, report)
        _check_steps(run, executions[run.id], report)
        _check_band(run, executions[run.id], report)
        _check_start(run, report)
        _check_fencing(run, executions[run.id], report)
        _check_questions(run, answers[run.id], report)
        _check_timers(run, executions[run.id], report)
        _check_children(run, sorted(children[run.id]), history, report)
    _check_effects(history, report)
    _check_signals(history, report)
    _check_publish_waits(history, report)
    _check_sagas(history, report)
    _check_retries(history, report)
    _check_rates(history, report)
    _check_sessions(history, report)
    _check_artifacts(history, report)
    _check_locks(history, report)
    _check_pauses(history, report)
    _check_cancelled_children(history, executions, report)
    _check_limits(history, report)
    _check_reruns(history, executions, report)
    _check_schedules(history, report)
    _check_events(history, report)
    _check_crashes(history, report)
    _latencies(history, report)
    return report


# -- helpers -----------------------------------------------------------------------------------

def _count(events: Iterable[Ev], type: str, **match: Any) -> int:
    return sum(1 for e in events if e.type == type
               and all(e.data.get(k) == v for k, v in match.items()))


def _frame(key: str) -> str:
    """The frame a ledger key is in: ``wf.|parallel#0[1].cx_link#0`` -> ``wf.|parallel#0[1]``."""
    return key.rsplit(".", 1)[0] if "." in key else ""


def _epochs(run: Run) -> dict[int, int]:
    """Each execution's epoch -> the server time it started."""
    return {int(e.data["epoch"]): e.ms for e in run.events
            if e.type == "attempt_started" and "epoch" in e.data}


def _cancel_targets(history: History) -> set[str]:
    """Runs the harness asked to cancel, with their descendants."""
    targets = {c.run for c in history.cancels}
    changed = True
    while changed:
        changed = False
        for run in history.runs.values():
            if run.parent in targets and run.id not in targets:
                targets.add(run.id)
                changed = True
    return targets


# -- runs: membership and terminal states -----------------------------------------------------

def _child_ids(run: Run, runs: dict[str, Run]) -> list[str]:
    """The children a run recorded, in the order it started them. A parent notes a child in
    its ledger (status running) before it records it: an execution killed between the two
    leaves the note alone, and its redelivery records the child on replay -- unless the
    parent was stopped first. A note without a child is then no child at all."""
    children = [s for s in run.steps.values() if s.name == "|child"
                and isinstance(s.result, dict)
                and not (s.status == "running" and run.status in ("cancelled", "failed")
                         and str(s.result["id"]) not in runs)]
    children.sort(key=lambda s: (_frame(s.key), s.seq, s.key))
    return [str(s.result["id"]) for s in children]


def _check_membership(history: History, report: Report) -> None:
    runs = history.runs
    accepted = {s.run for s in history.submitted if s.created is not None} | {
        r.run for r in history.reruns if not r.outcome.startswith("error")}
    asked = {s.run for s in history.submitted} | {r.run for r in history.reruns}
    events_accepted = {s.key for s in history.sent if s.created is not None}
    events_asked = {s.key for s in history.sent}
    for rid in sorted(accepted | events_accepted):
        if rid not in runs:
            report.add("lost", rid, "accepted, but not in the store")
    children: dict[str, str] = {}
    for run in runs.values():
        for cid in _child_ids(run, runs):
            children[cid] = run.id
            if cid not in runs and not _pruned_as_due(run, cid):
                report.add("lost", cid, f"child of {run.id}, recorded in its ledger, missing")
    scheduled = {rid for rid, run in runs.items() if run.name in history.schedule_workflows
                 and rid.startswith(f"sched:{history.schedule_workflows[run.name]}:")}
    for rid, run in sorted(runs.items()):
        if rid in asked or rid in events_asked or rid in scheduled:
            continue
        if rid in children:
            continue
        report.add("unexpected_run", rid, f"{run.name} (parent {run.parent}) was never "
                   f"submitted, sent, started as a child or scheduled")
    created = Counter(s.run for s in history.submitted if s.created)
    for rid, n in created.items():
        if n > 1:
            report.add("enqueued_twice", rid, f"{n} enqueues answered created")


def _check_terminal(run: Run, history: History, cancelled: set[str], report: Report) -> None:
    report.checked["runs"] += 1
    finals = [i for i, e in enumerate(run.events) if e.type == "final"]
    if run.status not in TERMINAL:
        last = run.events[-1] if run.events else None
        report.add("stuck", run.id, f"{run.name} is {run.status} (attempt {run.attempt}); "
                   f"last event {last.type if last else None} "
                   f"{last.data if last else ''}")
        return
    if len(finals) != 1:
        report.add("terminal", run.id, f"{len(finals)} final events")
    else:
        final = run.events[finals[0]]
        if final.data.get("status") != run.status:
            report.add("terminal", run.id, f"final event says {final.data.get('status')}, "
                       f"the run says {run.status}")
        after = run.events[finals[0] + 1:]
        if after:
            report.add("after_final", run.id, f"{[e.type for e in after]} after the final event")
    queued = _count(run.events, "queued")
    if queued != 1:
        report.add("enqueued_twice" if queued > 1 else "terminal", run.id,
                   f"{queued} queued events")
    expected = _expected_outcome(run, cancelled)
    if run.status not in expected:
        error = run.error or {}
        report.add("outcome", run.id, f"{run.name} ended {run.status}, expected "
                   f"{'/'.join(expected)} ({error.get('type')}: {error.get('message')})")


def _expected_outcome(run: Run, cancelled: set[str]) -> tuple[str, ...]:
    if run.name == "cx_saga":  # its last step is doomed
        return ("failed", "cancelled") if run.id in cancelled else ("failed",)
    if run.name == "cx_retry" and isinstance(run.input, dict):
        exhausts = int(run.input.get("fails", 0)) >= RETRY_EXHAUST
        return ("failed",) if exhausts and not run.input.get("pause") else ("succeeded",)
    if run.id in cancelled:
        return ("cancelled", "succeeded")
    if run.name in ("cx_chain", "cx_async_chain") and isinstance(run.input, dict) and (
            run.input.get("doomed")):
        return ("failed",)
    return ("succeeded",)


# -- steps ---------------------------------------------------------------------------------------

def _check_steps(run: Run, executions: list[Execution], report: Report) -> None:
    succeeded = Counter(e.data.get("step") for e in run.events if e.type == "step_succeeded")
    failed = Counter(e.data.get("step") for e in run.events if e.type == "step_failed")
    for counts, what in ((succeeded, "succeeded"), (failed, "failed")):
        for key, n in counts.items():
            if n > 1:
                report.add("step_committed_twice", run.id, f"step {key} {what} {n} times")
    # The epoch of the execution that committed each step, and the retries per execution.
    epoch = 0
    committed: dict[str, int] = {}
    retries: Counter[tuple[str, int]] = Counter()
    for ev in run.events:
        if ev.type == "attempt_started":
            epoch = int(ev.data.get("epoch", epoch))
        elif ev.type in ("step_succeeded", "step_failed"):
            committed.setdefault(str(ev.data.get("step")), epoch)
        elif ev.type == "step_retry":
            retries[(str(ev.data.get("step")), epoch)] += 1
    runs_of: Counter[tuple[str, int]] = Counter()
    for ex in executions:
        runs_of[(ex.step, ex.epoch)] += 1
        done = committed.get(ex.step)
        if done is not None and ex.epoch > done:
            report.add("step_rerun", run.id, f"step {ex.step} executed in epoch {ex.epoch} "
                       f"(attempt {ex.attempt}) after epoch {done} committed it")
    for (step, ep), n in runs_of.items():
        if n > 1 + retries[(step, ep)]:
            report.add("step_rerun", run.id, f"step {step} executed {n} times in epoch {ep} "
                       f"with {retries[(step, ep)]} retries")
    copied = _copied(run)
    for key, step in run.steps.items():
        if step.name.startswith("|") or key in copied:
            continue
        report.checked["steps"] += 1
        if step.status == "succeeded" and succeeded[key] != 1:
            report.add("step_lost", run.id, f"ledger says {key} succeeded; the journal has "
                       f"{succeeded[key]} step_succeeded events")
    if run.status != "succeeded" or not isinstance(run.result, dict):
        return
    named: set[str] = set()
    for key in run.result.get("steps", []):
        path = _path_of(run.id, key)
        if path is None and run.rerun_of and _path_of(run.rerun_of, key) in copied:
            named.add(str(_path_of(run.rerun_of, key)))
            continue
        if path is None:
            report.add("step_lost", run.id, f"the result names {key!r}, not a step of the run")
            continue
        named.add(path)
        step = run.steps.get(path)
        if step is None or step.status != "succeeded" or succeeded[path] != 1:
            report.add("step_lost", run.id, f"the result names step {path}, which is "
                       f"{'missing' if step is None else step.status} in the ledger")
    extra = [k for k, s in run.steps.items() if not s.name.startswith("|")
             and s.status == "succeeded" and k not in named and k not in copied]
    if extra:
        report.add("step_lost", run.id, f"committed steps the result does not name: {extra}")


def _check_fencing(run: Run, executions: list[Execution], report: Report) -> None:
    """Every execution write lands while its execution owns the run: after its
    attempt_started and before the run moves on (redelivered, parked, final ...). An output
    line names its writer's epoch; a commit must come from an execution of the epoch that
    owned the run then (its body left a receipt under that epoch)."""
    ran = {(ex.step, ex.epoch) for ex in executions}
    owner: int | None = None
    for ev in run.events:
        if ev.type == "attempt_started":
            owner = int(ev.data.get("epoch", 0))
        elif ev.type in OWNERSHIP_ENDS:
            owner = None
        elif ev.type in EXECUTION_WRITES:
            if owner is None:
                report.add("zombie_write", run.id, f"{ev.type} {ev.data} while no execution "
                           f"owned the run")
                continue
            value = ev.data.get("value")
            if ev.type == "output" and isinstance(value, dict) and "epoch" in value \
                    and value["epoch"] != owner:
                report.add("zombie_write", run.id, f"output of epoch {value['epoch']} "
                           f"accepted while epoch {owner} owned the run")
            step = ev.data.get("step")
            if ev.type == "step_succeeded" and isinstance(step, str) and run.steps.get(
                    step, None) is not None and not run.steps[step].name.startswith("|") \
                    and (step, owner) not in ran:
                report.add("zombie_write", run.id, f"step {step} committed while epoch "
                           f"{owner} owned the run, which never executed it")


def _path_of(run_id: str, idempotency_key: Any) -> str | None:
    if not isinstance(idempotency_key, str) or not idempotency_key.startswith(run_id + ":"):
        return None
    return idempotency_key[len(run_id) + 1:]


# -- effects -------------------------------------------------------------------------------------

def _check_effects(history: History, report: Report) -> None:
    applied = Counter(history.applied)
    for key, n in applied.items():
        if n > 1:
            report.add("effect_twice", key.split(":", 1)[0], f"effect {key} applied {n} times")
    keys_of: dict[tuple[str, str], set[str]] = defaultdict(set)
    won: Counter[str] = Counter()
    for claim in history.claims:
        keys_of[(claim.run, claim.step)].add(claim.key)
        if claim.outcome == "won":
            won[claim.key] += 1
    for (rid, step), keys in keys_of.items():
        if keys != {f"{rid}:{step}"}:
            report.add("effect_key", rid, f"step {step} claimed under {sorted(keys)}")
    for key, n in won.items():
        if n > 1:
            report.add("effect_twice", key.split(":", 1)[0], f"effect {key} won {n} times")
    for run in history.runs.values():
        for key, scope in run.effects.items():
            if scope != run.id or _path_of(run.id, key) not in run.steps \
                    or _path_of(run.id, key) in _copied(run):
                report.add("effect_key", run.id, f"receipt {key} (scope {scope}) names no "
                           f"step of the run")
        copied = _copied(run)
        for path, step in run.steps.items():
            if step.name not in EFFECT_STEPS or step.status != "succeeded" or path in copied:
                continue
            report.checked["effects"] += 1
            key = f"{run.id}:{path}"
            if key not in run.effects:
                report.add("effect_missing", run.id, f"step {path} committed without its "
                           f"effect receipt {key}")
            if applied[key] == 0:
                report.add("effect_missing", run.id, f"effect {key} never reached the target")


# -- schedules -----------------------------------------------------------------------------------

def _check_schedules(history: History, report: Report) -> None:
    for key, every in sorted(history.schedule_every_ms.items()):
        prefix = f"sched:{key}:"
        nominal = sorted(int(rid[len(prefix):]) for rid in history.runs
                         if rid.startswith(prefix) and rid[len(prefix):].isdigit())
        report.checked[f"schedule {key}"] += len(nominal)
        for before, after in itertools.pairwise(nominal):
            if after - before < every:
                report.add("schedule_twice", f"{prefix}{after}", f"fired {after - before} ms "
                           f"after the occurrence at {before}; the interval is {every} ms")
    by_key = {str(s.get("key")): s for s in history.schedules}
    for key in history.schedule_every_ms:
        view = by_key.get(key)
        if view is None:
            report.add("lost", key, "the schedule is not in `schedules --json`")
            continue
        last = view.get("lastRun")
        if last and last not in history.runs:
            report.add("lost", str(last), f"schedule {key}'s last run is not in the store")


# -- events --------------------------------------------------------------------------------------

def _check_events(history: History, report: Report) -> None:
    created = Counter(s.key for s in history.sent if s.created)
    for key, n in created.items():
        if n > 1:
            report.add("event_twice", key, f"{n} sends answered created")
    journal = {str(e.get("key")): e for e in history.event_journal}
    for key in sorted({s.key for s in history.sent if s.created is not None}):
        report.checked["events"] += 1
        entry = journal.get(key)
        if entry is None:
            report.add("lost", key, "a sent event is not in the event journal")
            continue
        if entry.get("state") != "started" or entry.get("run") != key:
            report.add("stuck" if entry.get("state") == "pending" else "lost", key,
                       f"event is {entry.get('state')} with run {entry.get('run')}")
    by_event: dict[str, list[str]] = defaultdict(list)
    for run in history.runs.values():
        if run.name != "cx_event" or not isinstance(run.input, dict):
            continue
        by_event[str(run.input.get("id"))].append(run.id)
        if run.input.get("key") != run.id:
            report.add("event_twice", run.id, f"an event run under another id than its "
                       f"event's key {run.input.get('key')}")
        if run.status == "succeeded" and isinstance(run.result, dict) \
                and run.result.get("event") != run.input.get("id"):
            report.add("outcome", run.id, f"event run saw event {run.result.get('event')}")
    for event_id, ids in by_event.items():
        if len(ids) > 1:
            report.add("event_twice", ids[0], f"event {event_id} produced runs {ids}")


# -- questions -----------------------------------------------------------------------------------

def _check_questions(run: Run, tries: list[AnswerTry], report: Report) -> None:
    answered = Counter(e.data.get("key") for e in run.events if e.type == "answered")
    for key, n in answered.items():
        if n > 1:
            report.add("answer_twice", run.id, f"question {key}: {n} answered events")
    for key, q in run.questions.items():
        report.checked["questions"] += 1
        mine = [t for t in tries if t.key == key]
        accepted = [t for t in mine if t.outcome == "accepted"]
        if len(accepted) > 1:
            report.add("answer_twice", run.id, f"question {key}: {len(accepted)} answers "
                       f"accepted ({[t.value for t in accepted]})")
        if q["state"] != "answered":
            if run.status == "succeeded" or run.status not in TERMINAL:
                report.add("answer_unseen", run.id, f"question {key} is {q['state']}")
            continue
        if accepted and q["answer"] != accepted[0].value:
            report.add("answer_twice", run.id, f"question {key}: recorded {q['answer']!r}, "
                       f"accepted {accepted[0].value!r}")
        elif not accepted and q["answer"] not in [t.value for t in mine
                                                  if t.outcome == "error"]:
            report.add("answer_twice", run.id, f"question {key}: recorded {q['answer']!r}, "
                       f"which the harness never sent (or only had refused)")
        if answered[key] != 1:
            report.add("answer_twice" if answered[key] else "answer_unseen", run.id,
                       f"question {key}: {answered[key]} answered events")
        if run.status == "succeeded" and isinstance(run.result, dict) \
                and run.result.get("answer") != q["answer"]:
            report.add("answer_unseen", run.id, f"question {key}: the run saw "
                       f"{run.result.get('answer')!r}, the recorded answer is {q['answer']!r}")
    if run.name == "cx_ask" and run.status == "succeeded" and not run.questions:
        report.add("answer_unseen", run.id, "succeeded without its question recorded")
    if run.name == "cx_ask" and run.status == "succeeded" and isinstance(run.result, dict):
        report.checked["patches"] += 1
        recorded = [s for s in run.steps.values() if s.name == "|patch:cx-ask-patch"]
        if run.result.get("patched") is not True or len(recorded) != 1:
            report.add("patch_changed", run.id, f"patch decision {run.result.get('patched')!r}, "
                       f"{len(recorded)} recorded (every run starts on the patched code)")


# -- timers --------------------------------------------------------------------------------------

def _check_timers(run: Run, executions: list[Execution], report: Report) -> None:
    timers = [s for s in run.steps.values() if s.name == "|sleep"]
    if not timers:
        return
    woken = [e for e in run.events if e.type == "woken" and e.data.get("cause") == "timer"]
    if len(woken) > len(timers):
        report.add("timer_once", run.id, f"{len(timers)} timers, {len(woken)} timer wakes")
    # A timer fires where an execution passes it (whatever woke the run): its ledger entry
    # says fired, and one timer_fired names it.
    fired = Counter(str(e.data.get("timer")) for e in run.events if e.type == "timer_fired")
    starts = _epochs(run)
    for timer in timers:
        report.checked["timers"] += 1
        due = int(timer.result["due_ms"]) if isinstance(timer.result, dict) else 0
        if fired[timer.key] > 1 or (run.status == "succeeded" and (
                fired[timer.key] != 1 or timer.status != "fired")):
            report.add("timer_once", run.id, f"timer {timer.key} is {timer.status}, fired "
                       f"{fired[timer.key]} times")
        fired_ms = timer.result.get("fired_ms") if isinstance(timer.result, dict) else None
        if isinstance(fired_ms, int) and fired_ms < due:
            report.add("timer_early", run.id, f"timer {timer.key} due {due} fired at {fired_ms}")
        for ev in woken:
            if ev.ms < due:
                report.add("timer_early", run.id, f"timer {timer.key} due {due} woken at "
                           f"{ev.ms}")
        frame = _frame(timer.key)
        after = {k for k, s in run.steps.items() if _frame(k) == frame and s.seq > timer.seq}
        for ex in executions:
            if ex.step not in after:
                continue
            started = starts.get(ex.epoch)
            if started is None or started < due:
                report.add("timer_early", run.id, f"step {ex.step} after timer {timer.key} "
                           f"(due {due}) executed in epoch {ex.epoch} started at {started}")


# -- children ------------------------------------------------------------------------------------

def _check_children(run: Run, mine: list[str], history: History, report: Report) -> None:
    started = Counter(str(e.data.get("child")) for e in run.events if e.type == "child_started")
    for cid, n in started.items():
        if n > 1:
            report.add("child_twice", run.id, f"child {cid} started {n} times")
    ids = _child_ids(run, history.runs)
    report.checked["children"] += len(ids)
    present = sorted({c for c in ids if c in history.runs or not _pruned_as_due(run, c)})
    if present != mine or len(ids) != len(set(ids)):
        report.add("child_twice", run.id, f"ledger children {ids}, runs with this parent "
                   f"{mine}")
    if run.name == LATE_PARENT:
        report.checked["children gathered late"] += len(ids)
        if run.status != "succeeded":
            gone = [c for c in ids if c not in history.runs]
            message = str((run.error or {}).get("message", ""))
            if gone or "exist" in message:
                report.add("child_pruned", run.id, f"ended {run.status} ({message}); children "
                           f"missing from the store: {gone}")
    if run.status != "succeeded" or not isinstance(run.result, dict) \
            or "children" not in run.result:
        return
    results = [history.runs[c].result if c in history.runs else _brief_result(run, c)
               for c in ids]
    if run.result["children"] != results:
        report.add("child_result", run.id, f"got {run.result['children']}, its children "
                   f"returned {results}")


def _brief_children(run: Run) -> dict[str, int]:
    """A late parent's cx_brief children -> their input index (their key is b<i>)."""
    out = {}
    for step in run.steps.values():
        if step.name == "|child" and isinstance(step.result, dict) \
                and step.result.get("workflow") == BRIEF_CHILD:
            cid = str(step.result["id"])
            tail = cid.rsplit(".", 1)[-1]
            if tail[:1] == "b" and tail[1:].isdigit():
                out[cid] = int(tail[1:])
    return out


def _pruned_as_due(parent: Run, cid: str) -> bool:
    """A missing child that was kept one second and whose parent finished: pruned as due
    (whether the parent got its outcome first is the child_result check's)."""
    return parent.status in TERMINAL and cid in _brief_children(parent)


def _brief_result(parent: Run, cid: str) -> Any:
    index = _brief_children(parent).get(cid)
    if index is None:
        return None
    return {"i": index, "steps": [f"{cid}:{BRIEF_CHILD}.cx_link#0"]}


# -- the combinations: pause, cancel while children start, limits, reruns, bands ---------------

def _check_pauses(history: History, report: Report) -> None:
    calls: dict[str, list[PauseTry]] = defaultdict(list)
    for call in history.pauses:
        calls[call.run].append(call)
    for rid, mine in sorted(calls.items()):
        run = history.runs.get(rid)
        report.checked["paused runs"] += 1
        if run is not None and any(e.type == "parked" and e.data.get("reason") == "paused"
                                   for e in run.events):
            report.checked["paused runs parked"] += 1
        if run is None or mine[-1].op != "resume":
            continue  # a missing run is lost; a last pause leaves the run paused by design
        if run.status not in TERMINAL:
            last = run.events[-1] if run.events else None
            report.add("pause_stranded", rid, f"{run.status} after its last call, a resume "
                       f"({mine[-1].outcome}); calls: "
                       + ", ".join(f"{c.op}={c.outcome}" for c in mine)
                       + f"; last event {last.type if last else None} "
                       f"{last.data if last else ''}")


def _check_signals(history: History, report: Report) -> None:
    sends: dict[str, list[Any]] = defaultdict(list)
    for attempt in history.signals:
        sends[attempt.run].append(attempt)
    for rid, mine in sorted(sends.items()):
        run = history.runs.get(rid)
        if run is None:
            continue  # a missing run is "lost" (membership)
        report.checked["signals"] += len({t.index for t in mine})
        accepted = {t.index: t.seq for t in mine if t.outcome in ("ok", "created", "exists")}
        unknown = {t.index for t in mine if t.outcome.startswith("error")} - set(accepted)
        seqs = Counter(accepted.values())
        for seq, n in seqs.items():
            if n > 1:
                report.add("signal_twice", rid, f"{n} signals were numbered #{seq}")
        # What the run took, by its ledger: one entry per wait, in call order.
        taken = sorted((s for s in run.steps.values() if s.name == "|signal"
                        and s.status == "received"), key=lambda s: s.seq)
        got = [(int(s.result["seq"]), s.result["payload"]) for s in taken
               if isinstance(s.result, dict)]
        if [seq for seq, _ in got] != list(range(1, len(got) + 1)):
            report.add("signal_order", rid, f"taken as #{[seq for seq, _ in got]}, not 1, 2, "
                       f"... in the order of its waits")
        indices = [p.get("i") if isinstance(p, dict) else p for _, p in got]
        if len(set(indices)) != len(indices):
            report.add("signal_twice", rid, f"took signals {indices}: one twice")
        for (seq, payload), i in zip(got, indices, strict=True):
            if not isinstance(payload, dict) or payload.get("run") != rid or (
                    i not in accepted and i not in unknown):
                report.add("signal_lost", rid, f"took {payload!r} as #{seq}, which the "
                           f"harness never sent it")
            elif i in accepted and accepted[i] != seq:
                report.add("signal_order", rid, f"signal {i} was numbered #{accepted[i]} "
                           f"when sent, taken as #{seq}")
        numbered = [accepted[i] for i in sorted(accepted)]
        if numbered != sorted(numbered):
            report.add("signal_order", rid, f"signals sent one after the other in index "
                       f"order were numbered {numbered}")
        sent_order = [t.index for t in sorted((t for t in mine if t.index in accepted),
                                              key=lambda t: accepted[t.index])]
        if [i for i in indices if i in accepted] != sent_order[:len(
                [i for i in indices if i in accepted])]:
            report.add("signal_order", rid, f"took {indices}, sent in the order {sent_order}")
        if run.status == "succeeded" and isinstance(run.result, dict):
            if run.result.get("signals") != [p for _, p in got]:
                report.add("signal_lost", rid, f"the run returned {run.result.get('signals')}"
                           f", its ledger took {[p for _, p in got]}")
            wanted = run.input.get("n") if isinstance(run.input, dict) else None
            if not run.result.get("timed_out") and len(got) != wanted:
                report.add("signal_lost", rid, f"took {len(got)} of its {wanted} signals")
            missing = sorted(set(accepted) - set(indices))
            if missing and len(got) == wanted:
                report.add("signal_lost", rid, f"signals {missing} were accepted but the run "
                           f"finished without them")
            elif missing and run.result.get("timed_out"):
                report.add("signal_lost", rid, f"timed out waiting although signals "
                           f"{missing} were accepted")


def _check_publish_waits(history: History, report: Report) -> None:
    sends: dict[str, list[Any]] = defaultdict(list)
    for sent in history.orders:
        sends[sent.run].append(sent)
    for run in history.runs.values():
        if run.name != "cx_publish_wait":
            continue
        _check_published(run, report)
        mine = sends.get(run.id, [])
        matching = {o.event_id for o in mine if not o.decoy}
        accepted = {o.event_id for o in mine if not o.decoy and o.created is not None}
        received = Counter(str(e.data.get("wait")) for e in run.events
                           if e.type == "event_received")
        waits = [s for s in run.steps.values() if s.name == "|event"]
        report.checked["event waits"] += len(waits)
        # How the wait got it: parked first (delivered by a sender), or at once (the lookback
        # found an event sent before the wait opened, or a sender's delivery while it ran).
        if any(e.type == "parked" and e.data.get("reason") == "event" for e in run.events):
            report.checked["event waits parked"] += 1
        elif any(w.status == "received" for w in waits):
            report.checked["event waits taken at once"] += 1
        report.checked["decoy events"] += len({o.event_id for o in mine
                                               if o.decoy and o.created})
        got = None
        for wait in waits:
            n = received[wait.key]
            if n > 1 or (n == 0 and wait.status == "received"):
                report.add("wait_event_twice", run.id, f"wait {wait.key} ({wait.status}) has "
                           f"{n} event_received entries in the journal")
            if wait.status != "received" or not isinstance(wait.result, dict):
                continue
            got = wait.result
            named = {str(e.data.get("event")) for e in run.events
                     if e.type == "event_received" and e.data.get("wait") == wait.key}
            payload = got.get("payload")
            if got.get("id") not in matching or got.get("source") != ORDER_SOURCE \
                    or got.get("type") != ORDER_TYPE or not isinstance(payload, dict) \
                    or payload.get("order") != run.id:
                report.add("wait_event_wrong", run.id, f"wait {wait.key} took event "
                           f"{got.get('id')} ({got.get('type')} {payload}); its match is "
                           f"{sorted(matching)}")
            elif named and named != {got.get("key")}:
                report.add("wait_event_wrong", run.id, f"the journal delivered {named} to "
                           f"{wait.key}, its ledger holds {got.get('key')}")
        for key, n in received.items():
            if key not in {w.key for w in waits}:
                report.add("wait_event_twice", run.id, f"{n} event_received entries for "
                           f"{key}, which is no wait in the ledger")
        if run.status != "succeeded" or not isinstance(run.result, dict):
            continue
        state = run.result.get("state")
        if not isinstance(state, dict):
            report.add("outcome", run.id, f"returned {run.result}")
            continue
        if state.get("stage") == "timed_out" or got is None:
            if accepted:
                report.add("wait_event_lost", run.id, f"ended {state.get('stage')} although "
                           f"its event {sorted(accepted)} was accepted")
        elif (state.get("event"), state.get("payload")) != (got.get("id"), got.get("payload")):
            report.add("wait_event_wrong", run.id, f"returned event {state.get('event')}, "
                       f"its ledger took {got.get('id')}")


def _check_sagas(history: History, report: Report) -> None:
    """Every cx_saga run that failed or was cancelled undid each of its registrations (in
    its ledger's commit order: a step's success with compensate=, or a ctx.compensate
    entry) exactly once, the last registered first: the order its undos' effects reached
    the target, each undo naming what it undid."""
    applied = history.applied
    first = {key: i for i, key in reversed(list(enumerate(applied)))}
    for run in history.runs.values():
        if run.name != "cx_saga" or run.status not in ("failed", "cancelled"):
            continue
        report.checked["compensated runs"] += 1
        registered = []
        for key, step in run.steps.items():  # the ledger's commit order
            if step.name == "|undo" and step.status == "registered":
                registered.append(f"rel{step.result['args'][0]}")
            elif step.name == "cx_saga_do" and step.status == "succeeded":
                registered.append(f"do{key.rsplit('#', 1)[1]}")
        expected = list(reversed(registered))
        undos = {key: step for key, step in run.steps.items()
                 if key.startswith("|compensate.")}
        done = sorted((first[f"{run.id}:{key}"], step.result) for key, step in undos.items()
                      if f"{run.id}:{key}" in first)
        actual = [label for _, label in done]
        times = Counter(applied.count(f"{run.id}:{key}") for key in undos)
        report.checked["undos"] += len(expected)
        if actual != expected or any(s.status != "succeeded" for s in undos.values()) \
                or set(times) - {1}:
            report.add("compensation", run.id,
                       f"registered {registered}; undone in order {actual}; undo steps "
                       f"{ {k: s.status for k, s in undos.items()} }")


def _check_retries(history: History, report: Report) -> None:
    """Every cx_retry run's step: its successful try applied its effect exactly once (a
    failed step's never); it records at least as many tries as the failures its journal
    shows since its last retry by hand, each of them a try the workload counted; a run whose
    tries ran out paused (or failed) only after all of them; a patched retry succeeded with
    the patched input."""
    applied = Counter(history.applied)
    retried: dict[str, list[str]] = defaultdict(list)
    for attempt in history.retries:
        retried[attempt.run].append(attempt.outcome)
    for run in history.runs.values():
        if run.name != "cx_retry" or run.status not in TERMINAL:
            continue
        report.checked["retry runs"] += 1
        problems = []
        steps = [s for s in run.steps.values() if s.name in RETRY_STEPS]
        if len(steps) != 1:
            report.add("retry", run.id, f"{len(steps)} retried steps in its ledger")
            continue
        step = steps[0]
        key = f"{run.id}:{step.key}"
        mine = [e for e in run.events if e.data.get("step") == step.key]
        # The failed tries of each round (a retry by hand starts the next, its tries
        # counted from 1): a parked retry or an in-worker one, the last failure (the step
        # failed, or paused on it). A run woken early parks again on the same try.
        rounds: list[set[int]] = [set()]
        for e in mine:
            if e.type == "step_retried":
                rounds.append(set())
            elif e.type in ("step_retry", "step_failed") or (
                    e.type == "parked" and e.data.get("reason") == "retry"):
                rounds[-1].add(int(e.data.get("attempt", 0)))
            elif e.type == "parked" and e.data.get("reason") == "failed_step":
                rounds[-1].add(int(e.data.get("attempts", 0)))
        failures = rounds[-1]
        every = sum(len(r) for r in rounds)
        parks = [e for e in mine if e.type == "parked"
                 and e.data.get("reason") == "failed_step"]
        report.checked["retry failures"] += every
        want = 1 if step.status == "succeeded" else 0
        if applied[key] != want:
            problems.append(f"effect applied {applied[key]} times, step {step.status}")
        if step.attempts < len(failures) + want:
            problems.append(f"{step.attempts} tries recorded, {len(failures)} failed since "
                            f"its last retry by hand")
        counted = history.retry_tries.get(key, 0)
        if counted < every + want:
            problems.append(f"the workload counted {counted} tries; the journal has "
                            f"{every} failures")
        for park in parks:
            if park.data.get("attempts") != RETRY_MAX_ATTEMPTS:
                problems.append(f"paused after {park.data.get('attempts')} tries")
        if step.status == "failed" and max(failures, default=0) != RETRY_MAX_ATTEMPTS:
            problems.append(f"failed after tries {sorted(failures)}")
        if run.input.get("pause") and run.input.get("fails", 0) >= RETRY_EXHAUST:
            report.checked["retries patched"] += 1
            patched = [e for e in mine if e.type == "step_retried"]
            got = run.result.get("try") if isinstance(run.result, dict) else None
            if [e.data.get("patch") for e in patched] != [RETRY_PATCH] or not parks:
                problems.append(f"retried by hand {[e.data for e in patched]} after "
                                f"{len(parks)} pauses (harness: {retried[run.id]})")
            if run.status == "succeeded" and (not isinstance(got, dict)
                                              or got.get("fails") != RETRY_PATCH["fails"]):
                problems.append(f"succeeded with {got}, not the patched input")
        if problems:
            report.add("retry", run.id, f"step {step.key}: " + "; ".join(problems))


def _check_rates(history: History, report: Report) -> None:
    """cx_rate (10/s per lane): the server's start of each run's step (its first), by lane;
    no half-open one-second window holds more than the limit."""
    starts: dict[str, list[int]] = defaultdict(list)
    for run in history.runs.values():
        if run.name != "cx_rate" or not isinstance(run.input, dict):
            continue
        for ev in run.events:
            if ev.type == "step_started" and ev.data.get("step") == RATE_STEP:
                starts[str(run.input.get("lane"))].append(int(ev.data.get("started_ms")
                                                              or ev.ms))
                break
    for lane, times in sorted(starts.items()):
        report.checked[f"rate-limited starts lane={lane}"] += len(times)
        most, at = most_in_window(times, 1000)
        if most > RATE_PER_S:
            report.add("rate_limit", f"cx_rate[lane={lane}]",
                       f"{most} step starts in the second from {at} ms (limit "
                       f"{RATE_PER_S}/s)")


# -- sessions, artifacts and the mutex (issue 23) -------------------------------------------

def _sequence_problem(got: list[Any], want: list[Any]) -> str:
    """How `got` differs from `want`: missing items, items kept twice, or out of order."""
    if got == want:
        return ""
    counts = Counter(map(repr, got))
    missing = [w for w in want if repr(w) not in counts]
    twice = sorted({g for g in map(repr, got) if counts[g] > 1})
    extra = [g for g in got if g not in want]
    parts = [f"missing {missing}"] if missing else []
    parts += [f"twice {twice}"] if twice else []
    parts += [f"never appended {extra}"] if extra else []
    return "; ".join(parts) or f"out of order: {got}"


def _check_sessions(history: History, report: Report) -> None:
    """cx_session: a succeeded run's own session holds exactly its messages 0..2n, in
    order, once each (the body's appends replayed by every later execution, a step's again
    by its redelivery); the shared session holds each of its steps' messages and its last
    body message once, in the run's order, and nothing nobody appended. A run that did not
    succeed kept each message at most once, in order."""
    shared = history.sessions.get(SESSION_SHARED)
    in_shared: dict[str, list[Any]] = defaultdict(list)
    for message in shared or []:
        if not isinstance(message, dict) or "run" not in message:
            report.add("session", SESSION_SHARED, f"message {message!r} names no run")
            continue
        in_shared[str(message["run"])].append(message.get("i"))
    sharing = [r for r in history.runs.values() if r.name == "cx_session"
               and isinstance(r.input, dict) and r.input.get("shared")
               and r.status == "succeeded"]
    if sharing and shared is None:
        report.add("session", SESSION_SHARED, f"missing or unreadable, though {len(sharing)} "
                   f"runs appended to it")
    for run in history.runs.values():
        if run.name != "cx_session" or not isinstance(run.input, dict):
            continue
        n = int(run.input.get("steps", 0))
        want_own = list(range(2 * n + 1))
        want_shared = [2 * k + 1 for k in range(n)] + [2 * n + 1] \
            if run.input.get("shared") else []
        got_shared = in_shared.pop(run.id, [])
        if run.status != "succeeded" or not isinstance(run.result, dict):
            if len(set(map(repr, got_shared))) != len(got_shared) \
                    or any(g not in want_shared for g in got_shared):
                report.add("session", run.id, f"{run.status}: the shared session holds "
                           f"{got_shared} of its messages")
            continue
        report.checked["session runs"] += 1
        sid = str(run.result.get("session"))
        messages = history.sessions.get(sid)
        if messages is None:
            report.add("session", run.id, f"its session {sid} is missing or unreadable")
            continue
        got = [m.get("i") for m in messages if isinstance(m, dict) and m.get("run") == run.id]
        foreign = [m for m in messages if not (isinstance(m, dict) and m.get("run") == run.id)]
        report.checked["session messages"] += len(got) + len(got_shared)
        problem = _sequence_problem(got, want_own)
        if problem:
            report.add("session", run.id, f"its session {sid}: {problem}")
        if foreign:
            report.add("session", run.id, f"its session {sid} holds {len(foreign)} messages "
                       f"of others: {foreign[:3]}")
        problem = _sequence_problem(got_shared, want_shared)
        if problem:
            report.add("session", run.id, f"{SESSION_SHARED}: {problem}")
    for rid, got in sorted(in_shared.items()):
        report.add("session", rid, f"{SESSION_SHARED} holds messages {got} of a run that is "
                   f"no cx_session run in the store")


def _check_artifacts(history: History, report: Report) -> None:
    """cx_artifact: each artifact's versions are 1..N with no gap; each version names one
    run's put (no two the same: a redelivered put made once); a succeeded run's put is in
    its artifact exactly once, as the version its step returned (by compare-and-set too: no
    lost write); a run that did not succeed put at most one."""
    put_by: dict[tuple[str, str], list[int]] = defaultdict(list)
    for name, versions in sorted(history.artifacts.items()):
        numbers = sorted(v.version for v in versions)
        report.checked[f"artifact versions {name}"] += len(numbers)
        if numbers != list(range(1, len(numbers) + 1)):
            report.add("artifact", name, f"versions {numbers}: not 1..{len(numbers)}")
        for v in versions:
            try:
                content = json.loads(v.content)
                put_by[(name, str(content["run"]))].append(v.version)
            except (ValueError, KeyError, TypeError):
                report.add("artifact", name, f"version {v.version} holds {v.content[:80]!r}, "
                           f"which no run put")
    for run in history.runs.values():
        if run.name != "cx_artifact" or not isinstance(run.input, dict):
            continue
        name = ARTIFACT_CAS if run.input.get("cas") else ARTIFACT_PLAIN
        mine = put_by.pop((name, run.id), [])
        if run.status != "succeeded" or not isinstance(run.result, dict):
            if len(mine) > 1:
                report.add("artifact", run.id, f"{run.status}, with {len(mine)} versions of "
                           f"{name}: {mine}")
            continue
        report.checked["artifact puts"] += 1
        if run.input.get("cas"):
            report.checked["artifact puts by compare-and-set"] += 1
            if any(isinstance(s.result, dict) and s.result.get("conflicts")
                   for s in run.steps.values() if s.name == "cx_put"):
                report.checked["artifact puts after a conflict"] += 1
        if mine != [run.result.get("version")]:
            report.add("artifact", run.id, f"{name} holds its put as versions {mine}; its "
                       f"step returned version {run.result.get('version')}")
    for (name, rid), versions in sorted(put_by.items()):
        report.add("artifact", rid, f"{name} versions {versions} name a run that is no "
                   f"cx_artifact run in the store")


def _check_locks(history: History, report: Report) -> None:
    """cx_lock. A pass through the critical section is valid when its write was accepted:
    the script that wrote (on leaving) found the lock's holder in the store to be this
    execution (run and epoch), and so did the script that read (on entering). An execution
    whose hold lapsed (stopped, killed, redelivered) may go on running its body -- nothing
    can stop it -- but its write is refused: it is no violation, as a fenced effect is not.
    So: no two valid passes of different runs overlap (server ms, enter to exit); no write
    was accepted from a pass that entered without holding; the counter (read on entering,
    written plus one on leaving) equals the writes accepted, so no update was lost; each
    succeeded run wrote exactly once."""
    enters = {r.x: r for r in history.lock_receipts if r.op == "enter"}
    exits = [r for r in history.lock_receipts if r.op == "exit"]
    holds: list[tuple[int, int, str, int]] = []
    written: Counter[str] = Counter()
    for out in exits:
        report.checked[f"lock passes {out.outcome}"] += 1
        if out.outcome != "written":
            continue
        written[out.run] += 1
        entry = enters.get(out.x)
        if entry is None:
            report.add("lock", out.run, f"a write accepted (epoch {out.epoch}) without its "
                       f"entry receipt")
        elif not entry.valid:
            report.add("lock", out.run, f"a write accepted from epoch {out.epoch}, which "
                       f"entered while {entry.holder or 'nobody'}@{entry.holder_epoch} held "
                       f"the lock")
        else:
            holds.append((entry.ms, out.ms, out.run, out.epoch))
    report.checked["lock entries not holding"] += sum(
        1 for r in enters.values() if not r.valid and not r.done)
    holds.sort()
    latest: tuple[int, int, str, int] | None = None
    for hold in holds:
        if latest is not None and hold[0] < latest[1] and hold[2] != latest[2]:
            report.add("lock", hold[2], f"held from {hold[0]} to {hold[1]} ms (epoch "
                       f"{hold[3]}) while {latest[2]} (epoch {latest[3]}) held it from "
                       f"{latest[0]} to {latest[1]}")
        if latest is None or hold[1] > latest[1]:
            latest = hold
    total = sum(written.values())
    if history.lock_counter != total or sorted(written) != sorted(history.lock_done):
        report.add("lock", "cx_lock", f"the counter is {history.lock_counter} after {total} "
                   f"accepted writes by {len(written)} runs ({len(history.lock_done)} marked "
                   f"done)")
    for run in history.runs.values():
        if run.name != "cx_lock":
            continue
        if written[run.id] > 1:
            report.add("lock", run.id, f"{written[run.id]} writes accepted")
        if run.status == "succeeded":
            report.checked["lock runs"] += 1
            if written[run.id] != 1:
                report.add("lock", run.id, "succeeded without a valid hold of the lock "
                           "(no accepted write)")


def most_in_window(starts: list[int], window_ms: int) -> tuple[int, int]:
    """The most starts in any half-open window [t, t + window_ms), and the first such t."""
    starts = sorted(starts)
    most, first, lo = 0, 0, 0
    for hi, t in enumerate(starts):
        while starts[lo] <= t - window_ms:
            lo += 1
        if hi - lo + 1 > most:
            most, first = hi - lo + 1, starts[lo]
    return most, first


def _check_published(run: Run, report: Report) -> None:
    publishes = {k for k, s in run.steps.items() if s.name == "|publish"}
    report.checked["published values"] += len(publishes)
    journal = Counter(str(e.data.get("step")) for e in run.events if e.type == "published")
    for key in sorted(publishes | set(journal)):
        if journal[key] != 1 or key not in publishes:
            report.add("published_twice", run.id, f"publish {key}: {journal[key]} published "
                       f"entries in the journal, {'one' if key in publishes else 'none'} in "
                       f"the ledger")
    if run.status == "succeeded" and isinstance(run.result, dict) \
            and run.published.get(STATE_KEY) != run.result.get("state"):
        report.add("published_stale", run.id, f"published {run.published.get(STATE_KEY)!r}, "
                   f"returned {run.result.get('state')!r}")


def _check_cancelled_children(history: History, executions: dict[str, list[Execution]],
                              report: Report) -> None:
    """A child of a cancelled parent never starts an execution after the parent's cancel
    settled (its start reads the parent), and once its own cancel was asked it begins at most
    the one step it was already past its boundary for. A child that was executing when the
    parent settled may begin a step in the moment before the parent's walk reaches it (the
    walk follows the settle, and the child may live in another slot): that is no violation."""
    for parent in history.runs.values():
        if parent.status != "cancelled":
            continue
        final = next((e for e in parent.events if e.type == "final"), None)
        if final is None:
            continue
        for child in history.runs.values():
            if child.parent != parent.id:
                continue
            report.checked["children of cancelled parents"] += 1
            started = {int(e.data.get("epoch", 0)): e.ms for e in child.events
                       if e.type == "attempt_started"}
            asked = min((e.ms for e in child.events if e.type == "cancel_requested"),
                        default=None)
            mine = executions[child.id]
            late = [ex for ex in mine if started.get(ex.epoch, 0) > final.ms]
            if late:
                first = min(late, key=lambda ex: ex.t)
                report.add("child_after_cancel", child.id, f"step {first.step} ran in an "
                           f"execution (epoch {first.epoch}) that started at "
                           f"{started[first.epoch]}, {started[first.epoch] - final.ms} ms after "
                           f"its parent {parent.id}'s cancel settled at {final.ms}; "
                           f"{len(late)} such step executions; the child ended {child.status}")
                continue
            after = [ex for ex in mine if asked is not None and ex.t > asked]
            if len(after) > 1:
                report.add("child_after_cancel", child.id, f"{len(after)} step executions "
                           f"began after its own cancel was asked at {asked} (at most the one "
                           f"in flight may); the child ended {child.status}")


def _check_limits(history: History, report: Report) -> None:
    for label, (samples, most, limit) in sorted(history.limit_counts.items()):
        report.checked[f"limit samples {label}"] += samples
        if most > limit and not any(s.label == label for s in history.limit_over):
            report.add("limit_exceeded", label, f"{most} live holds seen, the limit is {limit}")
    for sample in history.limit_over:
        if sample.held > sample.limit:
            report.add("limit_exceeded", sample.label, f"{sample.held} live holds at "
                       f"{sample.at_ms} (limit {sample.limit}): {list(sample.holders)}")


def _commit_order(run: Run) -> list[str]:
    """A run's steps in the order the server committed them (its journal's stream order)."""
    out: list[str] = []
    for ev in run.events:
        step = str(ev.data.get("step", ""))
        if ev.type == "step_succeeded" and step and not _leaf(step).startswith("|") \
                and step not in out:
            out.append(step)
    return out


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _copied(run: Run) -> set[str]:
    """A rerun's ledger entries copied from its source (their results name the source)."""
    if not run.rerun_of:
        return set()
    prefix = run.rerun_of + ":"
    return {k for k, s in run.steps.items()
            if isinstance(s.result, str) and s.result.startswith(prefix)}


def _check_reruns(history: History, executions: dict[str, list[Execution]],
                  report: Report) -> None:
    for asked in history.reruns:
        if asked.outcome.startswith("error"):
            continue
        run, source = history.runs.get(asked.run), history.runs.get(asked.source)
        if run is None or source is None:
            continue  # lost: the membership check's
        order = _commit_order(source) or list(asked.order)
        if asked.from_step not in order:
            continue
        report.checked["reruns"] += 1
        cut = order.index(asked.from_step)
        ran = {ex.step for ex in executions[run.id]}
        before = [s for s in order[:cut] if s in ran]
        if before:
            report.add("rerun_reran", run.id, f"rerun of {source.id} from {asked.from_step} "
                       f"executed {before}, committed before it (commit order {order}; the "
                       f"engine copied {list(asked.copied)})")
        if run.status == "succeeded":
            skipped = [s for s in order[cut:] if s not in ran]
            if skipped:
                report.add("rerun_skipped", run.id, f"rerun of {source.id} from "
                           f"{asked.from_step} never executed {skipped} (commit order "
                           f"{order}; the engine copied {list(asked.copied)})")


def _check_band(run: Run, executions: list[Execution], report: Report) -> None:
    band = run.queue if run.priority == 0 else f"{run.queue}~{run.priority}"
    for ex in executions:
        if not ex.origin:
            continue
        report.checked["priority bands" if run.priority else "queues"] += 1
        if ex.origin.rsplit(".", 1)[-1] != band:
            report.add("band", run.id, f"step {ex.step} (epoch {ex.epoch}) came from RQ queue "
                       f"{ex.origin}; the run's band is {band} (priority {run.priority})")
            return


def _check_start(run: Run, report: Report) -> None:
    if not run.start_at_ms:
        return
    report.checked["runs started later"] += 1
    early = [ms for ms in _epochs(run).values() if ms < run.start_at_ms]
    if early:
        report.add("start_early", run.id, f"an execution started {run.start_at_ms - min(early)} "
                   f"ms before the run's start_at")


# -- processes -----------------------------------------------------------------------------------

def _check_crashes(history: History, report: Report) -> None:
    for crash in history.crashes:
        if not crash.excused:
            report.add("crash", crash.name, f"exited with {crash.code} without being killed"
                       + (f"; log tail:\n{crash.tail}" if crash.tail else ""))


# -- kill -> redelivery latency ------------------------------------------------------------------

def _pid_of(worker: Any) -> int | None:
    tail = str(worker).rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _latencies(history: History, report: Report) -> None:
    """For each fault that hit a worker: every execution it interrupted (run by one of its
    processes, started before and still going at the fault) -> the time until the run's next
    execution started."""
    spans: dict[int | None, list[tuple[int, float, Run, int]]] = defaultdict(list)
    for run in history.runs.values():
        events = run.events
        for i, ev in enumerate(events):
            if ev.type != "attempt_started":
                continue
            end = math.inf
            for later in events[i + 1:]:
                if later.type in ("attempt_started", "parked", "final", "redelivered",
                                  "deferred"):
                    end = later.ms
                    break
            spans[_pid_of(ev.data.get("worker"))].append((ev.ms, end, run, i))
    for fault in history.faults:
        if not fault.pids:
            continue
        group = "horse" if fault.kind == "horse" else (
            "stop" if fault.kind.startswith("stop") else "worker")
        for start, end, run, i in (s for pid in set(fault.pids) for s in spans.get(pid, [])):
            if not start <= fault.at_ms < end:
                continue
            later = [e for e in run.events[i + 1:] if e.ms >= fault.at_ms]
            requeued = next((e for e in later if e.type == "redelivered"), None)
            if requeued is not None:
                report.requeue_ms.append(requeued.ms - fault.at_ms)
            nxt = next((e for e in run.events[i + 1:] if e.type == "attempt_started"), None)
            if nxt is None:
                report.unredelivered += 1
                continue
            took = max(0, nxt.ms - fault.at_ms)
            report.latencies_ms[group].append(took)
            if took > report.slowest[0]:
                report.slowest = (took, run.id, f"{fault.kind} {fault.target}")


# -- the summary ---------------------------------------------------------------------------------

def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    if not ordered:
        return 0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def latency_line(values: list[int]) -> str:
    if not values:
        return "n=0"
    return (f"n={len(values)} p50 {percentile(values, 0.5) / 1000:.2f} s, p99 "
            f"{percentile(values, 0.99) / 1000:.2f} s, max {max(values) / 1000:.2f} s")


def summary(history: History, report: Report, *, header: Iterable[str] = ()) -> str:
    lines = list(header)
    kills = Counter(f.kind for f in history.faults)
    lines.append("faults: " + ", ".join(f"{k} {n}" for k, n in sorted(kills.items()))
                 + f" (total {sum(kills.values())})")
    lines.append(f"runs: {len(history.runs)} in the store; by status: "
                 + ", ".join(f"{k} {n}" for k, n in sorted(report.by_status.items())))
    lines.append("runs by workflow: " + ", ".join(f"{k} {n}" for k, n in
                                                  sorted(report.by_workflow.items())))
    lines.append(f"redeliveries: {sum(report.redeliveries.values())} ("
                 + ", ".join(f"{k}: {n}" for k, n in sorted(report.redeliveries.items()))
                 + "); wakes: " + ", ".join(f"{k} {n}" for k, n in sorted(report.wakes.items())))
    every = [ms for values in report.latencies_ms.values() for ms in values]
    lines.append(f"kill -> run queued again (redelivered event): "
                 f"{latency_line(report.requeue_ms)}")
    lines.append(f"kill -> redelivered attempt started: {latency_line(every)}")
    for group in sorted(report.latencies_ms):
        lines.append(f"  {group}: {latency_line(report.latencies_ms[group])}")
    if report.slowest[1]:
        took, run_id, fault = report.slowest
        lines.append(f"  slowest: run {run_id} after {fault}: {took / 1000:.2f} s")
    if report.unredelivered:
        lines.append(f"  interrupted executions whose run went on without a new attempt: "
                     f"{report.unredelivered}")
    lines.append("checked: " + ", ".join(f"{k} {n}" for k, n in sorted(report.checked.items())))
    lines.append(f"receipts: {len(history.executions)} step executions, {len(history.claims)} "
                 f"effect claims, {len(history.applied)} effects applied; answers tried "
                 f"{len(history.answers)}, events sent {len(history.sent)}, enqueues "
                 f"{len(history.submitted)}")
    by_kind = Counter(v.kind for v in report.violations)
    lines.append(f"violations: {len(report.violations)}"
                 + (" (" + ", ".join(f"{k} {n}" for k, n in sorted(by_kind.items())) + ")"
                    if by_kind else ""))
    for v in report.violations[:50]:
        lines.append(f"  {v}")
    if len(report.violations) > 50:
        lines.append(f"  ... and {len(report.violations) - 50} more")
    return "\n".join(lines)
