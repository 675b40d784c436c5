"""Runs that wait, in the store: parking an execution, waking a run, questions and their
answers, pause and resume, reports, and the feed.

A waiting run holds no worker, process or thread: it is a status in its hash plus, when
something must wake it at a time (a timer, a question's timeout, the next check of a child
it waits for), an entry in its bucket's waits index that the controller reads. A wake makes
a new delivery that replays the ledger. Every transition is one Lua script (park_run,
wake_run, answer_ask, pause_run, resume_run, add_report).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from ..errors import CorruptRecordError, MarblesError
from ..payloads.codec import decode_payload, encode_payload
from ..payloads.fields import open_record, run_holder, seal_record, seal_value
from ..store import new_request_id
from ..store.connection import Client
from ..store.ids import check_id
from ..store.keys import Keyspace
from ..store.records import AskRecord, ReportRecord, StepRecord, decode, encode
from ..store.replies import as_text
from ..store.scripts import Scripts
from .authoring import InputError
from .execution import DISPATCH_GRACE_MS, Execution, RunNotFoundError, event, stamp, step_doc

MAX_KEY = 128


class UnknownQuestionError(InputError):
    code = "unknown_question"


class AnswerRefusedError(InputError):
    """The answer does not fit the question (a value outside its choices, the wrong kind)."""

    code = "answer_refused"


class AlreadyAnsweredError(MarblesError):
    code = "already_answered"


class NotPausedError(MarblesError):
    code = "not_paused"


def check_key(key: str, what: str = "key") -> str:
    """A question or report key: 1..128 printable characters without '|' (the separator of
    the feed's members)."""
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY or "|" in key or not (
            key.isprintable()):
        raise InputError(f"invalid {what} {key!r}: 1 to {MAX_KEY} printable characters, "
                         f"no '|'")
    return key


@dataclass(frozen=True)
class Question:
    """A question as the feed, `status` and the answer commands see it."""

    run_id: str
    record: AskRecord
    state: str  # open | answered | timed_out | cancelled
    rev: str
    asked_ms: int
    answer: Any = None
    answered_ms: int | None = None
    timeout_at_ms: int | None = None

    @property
    def key(self) -> str:
        return self.record.key

    def to_json(self, now_ms: int | None = None) -> dict[str, Any]:
        now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
        return {"run": self.run_id, "key": self.key, "kind": self.record.ask,
                "title": self.record.title, "body": self.record.body,
                "choices": self.record.choices, "step": self.record.step, "state": self.state,
                "asked_ms": self.asked_ms, "age_s": round(max(0, now_ms - self.asked_ms) / 1000,
                                                          1),
                "answer": self.answer, "answered_ms": self.answered_ms,
                "timeout_at_ms": self.timeout_at_ms}


@dataclass(frozen=True)
class Report:
    run_id: str
    record: ReportRecord

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run_id, "key": self.record.key, "kind": self.record.report,
                "entry": msgspec.json.decode(self.record.entry), "step": self.record.step,
                "at_ms": self.record.at_ms}


@dataclass(frozen=True)
class Answered:
    question: Question
    woken_attempt: int  # 0: not woken now (it executes or is paused; it sees it on replay)
    queue: str


class Runs(Protocol):
    """What a WaitStore uses of the runs it serves (engine/runs.RunStore hands one out)."""

    keys: Keyspace
    scripts: Scripts
    client: Client
    store: Any  # the store its payloads are sealed for (payloads/fields.py)

    def write_starts_locked(self, ex: Execution) -> None: ...

    def flush_starts(self, ex: Execution) -> None: ...

    def get(self, run_id: str) -> object | None: ...

    def cancel(self, run_id: str, reason: str = ...) -> str: ...


class WaitStore:
    def __init__(self, runs: Runs) -> None:
        self.runs = runs
        self.keys = runs.keys
        self.scripts = runs.scripts
        self.client = runs.client
        self.store = runs.store

    # -- from inside an execution ------------------------------------------------------

    def park(self, ex: Execution, *, reason: str, wake_at_ms: int, wait_for: dict[str, Any],
             ledger: list[StepRecord], asks: list[AskRecord], notice: bytes = b""
             ) -> tuple[str, int, str]:
        """Park the execution's run: (status, attempt, queue). status: ok (waiting) |
        requeued (woken while it executed: the caller enqueues <attempt>) | cancelled |
        stale | settled. `notice`: a pause notification to queue with it (reason
        failed_step)."""
        with ex.lock:
            self.runs.write_starts_locked(ex)  # the parked steps' starts come before the park
            reply = self.scripts.park_run(
                keys=ex.keys, epoch=ex.epoch, run_id=ex.run_id, reason=reason,
                wake_at_ms=wake_at_ms, wait_for=msgspec.json.encode(wait_for),
                grace_ms=DISPATCH_GRACE_MS,
                event=msgspec.json.encode({"reason": reason, **wait_for}),
                # After every write of the execution (park_run ends its epoch).
                ledger=[(r.key, step_doc(self.store, ex, stamp(r, ex, i + 1)))
                        for i, r in enumerate(ledger)],
                asks=[(a.key, encode(seal_record(self.store, a, run_holder(ex.run_id))),
                       int(a.timeout_s * 1000)) for a in asks], notice=notice)
        if reply.status == "requeued":
            return "requeued", int(reply.values[0]), as_text(reply.values[1])
        return reply.status, 0, ""

    def add_report(self, ex: Execution, record: ReportRecord) -> str:
        """ok | exists | stale | settled"""
        self.runs.flush_starts(ex)
        sealed = seal_record(self.store, record, run_holder(ex.run_id))
        return self.scripts.add_report(
            keys=ex.keys, epoch=ex.epoch, run_id=ex.run_id, key=record.key, doc=encode(sealed),
            event=msgspec.json.encode({"kind": record.report, "key": record.key,
                                       "entry": sealed.entry})).status

    # -- from outside: the controller, a finished child, the CLI -----------------------

    def wake(self, run_id: str, cause: str, *, ctl_epoch: int | None = None,
             detail: dict[str, Any] | None = None) -> tuple[str, int, str]:
        """(status, attempt, queue); status woken means: enqueue <attempt> on <queue>."""
        reply = self.scripts.wake_run(
            keys=self.keys.run_keys(run_id), run_id=run_id, ctl_epoch=ctl_epoch, cause=cause,
            grace_ms=DISPATCH_GRACE_MS, event=msgspec.json.encode({"cause": cause,
                                                                  **(detail or {})}))
        if reply.status == "woken":
            return "woken", int(reply.values[0]), as_text(reply.values[1])
        return reply.status, 0, ""

    def questions(self, run_id: str) -> list[Question]:
        """The run's questions, in the order they were asked."""
        fields: dict[bytes, bytes] = self.client.hgetall(  # type: ignore[assignment]
            self.keys.asks(check_id(run_id, "run id")))
        return sorted(self._questions(run_id, fields), key=lambda q: (q.asked_ms, q.key))

    def _questions(self, run_id: str, fields: dict[bytes, bytes]) -> list[Question]:
        out = []
        f = {as_text(k): v for k, v in fields.items()}
        for name, doc in f.items():
            if "|" in name:
                continue
            record = open_record(self.store, decode(AskRecord, doc,
                                                    f"{self.keys.asks(run_id)}#{name}"))

            def num(field: str, name: str = name) -> int | None:
                value = f.get(f"{name}|{field}")
                return int(value) if value not in (None, b"") else None

            answer = f.get(f"{name}|answer")
            try:
                out.append(Question(
                    run_id, record, as_text(f.get(f"{name}|state", b"open")),
                    as_text(f.get(f"{name}|rev", b"1")), num("asked_ms") or 0,
                    None if answer is None else msgspec.json.decode(
                        decode_payload(self.store, answer)),
                    num("answered_ms"), num("timeout_at")))
            except (ValueError, msgspec.DecodeError) as exc:
                raise CorruptRecordError(self.keys.asks(run_id), f"question {name!r}: {exc}"
                                         ) from None
        return out

    def question(self, run_id: str, key: str) -> Question:
        if self.runs.get(run_id) is None:
            raise RunNotFoundError(f"no run with id {run_id!r}")
        for q in self.questions(run_id):
            if q.key == key:
                return q
        known = ", ".join(q.key for q in self.questions(run_id)) or "it has asked none"
        raise UnknownQuestionError(f"run {run_id} has no question {key!r} ({known})")

    def answer(self, run_id: str, key: str, value: Any, *, kind: str) -> Answered:
        """Record the answer to an open question (`kind`: question, or approval with value
        {approved, note}) and wake the run. The first answer wins."""
        check_id(run_id, "run id")
        question = self.question(run_id, key)
        value = answer_of_kind(question, run_id, key, value, kind)
        try:
            msgspec.json.encode(value)
        except (UnicodeEncodeError, msgspec.EncodeError):
            raise AnswerRefusedError("the answer is not valid text (UTF-8)") from None
        if question.state != "open":
            raise AlreadyAnsweredError(f"{key!r} of run {run_id} is already {_closed(question)}")
        reply = self.scripts.answer_ask(
            keys=self.keys.run_keys(run_id), run_id=run_id, key=key, rev=question.rev,
            answer=encode_payload(self.store, msgspec.json.encode(value),
                                  holder=run_holder(run_id)),
            event=msgspec.json.encode({"key": key, "answer": seal_value(
                self.store, value, run_holder(run_id))}),
            grace_ms=DISPATCH_GRACE_MS, request_id=new_request_id())
        if reply.status == "ok":
            return Answered(question, int(reply.values[0]), as_text(reply.values[1]))
        if reply.status == "closed":  # e.g. timed_out: past its timeout, though still open
            raise AlreadyAnsweredError(f"{key!r} of run {run_id} is already "
                                       f"{_closed_state(as_text(reply.values[0]))}")
        if reply.status == "conflict":
            raise AlreadyAnsweredError(f"{key!r} of run {run_id} is already answered")
        if reply.status == "settled":
            raise AlreadyAnsweredError(f"run {run_id} has already finished "
                                       f"({as_text(reply.values[0])}); nothing recorded")
        if reply.status == "missing":
            raise RunNotFoundError(f"no run with id {run_id!r}")
        raise UnknownQuestionError(f"run {run_id} has no question {key!r}")

    @staticmethod
    def _choice(question: Question, value: Any) -> str:
        choices = question.record.choices
        if not isinstance(value, str):
            raise AnswerRefusedError("an answer is text")
        found = match_choice(choices, value)
        if found is not None:
            return found
        listed = ", ".join(f"{i}={c!r}" for i, c in enumerate(choices or [], 1))
        raise AnswerRefusedError(f"{value!r} is not one of the choices of {question.key!r} "
                                 f"({listed})")

    def pause(self, run_id: str) -> str:
        """paused | requested | already | settled"""
        keys = self.keys.run_keys(check_id(run_id, "run id"))
        status = self.scripts.pause_run(keys=keys, event=event(reason="paused by request")
                                        ).status
        if status == "missing":
            raise RunNotFoundError(f"no run with id {run_id!r}")
        return status

    def resume(self, run_id: str) -> tuple[str, int, str]:
        """(woken | resumed | settled, attempt, queue)"""
        keys = self.keys.run_keys(check_id(run_id, "run id"))
        reply = self.scripts.resume_run(keys=keys, run_id=run_id,
                                        event=event(reason="resumed by request"),
                                        grace_ms=DISPATCH_GRACE_MS)
        if reply.status == "missing":
            raise RunNotFoundError(f"no run with id {run_id!r}")
        if reply.status == "not_paused":
            raise NotPausedError(f"run {run_id} is not paused; nothing to resume")
        if reply.status == "woken":
            return "woken", int(reply.values[0]), as_text(reply.values[1])
        return reply.status, 0, ""

    def resolve_step(self, run_id: str, key: str, expected: StepRecord, entry: StepRecord,
                     action: str, event: dict[str, Any]) -> tuple[str, int, str]:
        """Write a paused step's entry back (`action`: retry | fail) and wake the run, if
        its entry is still `expected` (engine/failed_steps.py): (woken | conflict |
        not_waiting | settled | missing, attempt, queue)."""
        keys = self.keys.run_keys(check_id(run_id, "run id"))
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(keys.steps, key)
        pipe.hget(keys.run, "epoch")
        raw, epoch = pipe.execute()
        if not isinstance(raw, bytes) or open_record(
                self.store, decode(StepRecord, raw, keys.steps)) != expected:
            return "conflict", 0, ""
        epoch_n = int(epoch or 0)
        reply = self.scripts.resolve_step(
            keys=keys, run_id=run_id, action=action, key=key, expected=raw,
            entry=encode(seal_record(self.store, msgspec.structs.replace(
                entry, epoch=epoch_n, wseq=0), run_holder(run_id))), epoch=epoch_n,
            # A retry's input patch and the arguments it made are user values.
            event=msgspec.json.encode({k: seal_value(self.store, v, run_holder(run_id))
                                       if k in ("patch", "args") else v
                                       for k, v in event.items()}),
            grace_ms=DISPATCH_GRACE_MS)
        if reply.status == "woken":
            return "woken", int(reply.values[0]), as_text(reply.values[1])
        return reply.status, 0, ""

    def failed_steps(self, limit: int = 100) -> list[str]:
        """The runs paused on a step whose tries ran out (their feed entries), oldest first."""
        rows = self._members(self.keys.feed, newest=False, limit=10 * limit)
        return [run_id for _, run_id, key in rows if key == "!failed_step"][:limit]

    def cancel_children(self, run_id: str) -> list[str]:
        """Cancel the descendants of a cancelled run, at any depth; returns their ids. A
        child outlives its parent only by being finished already."""
        cancelled: list[str] = []
        todo, seen = [run_id], {run_id}
        while todo:
            parent = todo.pop()
            values: list[bytes] = self.client.hvals(  # type: ignore[assignment]
                self.keys.steps(parent))
            for raw in values:
                try:
                    record = open_record(self.store,
                                         decode(StepRecord, raw, self.keys.steps(parent)))
                    if record.name != "|child":
                        continue
                    child = str(msgspec.json.decode(record.result)["id"])
                except (CorruptRecordError, MarblesError, KeyError, TypeError,
                        msgspec.DecodeError):
                    continue
                if child in seen:
                    continue
                seen.add(child)
                outcome = self.runs.cancel(child, f"its parent {parent} was cancelled")
                if outcome in ("cancelled", "requested"):
                    cancelled.append(child)
                todo.append(child)  # a finished child may still have live children
        return cancelled

    # -- reading across runs -----------------------------------------------------------

    def _members(self, key_of: Any, *, newest: bool, limit: int) -> list[tuple[float, str, str]]:
        pipe = self.client.pipeline(transaction=False)
        for bucket in range(self.keys.buckets):
            if newest:
                pipe.zrevrange(key_of(bucket), 0, limit - 1, withscores=True)
            else:
                pipe.zrange(key_of(bucket), 0, limit - 1, withscores=True)
        rows = []
        for part in pipe.execute(raise_on_error=False):
            if isinstance(part, Exception):
                continue
            for member, score in part:
                run_id, _, key = as_text(member).partition("|")
                rows.append((score, run_id, key))
        rows.sort(reverse=newest)
        return rows[:limit]

    def feed(self, limit: int = 100) -> list[Question]:
        """Open questions across runs, oldest first."""
        rows = self._members(self.keys.feed, newest=False, limit=limit)
        by_run: dict[str, list[str]] = {}
        for _, run_id, key in rows:
            by_run.setdefault(run_id, []).append(key)
        pipe = self.client.pipeline(transaction=False)
        for run_id in by_run:
            pipe.hgetall(self.keys.asks(run_id))
        out = []
        for run_id, fields in zip(by_run, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(fields, Exception):
                continue
            try:
                questions = self._questions(run_id, fields)
            except (CorruptRecordError, MarblesError):
                continue
            out += [q for q in questions if q.state == "open" and q.key in by_run[run_id]]
        return sorted(out, key=lambda q: (q.asked_ms, q.run_id, q.key))

    def reports(self, limit: int = 20) -> list[Report]:
        """Reports across runs, newest first."""
        rows = self._members(self.keys.report_index, newest=True, limit=limit)
        pipe = self.client.pipeline(transaction=False)
        for _, run_id, key in rows:
            pipe.hget(self.keys.reports(run_id), key)
        out = []
        for (_, run_id, key), doc in zip(rows, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(doc, bytes):
                try:
                    out.append(Report(run_id, open_record(self.store, decode(
                        ReportRecord, doc, f"{self.keys.reports(run_id)}#{key}"))))
                except MarblesError:
                    continue
        return out

    def run_reports(self, run_id: str) -> list[Report]:
        fields: dict[bytes, bytes] = self.client.hgetall(  # type: ignore[assignment]
            self.keys.reports(run_id))
        out = []
        for key, doc in fields.items():
            try:
                out.append(Report(run_id, open_record(self.store, decode(
                    ReportRecord, doc, f"{self.keys.reports(run_id)}#{as_text(key)}"))))
            except MarblesError:
                continue
        return sorted(out, key=lambda r: (r.record.at_ms, r.record.key))


def _closed(question: Question) -> str:
    return _closed_state(question.state)


def _closed_state(state: str) -> str:
    return {"answered": "answered", "timed_out": "closed (it timed out)",
            "cancelled": "closed (its run was cancelled)"}.get(state, state)


def match_choice(choices: list[str] | None, value: str) -> str | None:
    """The answer `value` names: any text without choices; else a choice by its text or its
    number (1-based); None if it names none."""
    if not choices or value in choices:
        return value
    if value.isdigit() and 1 <= int(value) <= len(choices):
        return choices[int(value) - 1]
    return None


def answer_of_kind(question: Question, run_id: str, key: str, value: Any, kind: str) -> Any:
    """The answer to record for `question` (a choice's text for a question's choice number),
    or AnswerRefusedError when it is another kind of ask than the call answers."""
    if question.record.ask != kind:
        verb = "answer" if question.record.ask == "question" else "approve or reject"
        what = "an approval" if question.record.ask == "approval" else "a question"
        raise AnswerRefusedError(f"{key!r} of run {run_id} is {what}; {verb} it")
    return WaitStore._choice(question, value) if kind == "question" else value
