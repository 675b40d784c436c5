"""The replay checker: would these runs, replayed by new code, go on as they were recorded?

Each history (engine/history.py) is replayed against the new source's workflow in process
memory by the real executor (engine/execute.py `execute`) on the dry run's in-memory store
(engine/memory_store.py), with `Execution.replay_only` set: a recorded call returns what the ledger
holds, the code between recorded calls runs, and the execution stops at the first step the
ledger does not hold, so no step body ever runs. Nothing is written to Redis.

A run is `ok` when its replay reached the end of its recorded history (the first step it
does not hold), parked where it waits (a question, a timer, a signal, a child), or finished
the same way. It fails on:

* non-determinism: the new code calls something else at a recorded position (the engine's
  NonDeterminismError; the run would fail with ErrorInfo type NonDeterminism);
* a body error: the code between steps raises where the recorded run did not fail;
* a question the run asked that the new code no longer asks (an ask's key renamed, or the
  ask removed) while it parks at a question the run never asked, or finishes;
* finishing without reaching calls the run recorded (a step removed at the end);
* a patch removed while the run took its old branch: the ledger holds the patch's decision
  False, and the new code no longer reaches that `mr.patched` call;
* a workflow the new source does not declare.

A run whose recorded workflow version the new source does not serve is said so, and still
replayed against the current definition.
"""

from __future__ import annotations

import ast
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec

from ..errors import MarblesError
from ..store.records import ErrorInfo, StepRecord, ledger_order
from .authoring import Registry
from .context import Limits
from .execute import REPLAY_REACHED_NEW_WORK, execute
from .history import ChildOutcome, History, wf_version_of
from .memory_store import MemoryRuns, _Ask, _Run
from .patches import PATCH_PREFIX, decision_of, patch_of
from .runs import RunStore

REPLAY_WORKER = "replay-check"
REPLAY_LEASE_MS = 3_600_000  # no lease to keep: the watchdog renews in memory, rarely
IN_FLIGHT = ("waiting", "running", "queued")  # what `replay --check --workflow` selects
_NON_DETERMINISM = re.compile(r"in (?P<frame>.*) at position (?P<position>\d+): the ledger "
                              r"recorded (?P<recorded>.*) there, the body now calls "
                              r"(?P<called>.*) \(a workflow must")
_DEPRECATED = re.compile(r"^patch (?P<patch>'[^']*'|\"[^\"]*\") in (?P<frame>.+?) is "
                         r"deprecated")


class ReadLedger(dict[str, StepRecord]):
    """A ledger that remembers which keys the body looked up (every recorded call reads its
    position with `get`), in order: what the replay reached, and where it stopped."""

    def __init__(self, entries: dict[str, StepRecord]) -> None:
        super().__init__(entries)
        self.read: list[str] = []
        self._lock = threading.Lock()  # parallel branches read at once

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            self.read.append(key)
        return super().get(key, default)


class ReplayRuns(MemoryRuns):
    """The dry run's in-memory store, loaded with one history at a time: its questions and
    answers, claimed effects and children's outcomes; every execution replay-only."""

    def __init__(self) -> None:
        super().__init__()
        self.children: dict[str, ChildOutcome] = {}
        self.ledgers: dict[str, ReadLedger] = {}
        self.asks_seen: dict[str, set[str]] = {}
        self.patches_seen: dict[str, set[str]] = {}

    def load(self, history: History, record_version: str | None = None) -> str:
        """Make `history`'s run the one in memory, queued for its replay; its id. With
        `record_version`, the record names that version (so the executor picks the
        definition chosen for it)."""
        self.runs.clear()
        self.ledgers.clear()
        record = history.run
        if record_version is not None and hasattr(record, "wf_version"):
            record = msgspec.structs.replace(record, wf_version=record_version)
        run = _Run(record, self.now_ms())
        run.ledger = {entry.key: entry for entry in history.ledger}
        run.effects = set(history.effects)
        # A run that asked has parked: its next delivery is a resumption, which is what lets
        # mr.patched see the questions it asked past the patch's place (engine/patches.py).
        run.resumptions = 1 if history.questions else 0
        for q in history.questions:
            run.asks[q.record.key] = _Ask(record=q.record, asked_ms=q.asked_ms, state=q.state,
                                          answer=msgspec.json.decode(q.answer),
                                          answered_ms=q.answered_ms or None)
        self.runs[record.id] = run
        self.children = {c.id: c for c in history.children}
        return record.id

    def start(self, run_id: str, attempt: int, *, ttl_ms: int, worker: str) -> Any:
        started = super().start(run_id, attempt, ttl_ms=ttl_ms, worker=worker)
        ex = started.execution
        if ex is not None:
            ledger = ReadLedger(ex.ledger)
            ex.ledger = ledger
            ex.replay_only = True
            ex.asks_seen = set()
            self.ledgers[run_id] = ledger
            self.asks_seen[run_id] = ex.asks_seen
            self.patches_seen[run_id] = ex.patches_seen
        return started

    def child_states(self, ids: list[str]) -> list[tuple[str, bytes | None, bytes | None]]:
        out: list[tuple[str, bytes | None, bytes | None]] = []
        for cid in ids:
            child = self.children.get(cid)
            if child is None:  # started by this replay: not settled
                out.append(("queued", None, None))
                continue
            if child.status == "missing":
                raise MarblesError(f"child run {cid} does not exist (pruned, or never "
                                   f"recorded)")
            error = None if child.error is None else msgspec.json.encode(child.error)
            out.append((child.status, bytes(child.result) if child.status == "succeeded"
                        else None, error))
        return out

    def defer(self, ex: Any, note: str, *, delay_ms: int = 0) -> str:
        raise MarblesError(f"the new source cannot execute it: {note}")


@dataclass
class Problem:
    kind: str  # nondeterminism | body_error | ask_changed | unreached | patch_removed |
    #           unknown_workflow | replay_error
    message: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Verdict:
    """What the replay of one history came to."""

    run_id: str
    workflow: str
    wf_version: str
    status: str  # the recorded run's status
    ended: str  # how the replay ended: reached_new_work | parked | succeeded | failed | ...
    summary: str  # one line: where the replay ended, or the first problem
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    old_branch: list[str] = field(default_factory=list)  # patch ids decided False here
    patches: list[str] = field(default_factory=list)  # every patch id the history decided

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        first = self.problems[0] if self.problems else None
        return {"run": self.run_id, "workflow": self.workflow, "wf_version": self.wf_version,
                "status": self.status, "ok": self.ok,
                "outcome": "ok" if first is None else first.kind, "ended": self.ended,
                "summary": self.summary,
                "problems": [{"kind": p.kind, "message": p.message, **p.detail}
                             for p in self.problems],
                "notes": self.notes, "old_branch_patches": self.old_branch}


@dataclass
class Checker:
    """Replays histories against `registry` (the new source's definitions)."""

    registry: Registry
    limits: Limits = field(default_factory=Limits)
    store: ReplayRuns = field(default_factory=ReplayRuns)

    def check(self, history: History) -> Verdict:
        recorded_version = history.wf_version or wf_version_of(history.run)
        name = history.run.name
        verdict = Verdict(history.run_id, name, recorded_version, history.status, "not_run",
                          "")
        verdict.patches, verdict.old_branch = _patch_decisions(history.ledger)
        definition = self.registry.workflows.get(name)
        if definition is None:
            problem = Problem("unknown_workflow",
                              f"workflow {name!r} is not declared by the new source")
            verdict.problems.append(problem)
            verdict.summary = problem.message
            return verdict
        record_version = None
        serving = getattr(self.registry, "serving", None)
        if serving is not None and recorded_version and serving(name,
                                                                recorded_version) is None:
            current = str(getattr(definition, "version", "") or "")
            verdict.notes.append(f"version {recorded_version} is not served by the new source; "
                                 f"replayed against its current definition"
                                 + (f" (version {current})" if current else ""))
            record_version = ""  # "" is served by the current definition
        store = self.store
        run_id = store.load(history, record_version)
        try:
            ended = execute(cast(RunStore, store), self.registry, run_id, 1,
                            worker=REPLAY_WORKER, lease_ms=REPLAY_LEASE_MS, hard_exit=False,
                            limits=self.limits, deliver=None)
        except MarblesError as exc:
            problem = Problem("replay_error", f"the replay could not run: {exc}")
            verdict.problems.append(problem)
            verdict.ended, verdict.summary = "error", problem.message
            return verdict
        verdict.ended = ended
        # The decisions the run recorded, and those its replay took: a run that passed a
        # patch's place before the patch was deployed takes the old branch when it replays.
        verdict.patches, verdict.old_branch = _patch_decisions(
            store.runs[run_id].ledger.values())
        self._judge(history, verdict)
        return verdict

    def _judge(self, history: History, verdict: Verdict) -> None:
        store = self.store
        run = store.runs[history.run_id]
        ledger = store.ledgers.get(history.run_id)
        read = ledger.read if ledger is not None else []
        reached = set(read)
        # What a recorded step's body did (its own steps, questions, patches) replays with
        # the step's result: a replay never goes inside a step that finished.
        finished_steps = _finished_steps(history.ledger)
        ledger_entries = [e for e in history.ledger
                          if not _inside(_frame_of(e), finished_steps)]
        calls = sorted((e for e in ledger_entries if not e.name.startswith(PATCH_PREFIX)),
                       key=ledger_order)
        unreached = [e for e in calls if e.key not in reached]
        asked = store.asks_seen.get(history.run_id, set())
        lost_asks = [q for q in history.questions if q.record.key not in asked
                     and not _inside(q.record.step, finished_steps)]
        problems = verdict.problems
        if run.status == "failed" and run.error is not None:
            problems += _failure(history, run.error)
        if run.status == "succeeded":
            where = "finished"
            if history.status == "succeeded" and run.result is not None and (
                    _same_json(run.result, bytes(history.result))):
                verdict.summary = "finished the same way (same result)"
            elif history.status == "succeeded":
                verdict.summary = "finished"
                verdict.notes.append("finished with another result than it recorded")
            else:
                verdict.summary = f"would finish now (it is {history.status})"
        elif run.status == "failed":
            where = "failed"
            verdict.summary = ("failed the same way" if not problems
                               else problems[0].message)
        elif run.status == "cancelled":
            where = "cancelled"
            verdict.summary = ("cancelled the same way" if history.status == "cancelled"
                               else "stopped at a question that was cancelled")
        elif run.status == "waiting":
            where = "parked"
            verdict.summary = _parked(run.wait_reason, run.wait_for or {}, history)
        elif verdict.ended == REPLAY_REACHED_NEW_WORK:
            where = "new_work"
            at = _new_work_at(read, ledger)
            verdict.summary = ("reached the end of its recorded history"
                               + (f" (next: step {at})" if at else ""))
        else:
            where = "other"
            problems.append(Problem("replay_error",
                                    f"the replay stopped: {verdict.ended} (run {run.status})"))
        finished = where in ("finished", "failed", "cancelled")
        # Questions the run asked and the new code no longer asks.
        new_questions = [k for k in (run.wait_for or {}).get("questions", [])
                         if k not in {q.record.key for q in history.questions}]
        if lost_asks and (finished or new_questions) and not problems:
            lost = lost_asks[0]
            message = (f"question {lost.record.key!r} ({lost.state}) is no longer asked"
                       + (f"; it asks {new_questions[0]!r} instead, which this run never "
                          f"asked" if new_questions else ""))
            problems.append(Problem("ask_changed", message,
                                    {"recorded": lost.record.key,
                                     "asked": new_questions[0] if new_questions else None}))
        if unreached and finished and not problems:
            first = unreached[0]
            problems.append(Problem(
                "unreached", f"it {where} without reaching {len(unreached)} recorded "
                f"call{'s' if len(unreached) != 1 else ''} (first: {_call(first)})",
                {"calls": [e.key for e in unreached]}))
        elif unreached and where in ("parked", "new_work"):
            verdict.notes.append(f"{len(unreached)} recorded call"
                                 f"{'s' if len(unreached) != 1 else ''} not reached before "
                                 f"it stopped (first: {_call(unreached[0])}); they are "
                                 f"checked when the run gets there")
        # A patch whose old branch this run took, and that the new code no longer reaches.
        seen = store.patches_seen.get(history.run_id, set()) | reached
        last_reached = max((ledger_order(e) for e in calls if e.key in reached), default=None)
        covered = not unreached
        for entry in ledger_entries:
            if not entry.name.startswith(PATCH_PREFIX) or entry.key in seen:
                continue
            if _decision(entry) is not False:
                continue
            before_stop = last_reached is not None and ledger_order(entry) < last_reached
            if covered or before_stop or any(p.kind == "nondeterminism" for p in problems):
                pid = patch_of(entry)
                problems.append(Problem(
                    "patch_removed", f"patch {pid!r} removed while this run took its old "
                    f"branch", {"patch": pid, "key": entry.key}))
        if problems:
            # The first problem says it all; the patch, when there is one, is its cause.
            problems.sort(key=lambda p: p.kind != "patch_removed")
            verdict.summary = problems[0].message


def _finished_steps(ledger: Iterable[StepRecord]) -> set[str]:
    return {e.key for e in ledger if not e.name.startswith("|")
            and e.status in ("succeeded", "failed")}


def _frame_of(entry: StepRecord) -> str:
    """The frame path an entry was recorded in (its key without `.<name>#<n>`)."""
    cut = entry.key.rfind(f".{entry.name}#")
    return entry.key[:cut] if cut > 0 else ""


def _inside(frame: str, steps: set[str]) -> bool:
    """Is `frame` the body of one of `steps` (a step's frame path is its ledger key), or
    inside one?"""
    while frame:
        if frame in steps:
            return True
        cut = frame.rfind(".")
        frame = frame[:cut] if cut > 0 else ""
    return False


def _failure(history: History, error: ErrorInfo) -> list[Problem]:
    recorded = history.error
    if history.status == "failed" and recorded is not None and (
            recorded.type, recorded.message) == (error.type, error.message):
        return []  # it failed so when it was recorded
    deprecated = _DEPRECATED.search(error.message) if error.type == "NonDeterminism" else None
    if deprecated is not None:
        pid = _unquote(deprecated["patch"])
        return [Problem("patch_deprecated", f"patch {pid!r} deprecated (its old branch "
                        f"deleted) while this run took its old branch",
                        {"patch": pid, "frame": deprecated["frame"]})]
    if error.type == "NonDeterminism":
        detail: dict[str, Any] = {"frame": error.step}
        found = _NON_DETERMINISM.search(error.message)
        if found is not None:
            detail = {"frame": found["frame"], "position": int(found["position"]),
                      "recorded": _unquote(found["recorded"]),
                      "called": _unquote(found["called"])}
            message = (f"NonDeterminism in {detail['frame']} at position "
                       f"{detail['position']}: recorded {detail['recorded']!r}, now "
                       f"{detail['called']!r}")
        else:
            message = f"NonDeterminism: {error.message}"
        return [Problem("nondeterminism", message, detail)]
    where = f" (at {error.step})" if error.step else ""
    return [Problem("body_error", f"the body raised {error.type}: {_clip(error.message)}"
                    f"{where}", {"type": error.type, "error": _clip(error.message),
                                 "step": error.step})]


def _parked(reason: str | None, wait_for: dict[str, Any], history: History) -> str:
    recorded = {q.record.key for q in history.questions}
    if reason == "question":
        keys = list(wait_for.get("questions", []))
        known = [k for k in keys if k in recorded]
        if known:
            return f"parked at question {known[0]!r}, as recorded"
        return f"parks at a new question {keys[0]!r}" if keys else "parked at a question"
    if reason == "timer":
        return "parked at its timer"
    if reason == "signal":
        return f"parked waiting for signal {', '.join(wait_for.get('signals', []))}"
    if reason == "child":
        return f"parked waiting for child {', '.join(wait_for.get('children', []))}"
    if reason == "event":
        return "parked waiting for an event"
    return f"parked ({reason})"


def _new_work_at(read: list[str], ledger: ReadLedger | None) -> str:
    """The position the replay stopped at: the last one it looked up that holds no finished
    step."""
    for key in reversed(read):
        entry = None if ledger is None else dict.get(ledger, key)
        if entry is None or entry.status not in ("succeeded", "failed"):
            return key
    return ""


def _patch_decisions(ledger: Iterable[StepRecord]) -> tuple[list[str], list[str]]:
    """The patch ids the ledger decided, and those it decided False (the old branch)."""
    decided, old = [], []
    entries = list(ledger)
    finished = _finished_steps(entries)
    for entry in sorted(entries, key=ledger_order):
        pid = patch_of(entry)
        if pid is not None and _inside(_frame_of(entry), finished):
            continue  # taken inside a step that finished: it is never decided again
        if pid is not None:
            decided.append(pid)
            if _decision(entry) is False:
                old.append(pid)
    return list(dict.fromkeys(decided)), list(dict.fromkeys(old))


def _decision(entry: StepRecord) -> bool | None:
    try:
        return decision_of(entry)
    except msgspec.DecodeError:
        return None


def _call(entry: StepRecord) -> str:
    return f"{entry.name} at {entry.key}"


def _unquote(text: str) -> str:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, str) else text


def _clip(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _same_json(a: bytes, b: bytes) -> bool:
    try:
        return bool(msgspec.json.decode(a) == msgspec.json.decode(b))
    except msgspec.DecodeError:
        return a == b


# -- over many runs ----------------------------------------------------------------------

@dataclass
class Report:
    """Every run's verdict, and the patches with runs in flight on their old branch."""

    verdicts: list[Verdict] = field(default_factory=list)
    # patch id -> in-flight runs that took its old branch; a patch decided only True in the
    # runs checked maps to 0 (its old branch has no run among them).
    old_branch: dict[str, int] = field(default_factory=dict)

    def add(self, history: History, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        for pid in verdict.patches:
            self.old_branch.setdefault(pid, 0)
        if history.in_flight:
            for pid in verdict.old_branch:
                self.old_branch[pid] += 1

    @property
    def failing(self) -> int:
        return sum(1 for v in self.verdicts if not v.ok)

    def summary(self) -> str:
        n = len(self.verdicts)
        return (f"{n} run{'s' if n != 1 else ''}: ok {n - self.failing}, "
                f"failing {self.failing}")

    def patch_lines(self) -> list[str]:
        lines = []
        for pid, count in sorted(self.old_branch.items()):
            if count:
                lines.append(f"patch {pid!r}: {count} run{'s' if count != 1 else ''} still "
                             f"on its old branch")
            else:
                lines.append(f"patch {pid!r}: no run in flight on its old branch (its old "
                             f"branch may be removed, as far as these runs tell)")
        return lines

    def summary_json(self) -> dict[str, Any]:
        return {"summary": {"runs": len(self.verdicts),
                            "ok": len(self.verdicts) - self.failing,
                            "failing": self.failing},
                "patches": {pid: {"old_branch_runs": count}
                            for pid, count in sorted(self.old_branch.items())}}


def check_all(histories: Iterable[History], registry: Registry, *,
              on_verdict: Any = None, limits: Limits | None = None) -> Report:
    """Replay every history against `registry`; `on_verdict(verdict)` as each is known."""
    checker = Checker(registry, limits or Limits())
    report = Report()
    for history in histories:
        verdict = checker.check(history)
        report.add(history, verdict)
        if on_verdict is not None:
            on_verdict(verdict)
    return report


__all__ = ["IN_FLIGHT", "Checker", "Problem", "ReplayRuns", "Report", "Verdict", "check_all"]
