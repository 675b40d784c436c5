"""Commands for runs that wait: answer, approve, reject, feed, pause, resume."""

from __future__ import annotations

import json
import time
from typing import Any

import click
import redis

from ..deployment import Settings
from ..engine.waits import Answered, Question, WaitStore
from ..errors import MarblesError
from ..store.ids import check_id
from ..store.redis_errors import one_line
from ..terminal import safe


def _waits(settings: Settings, *, read_only: bool = False) -> WaitStore:
    return WaitStore(settings.runs(read_only=read_only))


def _enqueue(settings: Settings, run_id: str, attempt: int, queue: str) -> str:
    """Enqueue the woken run's delivery now; the controller dispatches it if this fails."""
    try:
        settings.rq().enqueue(queue, run_id, attempt)
    except redis.RedisError as exc:
        return f"; the controller will dispatch it ({one_line(exc)})"
    return ""


def _answered(settings: Settings, waits: WaitStore, run_id: str, done: Answered,
              what: str) -> None:
    tail = ""
    if done.woken_attempt:
        tail = "; run woken" + _enqueue(settings, run_id, done.woken_attempt,
                                        done.queue)
    else:
        tail = "; the run sees it when it next replays"
    click.echo(safe(f"run {run_id}: {done.question.key} {what}{tail}"))


@click.command()
@click.argument("run_id")
@click.argument("key")
@click.argument("value")
@click.pass_obj
def answer(settings: Settings, run_id: str, key: str, value: str) -> None:
    """Answer question KEY of run RUN_ID with VALUE (one of its choices, or the choice's
    number). The first answer wins; the run then goes on."""
    check_id(run_id, "run id")
    waits = _waits(settings)
    done = waits.answer(run_id, key, value, kind="question")
    _answered(settings, waits, run_id, done, f"answered {value!r}")


def _approval(settings: Settings, run_id: str, key: str, note: str | None,
              approved: bool) -> None:
    check_id(run_id, "run id")
    waits = _waits(settings)
    done = waits.answer(run_id, key, {"approved": approved, "note": note}, kind="approval")
    _answered(settings, waits, run_id, done, "approved" if approved else "rejected")


@click.command()
@click.argument("run_id")
@click.argument("key")
@click.option("--note", default=None, help="A note the run receives with the answer.")
@click.pass_obj
def approve(settings: Settings, run_id: str, key: str, note: str | None) -> None:
    """Approve approval KEY of run RUN_ID."""
    _approval(settings, run_id, key, note, True)


@click.command()
@click.argument("run_id")
@click.argument("key")
@click.option("--note", default=None, help="A note the run receives with the answer.")
@click.pass_obj
def reject(settings: Settings, run_id: str, key: str, note: str | None) -> None:
    """Reject approval KEY of run RUN_ID."""
    _approval(settings, run_id, key, note, False)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON: questions and reports.")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--reports", "n_reports", default=10, show_default=True,
              type=click.IntRange(0, 10_000), help="How many of the newest reports to show.")
@click.pass_obj
def feed(settings: Settings, as_json: bool, limit: int, n_reports: int) -> None:
    """Open questions across runs, oldest first, then the newest reports."""
    waits = _waits(settings, read_only=True)
    questions = waits.feed(limit)
    reports = waits.reports(n_reports) if n_reports else []
    now_ms = int(time.time() * 1000)
    if as_json:
        click.echo(json.dumps({"questions": [q.to_json(now_ms) for q in questions],
                               "reports": [r.to_json() for r in reports]}, indent=2))
        return
    if not questions:
        click.echo("no open questions")
    for q in questions:
        click.echo(safe(_question_line(q, now_ms)))
    if reports:
        click.echo("reports (newest first):")
        for r in reports:
            data = r.to_json()
            click.echo(safe(f"  {data['run']}  {data['key']}  "
                            f"{json.dumps(data['entry'])[:200]}"))


def _question_line(q: Question, now_ms: int) -> str:
    age = _age(now_ms - q.asked_ms)
    kind = "approve/reject" if q.record.ask == "approval" else "answer"
    choices = "" if not q.record.choices else "  choices: " + ", ".join(
        f"{i}={c}" for i, c in enumerate(q.record.choices, 1))
    body = f"  ({_cut(q.record.body)})" if q.record.body else ""
    return (f"{q.run_id}  {q.key}  {kind}  {age} ago  step {q.record.step}: "
            f"{_cut(q.record.title)}{body}{choices}")


def _cut(text: str, limit: int = 200) -> str:
    """One feed line per question: long text is cut (--json has it whole)."""
    return text if len(text) <= limit else text[:limit] + "..."



def _age(ms: int) -> str:
    seconds = max(0, ms) // 1000
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


@click.command()
@click.argument("run_id")
@click.pass_obj
def pause(settings: Settings, run_id: str) -> None:
    """Pause a run: a running run parks at its next step boundary, a queued one when it
    starts, a waiting one at once. Only `resume` wakes it."""
    check_id(run_id, "run id")  # bad input is exit 2 whether Redis answers or not
    outcome = _waits(settings).pause(run_id)
    if outcome == "settled":
        # Exit 1 is a failure, and every failure is one line on stderr (cli/__init__.py).
        raise MarblesError(f"run {run_id} has already finished; nothing to pause")
    click.echo({"paused": f"run {run_id} paused",
                "requested": f"run {run_id} will park at its next step boundary (paused)",
                "already": f"run {run_id} is already paused"}[outcome])


@click.command()
@click.argument("run_id")
@click.pass_obj
def resume(settings: Settings, run_id: str) -> None:
    """Resume a paused run."""
    check_id(run_id, "run id")
    waits = _waits(settings)
    outcome, attempt, queue = waits.resume(run_id)
    if outcome == "woken":
        tail = _enqueue(settings, run_id, attempt, queue)
        click.echo(f"run {run_id} resumed (delivery {attempt}){tail}")
    elif outcome == "resumed":
        click.echo(f"run {run_id} resumed before it parked; it carries on")
    else:  # exit 1, one line on stderr, like every failure (and like "not paused")
        raise MarblesError(f"run {run_id} has already finished; nothing to resume")


def questions_json(settings: Settings, run_id: str) -> list[dict[str, Any]]:
    waits = _waits(settings, read_only=True)
    return [q.to_json() for q in waits.questions(run_id)]


def reports_json(settings: Settings, run_id: str) -> list[dict[str, Any]]:
    waits = _waits(settings, read_only=True)
    return [r.to_json() for r in waits.run_reports(run_id)]
