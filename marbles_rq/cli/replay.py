"""`marbles-rq export` (run histories as JSON lines) and `marbles-rq replay --check` (replay
them against new code in memory: engine/replay_check.py)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from typing import TYPE_CHECKING

import click

from ..deployment import Settings
from ..terminal import safe
from .exits import EXIT_PROBLEM

if TYPE_CHECKING:
    from ..engine.history import History, Wanted


def _wanted(run_ids: tuple[str, ...], workflow: str | None, status: str | None,
            default_statuses: tuple[str, ...]) -> Wanted:
    from ..engine.history import Wanted, parse_statuses

    if run_ids and (workflow or status):
        raise click.UsageError("give RUN ids or --workflow (with --status), not both")
    if status and not workflow:
        raise click.UsageError("--status narrows --workflow: give --workflow too")
    if run_ids:
        from ..store.ids import check_id

        for rid in run_ids:
            check_id(rid, "run id")
        return Wanted(run_ids=run_ids)
    if not workflow:
        raise click.UsageError("give RUN ids or --workflow W")
    return Wanted(workflow=workflow, statuses=parse_statuses(status) or default_statuses)


@click.command("export")
@click.argument("run_ids", nargs=-1, metavar="[RUN]...")
@click.option("--workflow", default=None, help="Every run of this workflow (newest first).")
@click.option("--status", default=None, metavar="S[,S...]",
              help="With --workflow: only runs in these statuses (e.g. waiting,running).")
@click.option("--output", "-o", default="-", metavar="FILE",
              help="Write to FILE (whole, or not at all) instead of stdout.")
@click.pass_obj
def export_cmd(settings: Settings, run_ids: tuple[str, ...], workflow: str | None,
               status: str | None, output: str) -> None:
    """Write run histories, one JSON line per run: the run's record (input, workflow and
    version), status, ledger, questions and answers, signals, children's outcomes and
    claimed effects -- what a replay reads. `replay --check --from FILE` checks new code
    against them without Redis."""
    from ..engine.history import select, to_line

    wanted = _wanted(run_ids, workflow, status, ())
    runs = settings.runs(read_only=True)
    batches: Iterable[list[History]] = select(runs, wanted)
    if wanted.run_ids:
        # Every named run read before a line is written: an unknown id writes nothing.
        batches = list(batches)
    if output == "-":
        out = sys.stdout.buffer
        count = 0
        for batch in batches:
            for history in batch:
                out.write(to_line(history))
                count += 1
        out.flush()
        if not count and wanted.workflow:
            # Not an error (a workflow may have no run now), but a misspelt name looks the
            # same: say it on stderr, so stdout stays a valid (empty) history file.
            click.echo(safe(f"note: no run of workflow {wanted.workflow!r} in "
                            f"{', '.join(wanted.statuses) or 'any status'}"), err=True)
        return
    if os.path.isdir(output):
        raise click.ClickException(f"cannot write {output}: it is a directory")
    if os.path.exists(output) and not os.path.isfile(output):
        # A pipe, a device, /dev/stdout: written to as it is (renaming a file over it would
        # replace it).
        try:
            count = 0
            with open(output, "wb") as fh:
                for batch in batches:
                    for history in batch:
                        fh.write(to_line(history))
                        count += 1
        except OSError as exc:
            raise click.ClickException(f"cannot write {output}: {exc.strerror}") from None
        click.echo(safe(f"exported {count} run histor{'y' if count == 1 else 'ies'} to "
                        f"{output}"), err=True)
        return
    folder = os.path.dirname(os.path.abspath(output))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".export-", suffix=".jsonl")
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror}") from None
    count = 0
    try:
        with os.fdopen(fd, "wb") as fh:
            for batch in batches:
                for history in batch:
                    fh.write(to_line(history))
                    count += 1
        os.replace(tmp, output)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise click.ClickException(f"cannot write {output}: {exc.strerror}") from None
        raise
    click.echo(safe(f"exported {count} run histor{'y' if count == 1 else 'ies'} to {output}"))


@click.command("replay")
@click.argument("run_ids", nargs=-1, metavar="[RUN]...")
@click.option("--check", is_flag=True, help="Replay recorded runs against the code of "
              "--source in memory and report whether each would go on (the only mode).")
@click.option("--workflow", default=None,
              help="Every run of this workflow in the statuses of --status.")
@click.option("--status", default=None, metavar="S[,S...]",
              help="With --workflow (default: waiting,running,queued: the runs in flight).")
@click.option("--from", "from_file", default=None, metavar="FILE.jsonl",
              help="Histories written by `marbles-rq export` ('-': stdin); no Redis needed.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per run, then one with the summary and the patches.")
@click.pass_obj
def replay_cmd(settings: Settings, run_ids: tuple[str, ...], check: bool,
               workflow: str | None, status: str | None, from_file: str | None,
               as_json: bool) -> None:
    """Check new code (--source) against recorded runs before deploying it: each run's
    ledger is replayed in this process (a recorded call returns its recorded result, the
    code between calls runs, no step body runs, nothing is written). Per run: ok, or
    NonDeterminism (frame, position, both names), a body error, a question no longer asked,
    a patch removed while the run took its old branch. Then which patches still have runs
    in flight on their old branch. Exit 1 if any run would fail."""
    from ..engine.authoring import REGISTRY
    from ..engine.history import read_file, select
    from ..engine.replay_check import IN_FLIGHT, Report, Verdict, check_all

    if not check:
        raise click.UsageError("replay needs --check (replay --check --source NEW_CODE ...)")
    if not settings.source:
        raise click.UsageError("give --source: the new code to check the runs against")
    if from_file is not None and (run_ids or workflow or status):
        raise click.UsageError("give --from FILE, RUN ids or --workflow, only one of them")
    settings.load_source()
    histories: list[History] = []
    if from_file is not None:
        histories = list(read_file(from_file))  # every line read before any is replayed
        # A run twice (two exports concatenated) is checked once, as its last line has it.
        unique = {h.run_id: h for h in histories}
        if len(unique) < len(histories):
            click.echo(f"note: {len(histories) - len(unique)} line(s) repeat a run already in "
                       f"{from_file}; each run is checked once, as its last line has it",
                       err=True)
            histories = list(unique.values())
    else:
        wanted = _wanted(run_ids, workflow, status, IN_FLIGHT)
        for batch in select(settings.runs(read_only=True), wanted):
            histories += batch
        if workflow and not histories and workflow not in REGISTRY.workflows:
            # Else a misspelt name checks nothing and passes.
            raise click.UsageError(f"--workflow {workflow!r}: the source declares no such "
                                   f"workflow and no run of it was found")

    def show(verdict: Verdict) -> None:
        if as_json:
            click.echo(json.dumps(verdict.to_json()))
            return
        version = f"@{verdict.wf_version}" if verdict.wf_version else ""
        click.echo(safe(f"{'ok  ' if verdict.ok else 'FAIL'}  {verdict.run_id}  "
                        f"{verdict.workflow}{version}  {verdict.summary}"))
        for problem in verdict.problems[1:]:
            click.echo(safe(f"      also: {problem.message}"))
        for note in verdict.notes:
            click.echo(safe(f"      note: {note}"))

    report: Report = check_all(histories, REGISTRY, on_verdict=show)
    if as_json:
        click.echo(json.dumps(report.summary_json()))
    else:
        for line in report.patch_lines():
            click.echo(safe(line))
        click.echo(report.summary())
    if report.failing:
        sys.exit(EXIT_PROBLEM)
