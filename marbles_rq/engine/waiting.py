"""What a run body uses to wait and report: questions and approvals, reports, durable
timers, and the parking they end in.

Waiting never blocks a worker. A call that must wait raises ParkRun; the execution ends,
parks the run (engine/waits.py) and frees its worker; when what it waits for happens, the
run is delivered again and the body replays from the top against the ledger, where the call
now returns (the recorded answer, the fired timer, a child's result: engine/fanout.py).

    approved = ctx.ask.approval("Ship it?")            # -> {"approved": bool, "note": ...}
    colour = ctx.ask.question("Colour?", choices=["red", "blue"])
    ctx.report.milestone({"built": 3})
    mr.sleep(3600)
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis

from ..errors import MarblesError
from ..store.records import AskRecord, ReportRecord, StepRecord
from ..store.redis_errors import one_line
from .authoring import InputError
from .context import Run, StopExecution, check_branch, check_not_in_foreign_thread, now_ms
from .waits import check_key

log = logging.getLogger("marbles_rq.engine.waiting")

MAX_CHOICES = 9
MAX_TITLE = 500
MAX_BODY = 20_000
MAX_CHOICE = 200
MAX_SLEEP_MS = 10 * 366 * 86_400_000  # timers are for up to ten years
KIND_NAMES = {"|sleep": "mr.sleep", "|child": "mr.start_child",
              "|signal": "mr.wait_for_signal", "|signals": "ctx.signals", "|now": "mr.now"}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


# -- parking -----------------------------------------------------------------------------

@dataclass
class Wait:
    """One thing a run waits for."""

    reason: str  # question | timer | child | event | paused | signal | retry | failed_step
    wake_at_ms: int = 0  # when the controller wakes it (0: only from outside)
    questions: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    signals: list[str] = field(default_factory=list)  # names (engine/signal_waits.py)
    until_ms: int = 0
    asks: list[AskRecord] = field(default_factory=list)
    ledger: list[StepRecord] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # {source, type, match}
    # Shown in status with what it waits for: a retry's, a paused step's or a rate limit's
    # facts.
    detail: dict[str, Any] = field(default_factory=dict)


class ParkRun(BaseException):
    """The run must wait: the execution ends and the run parks. A BaseException, so a
    body's `except Exception` cannot swallow it."""

    def __init__(self, waits: list[Wait]) -> None:
        super().__init__(", ".join(w.reason for w in waits))
        self.waits = waits
        self.ledger: list[StepRecord] = [r for w in waits for r in w.ledger]


class NonDeterminismError(BaseException):
    """The replayed body called something else at a recorded position: the run fails. A
    BaseException, so a step's retries and a body's `except Exception` do not hide it."""

    def __init__(self, frame: str, position: int, recorded: str, called: str) -> None:
        super().__init__(
            f"non-deterministic replay in {frame} at position {position}: the ledger "
            f"recorded {_name(recorded)!r} there, the body now calls {_name(called)!r} "
            f"(a workflow must make its recorded calls in the same order on every replay)")
        self.frame = frame


def _name(name: str) -> str:
    return KIND_NAMES.get(name, name)


class AskTimeoutError(MarblesError):
    code = "ask_timeout"


def deliver_now(deliver: Callable[[str, str, int], bool] | None, queue: str, run_id: str,
                attempt: int) -> None:
    """Enqueue a delivery now; a failure leaves it to the controller (after its grace)."""
    if deliver is None:
        return
    try:
        deliver(queue, run_id, attempt)
    except (redis.RedisError, OSError) as exc:
        log.warning("run %s attempt %s: enqueue failed (%s); the controller dispatches it",
                    run_id, attempt, one_line(exc))


# -- questions ---------------------------------------------------------------------------

class Ask:
    """`ctx.ask`: questions and approvals that park the run until someone answers."""

    def __init__(self, run: Run) -> None:
        self._run = run

    def approval(self, title: str, body: str | None = None, key: str | None = None, *,
                 timeout_s: float | None = None, default: Any = ...) -> dict[str, Any]:
        """{"approved": bool, "note": str | None}, once someone approves or rejects."""
        answer = self._ask("approval", title, body, None, key, timeout_s, default)
        return answer if isinstance(answer, dict) else {"approved": bool(answer), "note": None}

    def question(self, title: str, body: str | None = None, choices: list[str] | None = None,
                 key: str | None = None, *, timeout_s: float | None = None,
                 default: Any = ...) -> str:
        """The answer text (one of `choices` when given, at most 9)."""
        if choices is not None:
            if not 1 <= len(choices) <= MAX_CHOICES or not all(
                    isinstance(c, str) and c for c in choices):
                raise InputError(f"choices: 1 to {MAX_CHOICES} non-empty strings")
            if len(set(choices)) != len(choices):
                raise InputError("choices must differ from each other")
        if default is not ... and choices and default not in choices:
            raise InputError(f"the default {default!r} is not one of the choices")
        answer = self._ask("question", title, body, choices, key, timeout_s, default)
        # An answer is text; a timed-out question returns its default as given (None too).
        return answer if isinstance(answer, str) or answer is default else str(answer)

    def _ask(self, kind: str, title: str, body: str | None, choices: list[str] | None,
             key: str | None, timeout_s: float | None, default: Any) -> Any:
        check_not_in_foreign_thread(f"ask.{kind}")
        run = self._run
        check_branch()
        if not isinstance(title, str) or not title.strip():
            raise InputError("a question needs a title")
        # The feed lists every open question of every run: one run must not swamp it.
        if len(title) > MAX_TITLE:
            raise InputError(f"a question's title is at most {MAX_TITLE} characters")
        if body is not None and (not isinstance(body, str) or len(body) > MAX_BODY):
            raise InputError(f"a question's body is text of at most {MAX_BODY} characters")
        if choices is not None and any(len(c) > MAX_CHOICE for c in choices):
            raise InputError(f"a choice is at most {MAX_CHOICE} characters")
        if timeout_s is not None and not 0 < timeout_s <= 366 * 86400:
            raise InputError("timeout_s must be between 0 and a year")
        frame = run.frame
        n = frame.counters["|ask"]
        frame.counters["|ask"] += 1
        qkey = check_key(key, "question key") if key is not None else _local(run, f"ask:{n}")
        if run.ex.asks_seen is not None:
            run.ex.asks_seen.add(qkey)
        state = run_asks(run).get(qkey)
        if state is not None and state["kind"] != kind:
            # An answer recorded for another kind of ask (the code changed under a waiting
            # run) must not be read as this one: "no" is not an approval.
            raise NonDeterminismError(frame.path, n, f"ask.{state['kind']}", f"ask.{kind}")
        if state is not None and state["state"] == "answered":
            return state["answer"]
        if state is not None and state["state"] == "timed_out":
            if default is not ...:
                return default
            raise AskTimeoutError(f"question {qkey!r} was not answered within its timeout")
        if state is not None and state["state"] == "cancelled":
            raise StopExecution("cancelled")
        record = AskRecord(version=1, key=qkey, ask=kind, title=title, body=body,
                           choices=choices, step=frame.path, timeout_s=timeout_s or 0.0,
                           default=msgspec.Raw(msgspec.json.encode(
                               None if default is ... else default)),
                           has_default=default is not ...)
        raise ParkRun([Wait("question", questions=[qkey], asks=[record])])


def run_asks(run: Run) -> dict[str, dict[str, Any]]:
    """The run's questions as this execution found them (read once, at its first ask)."""
    if run.found_asks is None:

        questions = run.call_store(run.runs.waits().questions, run.run_id)
        run.found_asks = {q.key: {"state": q.state, "answer": q.answer, "kind": q.record.ask,
                                  "step": q.record.step} for q in questions}
    return run.found_asks


def _local(run: Run, name: str) -> str:
    """A default key: `name` in the workflow's own frame, `<step>/<name>` inside a step."""
    root = run.ex.record.name
    path = run.frame.path
    if path == root:
        return name
    # Never a '|' (the feed's separator), and at most 128 characters.
    frame = path[len(root) + 1:].replace("|parallel#", "parallel").replace("|", "")
    key = f"{frame}/{name}"
    if len(key) > 128 or not key.isprintable():
        import hashlib

        key = f"{hashlib.sha1(path.encode()).hexdigest()[:16]}/{name}"
    return key


# -- reports -----------------------------------------------------------------------------

class Reporter:
    """`ctx.report`: milestones and results, kept with the run and listed in the feed."""

    def __init__(self, run: Run) -> None:
        self._run = run

    def milestone(self, entry: Any, key: str | None = None) -> None:
        self._add("milestone", entry, key)

    def result(self, entry: Any, key: str | None = None) -> None:
        self._add("result", entry, key)

    def _add(self, kind: str, entry: Any, key: str | None) -> None:
        check_not_in_foreign_thread(f"report.{kind}")
        run = self._run
        frame = run.frame
        n = frame.counters[f"|{kind}"]
        frame.counters[f"|{kind}"] += 1
        rkey = check_key(key, "report key") if key is not None else _local(run, f"{kind}:{n}")
        encoded = msgspec.json.encode(entry)
        run.limits.check(f"report {rkey}", len(encoded), run.limits.write_bytes, "write_bytes")
        record = ReportRecord(version=1, key=rkey, report=kind, entry=msgspec.Raw(encoded),
                              step=frame.path, at_ms=now_ms())
        status = run.call_store(run.runs.waits().add_report, run.ex, record)
        run.check_reply("ok" if status == "exists" else status)


# -- timers ------------------------------------------------------------------------------

def sleep(run: Run, seconds: float) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not (
            0 <= seconds <= MAX_SLEEP_MS / 1000):
        raise InputError(f"sleep takes seconds from 0 to ten years, not {seconds!r}")
    # Rounded up: a sleep is never shorter than asked.
    _timer(run, lambda: run.ex.server_now_ms() + math.ceil(seconds * 1000))


def sleep_until(run: Run, when: dt.datetime) -> None:
    if not isinstance(when, dt.datetime) or when.tzinfo is None:
        raise InputError("sleep_until takes a timezone-aware datetime")
    # Exact, rounded up to the next millisecond: a float timestamp can land a fraction of a
    # millisecond before `when`, and a timer must never fire before it.
    _timer(run, lambda: -((_EPOCH - when) // dt.timedelta(milliseconds=1)))


def _timer(run: Run, due_of: Callable[[], int]) -> None:
    check_not_in_foreign_thread("sleep")
    check_branch()
    key, seq = run.position("|sleep")
    recorded = run.ex.ledger.get(key)
    if recorded is not None:
        due = int(msgspec.json.decode(recorded.result)["due_ms"])
        new: list[StepRecord] = []
    else:
        due = due_of()
        if due - run.ex.server_ms > MAX_SLEEP_MS:
            raise InputError("a timer is due at most ten years ahead")
        record = StepRecord(version=1, key=key, name="|sleep", status="waiting", attempts=0,
                            result=msgspec.Raw(msgspec.json.encode({"due_ms": due})),
                            at_ms=now_ms(), seq=seq)
        new = [record]
    # The controller wakes a timer only once the server's clock has passed its due time,
    # and this execution started after that wake: fired, and never early.
    if due <= run.ex.server_ms:
        if recorded is not None and recorded.status != "fired":
            # The first execution past it records it fired, whatever woke the run (its
            # timer, a resume after a pause that outlasted it, an answer to a parallel
            # branch): ledger and output then say so once. Written where it fires, not by
            # the wake, which neither knows the timer's entry nor ends every such wait.
            fired_ms = run.ex.server_ms
            run.commit_entry(msgspec.structs.replace(recorded, status="fired", result=msgspec.Raw(
                msgspec.json.encode({"due_ms": due, "fired_ms": fired_ms}))),
                "timer_fired", {"timer": key, "due_ms": due, "late_ms": fired_ms - due})
        return
    raise ParkRun([Wait("timer", wake_at_ms=due, until_ms=due, ledger=new)])
