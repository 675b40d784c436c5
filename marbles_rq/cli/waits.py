"""Commands for runs that wait: answer, approve, reject, feed, pause, resume."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from ..client import Client
from ..deployment import Settings
from ..engine.waits import Question, Report, WaitStore
from ..store.ids import check_id
from ..terminal import safe
from . import render
from .bulk_ops import filter_options, given, one_or_many, pop_criteria, run_bulk_command


def _waits(settings: Settings, *, read_only: bool = False) -> WaitStore:
    return WaitStore(settings.runs(read_only=read_only))


def _client(settings: Settings) -> Client:
    return Client(settings)


@click.command()
@click.argument("run_id")
@click.argument("key")
@click.argument("value")
@click.pass_obj
def answer(settings: Settings, run_id: str, key: str, value: str) -> None:
    """Answer question KEY of run RUN_ID with VALUE (one of its choices, or the choice's
    number). The first answer wins; the run then goes on."""
    click.echo(safe(_client(settings).answer(check_id(run_id, "run id"), key, value).message))


def _approval(settings: Settings, run_id: str, key: str, note: str | None,
              approved: bool) -> None:
    client = _client(settings)
    check_id(run_id, "run id")
    done = (client.approve if approved else client.reject)(run_id, key, note)
    click.echo(safe(done.message))


def _approval_command(approved: bool) -> click.Command:
    verb = "approve" if approved else "reject"

    @click.command(verb)
    @click.argument("run_id", required=False)
    @click.argument("key", required=False)
    @click.option("--note", default=None, help="A note the run receives with the answer.")
    @filter_options
    @click.option("--json", "as_json", is_flag=True, help="With a filter: print the summary "
                  "as JSON.")
    @click.pass_obj
    def command(settings: Settings, /, run_id: str | None, key: str | None, note: str | None,
                as_json: bool, **kwargs: Any) -> None:
        criteria = pop_criteria(kwargs)
        if run_id is not None and key is None and not given(criteria):
            raise click.UsageError(f"missing KEY: {verb} RUN_ID KEY")
        if one_or_many(run_id, criteria):
            if not criteria["f_question"]:
                raise click.UsageError(f"{verb} by filter needs --question KEY: the "
                                       f"approval to {verb} in each run")
            run_bulk_command(settings, verb, criteria, as_json=as_json, note=note)
            return
        assert run_id is not None and key is not None
        _approval(settings, run_id, key, note, approved)

    command.help = (f"{verb.capitalize()} approval KEY of run RUN_ID. With a filter instead "
                    f"(`{verb} --question KEY --workflow NAME`), approval KEY of every run "
                    f"the filter selects that has it open, in batches (see --dry-run, "
                    f"--yes).")
    return command


approve = _approval_command(True)
reject = _approval_command(False)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON: questions and reports.")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--reports", "n_reports", default=10, show_default=True,
              type=click.IntRange(0, 10_000), help="How many of the newest reports to show.")
@click.pass_obj
def feed(settings: Settings, as_json: bool, limit: int, n_reports: int) -> None:
    """Open questions across runs, oldest first, then the newest reports."""
    from ..engine.failed_steps import feed_entries

    runs = settings.runs(read_only=True)
    waits = WaitStore(runs)
    questions = waits.feed(limit)
    reports = waits.reports(n_reports) if n_reports else []
    failed = feed_entries(waits, runs.views, limit)
    now_ms = int(time.time() * 1000)
    if as_json:
        click.echo(json.dumps({"questions": [q.to_json(now_ms) for q in questions],
                               "reports": [r.to_json() for r in reports],
                               "failed_steps": failed}, indent=2))
        return
    if render.on_terminal():
        _feed_tables(questions, reports)
        _failed_table(failed)
        return
    if not questions:
        click.echo("no open questions")
    for q in questions:
        click.echo(safe(_question_line(q, now_ms)))
    for f in failed:
        click.echo(safe(f"{f['run']}  step {f['step']} failed {f['attempts']} of "
                        f"{f['max_attempts']} attempts: {f['error']}  (marbles-rq retry / "
                        f"fail {f['run']})"))
    if reports:
        click.echo("reports (newest first):")
        for r in reports:
            data = r.to_json()
            click.echo(safe(f"  {data['run']}  {data['key']}  "
                            f"{json.dumps(data['entry'])[:200]}"))


def _feed_tables(questions: list[Question], reports: list[Report]) -> None:
    from .runs import answer_hint

    render.table(["RUN", "KEY", "ASKED", "STEP", "QUESTION", "ANSWER WITH"],
                 [[q.run_id, q.key, render.when(q.asked_ms), q.record.step,
                   _cut(q.record.title, 80)
                   + ("" if not q.record.choices else " (" + ", ".join(
                       f"{i}={c}" for i, c in enumerate(q.record.choices, 1)) + ")"),
                   answer_hint(q.run_id, q.key, q.record.ask).removeprefix("answer it: ")
                   .split("   ")[0]]
                  for q in questions],
                 title="open questions", empty="none")
    if reports:
        render.console().print()
        render.table(["RUN", "KEY", "AT", "ENTRY"],
                     [[r.run_id, r.record.key, render.when(r.record.at_ms),
                       _cut(json.dumps(r.to_json()["entry"]), 100)] for r in reports],
                     title="reports (newest first)")


def _failed_table(failed: list[dict[str, Any]]) -> None:
    if not failed:
        return
    render.console().print()
    render.table(["RUN", "STEP", "ATTEMPTS", "LAST ERROR", "ACT WITH"],
                 [[f["run"], f["step"], f"{f['attempts']} of {f['max_attempts']}",
                   _cut(str(f["error"]), 80), f"marbles-rq retry {f['run']}  (or fail)"]
                  for f in failed], title="paused on failed steps")


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
@click.argument("run_id", required=False)
@filter_options
@click.option("--json", "as_json", is_flag=True, help="With a filter: print the summary as "
              "JSON.")
@click.pass_obj
def pause(settings: Settings, /, run_id: str | None, as_json: bool, **kwargs: Any) -> None:
    """Pause a run: a running run parks at its next step boundary, a queued one when it
    starts, a waiting one at once. Only `resume` wakes it. With a filter instead of RUN_ID,
    every run it selects, in batches (see --dry-run, --yes)."""
    criteria = pop_criteria(kwargs)
    if one_or_many(run_id, criteria):
        run_bulk_command(settings, "pause", criteria, as_json=as_json)
        return
    assert run_id is not None
    check_id(run_id, "run id")  # bad input is exit 2 whether Redis answers or not
    # Settled: exit 1, one line on stderr, like every failure (cli/__init__.py).
    click.echo(_client(settings).pause(run_id).message)


@click.command()
@click.argument("run_id", required=False)
@filter_options
@click.option("--json", "as_json", is_flag=True, help="With a filter: print the summary as "
              "JSON.")
@click.pass_obj
def resume(settings: Settings, /, run_id: str | None, as_json: bool, **kwargs: Any) -> None:
    """Resume a paused run. With a filter instead of RUN_ID, every paused run it selects
    (others are skipped: not paused), in batches (see --dry-run, --yes)."""
    criteria = pop_criteria(kwargs)
    if one_or_many(run_id, criteria):
        run_bulk_command(settings, "resume", criteria, as_json=as_json)
        return
    assert run_id is not None
    check_id(run_id, "run id")
    click.echo(_client(settings).resume(run_id).message)
