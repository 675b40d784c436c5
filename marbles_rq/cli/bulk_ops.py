"""The filter form of cancel, pause, resume, rerun, approve and reject: `marbles-rq cancel
--status queued --workflow report`. A dry run counts and shows a sample; on a terminal the
command asks before it acts (`--yes` skips; with stdin not a terminal it refuses without
--yes); a progress bar on a terminal, a line per batch otherwise; a summary at the end. Ctrl-C
stops between batches and says how far it got: the same command again does the rest (runs
already done are skipped with their reason). The work itself is client/bulk.py."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import click

from ..deployment import Settings
from ..engine.runs import STATUSES
from ..terminal import safe
from .exits import EXIT_PROBLEM

_AGO = re.compile(r"-?(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
FILTER_FLAGS = ("status", "workflow", "queue", "since", "until", "tags", "question")


def parse_when(text: str | None, name: str) -> float | None:
    """--since/--until: ISO 8601 with a zone, or N s|m|h|d ago (`2h`, `-30m`); epoch s."""
    if text is None:
        return None
    if (m := _AGO.fullmatch(text.strip())) is not None:
        return time.time() - float(m[1]) * _UNIT_S[m[2]]
    import datetime as dt

    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{text!r}: give ISO 8601 with a zone "
                                 f"(2026-12-01T09:00:00Z) or a time ago (90s, 2h, 7d)",
                                 param_hint=f"--{name}") from None
    if when.tzinfo is None:
        raise click.BadParameter(f"{text!r} has no zone: add Z or an offset (+01:00)",
                                 param_hint=f"--{name}")
    return when.timestamp()


def filter_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The filter options, and the options of a bulk run, shared by the six commands."""
    options = [
        click.option("--status", "f_status", type=click.Choice(STATUSES), default=None,
                     help="Filter: runs in this status."),
        click.option("--workflow", "f_workflow", default=None,
                     help="Filter: runs of this workflow."),
        click.option("--queue", "f_queue", default=None, help="Filter: runs on this queue."),
        click.option("--since", "f_since", default=None, metavar="WHEN",
                     help="Filter: created at or after WHEN (ISO 8601 with a zone, or a time "
                          "ago: 90s, 2h, 7d)."),
        click.option("--until", "f_until", default=None, metavar="WHEN",
                     help="Filter: created at or before WHEN (as --since)."),
        click.option("--tag", "f_tags", multiple=True, metavar="KEY=VALUE",
                     help="Filter: runs carrying this tag (repeat: every one)."),
        click.option("--question", "f_question", default=None, metavar="KEY",
                     help="Filter: runs with this question or approval open."),
        click.option("--dry-run", "dry_run", is_flag=True,
                     help="With a filter: print how many runs match and a sample; change "
                          "nothing."),
        click.option("--yes", "-y", "yes", is_flag=True,
                     help="With a filter: do not ask for confirmation (needed when stdin is "
                          "not a terminal)."),
        click.option("--batch-size", "batch_size", type=click.IntRange(1, 1000), default=100,
                     show_default=True, help="With a filter: runs acted on per pass (Ctrl-C "
                     "stops between passes)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def given(criteria: dict[str, Any]) -> bool:
    """Whether any filter option was given (the filter form, not the id form)."""
    return any(criteria.get(f"f_{name}") not in (None, (), "") for name in FILTER_FLAGS)


def pop_criteria(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The filter and bulk options, taken out of a command's keyword arguments."""
    names = [f"f_{n}" for n in FILTER_FLAGS] + ["dry_run", "yes", "batch_size"]
    return {n: kwargs.pop(n) for n in names}


def one_or_many(run_id: str | None, criteria: dict[str, Any]) -> bool:
    """True for the filter form; False for the id form (RUN_ID given, no filter). Both, or
    neither, is a usage error; so is --dry-run with an id (it would do nothing)."""
    if run_id is not None and given(criteria):
        raise click.UsageError("give a run id or a filter (--status, --workflow, ...), not "
                               "both")
    if run_id is None and not given(criteria):
        raise click.UsageError("give a run id, or a filter: --status, --workflow, --queue, "
                               "--since, --until, --tag, --question")
    if run_id is not None and criteria["dry_run"]:
        raise click.UsageError("--dry-run applies to the filter form, not to a run id")
    return run_id is None


def run_bulk_command(settings: Settings, action: str, criteria: dict[str, Any], *,
                     as_json: bool = False, **options: Any) -> None:
    """Select by the filter, confirm, act in batches, print the summary; exit 1 when some
    runs failed, 130 when interrupted."""
    from ..client import Client
    from ..engine.selection import RunFilter

    target = RunFilter.build(
        status=criteria["f_status"], workflow=criteria["f_workflow"],
        queue=criteria["f_queue"], since=parse_when(criteria["f_since"], "since"),
        until=parse_when(criteria["f_until"], "until"), tags=list(criteria["f_tags"]),
        question=criteria["f_question"])
    client = Client(settings)
    what = target.describe()
    # The runs created before now: what the count saw is what is acted on (the reruns a
    # bulk rerun makes, or runs started meanwhile, are not swept in). A rerun's ids derive
    # from the filter as given, so the same command later finds the reruns it made.
    import dataclasses

    from ..client.bulk import rerun_key

    if action == "rerun":
        options["rerun_key"] = rerun_key(target, options.get("from_step"))
    now = time.time()
    target = dataclasses.replace(target, until=now if target.until is None
                                 else min(target.until, now))
    count, sample = client.count(target, 10)
    if criteria["dry_run"]:
        if as_json:
            click.echo(json.dumps({"action": action, "filter": target.to_json(),
                                   "matched": count, "sample": sample}, indent=2))
            return
        click.echo(safe(f"{count} run{'' if count == 1 else 's'} match ({what}); {action} "
                        f"would act on each (dry run: nothing changed)"))
        for run_id in sample:
            click.echo(safe(f"  {run_id}"))
        if count > len(sample):
            click.echo("  ...")
        return
    if count == 0:
        click.echo(safe(f"no runs match ({what}); nothing to {action}"))
        return
    if not criteria["yes"]:
        if not sys.stdin.isatty():
            from ..engine.authoring import InputError

            raise InputError(f"refusing to {action} {count} runs without confirmation: stdin "
                             f"is not a terminal (pass --yes, or --dry-run to look first)")
        if not click.confirm(safe(f"{action} {count} runs ({what})?"), default=False,
                             err=True):
            click.echo("nothing done", err=True)
            sys.exit(EXIT_PROBLEM)
    show_bar = sys.stderr.isatty() and not as_json
    with _interruptible() as stop, _progress(show_bar, action, count) as advance:
        summary = client.bulk(action, target, batch=criteria["batch_size"],
                              on_batch=advance, should_stop=stop, **options)
    if as_json:
        click.echo(json.dumps({"filter": target.to_json(), **_summary_json(summary)},
                              indent=2))
    else:
        click.echo(safe(summary.line()))
        for failure in summary.failures:
            click.echo(safe(f"  {failure.run_id}: {failure.message}"), err=True)
    if summary.stopped:
        click.echo(safe(f"interrupted after {summary.matched} of {count} runs; the same "
                        f"command again does the rest (what was done is skipped)"), err=True)
        sys.exit(130)
    if summary.n_failed:
        sys.exit(EXIT_PROBLEM)


def _summary_json(summary: Any) -> dict[str, Any]:
    import msgspec

    return dict(msgspec.to_builtins(summary))


@contextlib.contextmanager
def _interruptible() -> Iterator[Callable[[], bool]]:
    """A stop flag set by Ctrl-C (SIGINT): the batch under way finishes, then the command
    stops. A second Ctrl-C stops at once."""
    asked: list[bool] = []

    def handler(signum: int, frame: Any) -> None:
        if asked:
            raise KeyboardInterrupt
        asked.append(True)
        click.echo("stopping after this batch (Ctrl-C again stops now)", err=True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _progress(show: bool, action: str, total: int) -> Iterator[Callable[[Any], None]]:
    if not show:
        def line(summary: Any) -> None:
            click.echo(f"{action}: {summary.matched} of {total} (done {summary.done}, skipped "
                       f"{summary.n_skipped}, failed {summary.n_failed})", err=True)

        yield line
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[counts]}"), console=Console(stderr=True)) as bar:
        task = bar.add_task(action, total=total, counts="")

        def advance(summary: Any) -> None:
            bar.update(task, completed=min(summary.matched, total),
                       counts=f"done {summary.done}, skipped {summary.n_skipped}, failed "
                              f"{summary.n_failed}")

        yield advance
