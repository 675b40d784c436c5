"""`enqueue NAME --batch FILE.jsonl`: the command-line face of engine/bulk.py: a progress
bar on a terminal, refusals as they come, a summary, and an exit code."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import IO, Any

import click

from ..deployment import Settings
from ..engine.authoring import InputError, queue_problem
from ..engine.bulk import BulkReport, Refused, bulk_enqueue
from ..errors import InvalidIdError
from ..terminal import safe
from .exits import EXIT_INPUT


@contextlib.contextmanager
def _open(path: str) -> Iterator[tuple[IO[bytes], int | None]]:
    """The batch as a binary stream, and its size when known (for the progress bar)."""
    if path == "-":
        yield sys.stdin.buffer, None
        return
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise InputError(f"cannot read the batch file: {exc}") from None
    with fh:
        try:
            size = os.fstat(fh.fileno()).st_size or None
        except OSError:
            size = None
        yield fh, size


def _summary(report: BulkReport) -> str:
    text = (f"{report.enqueued} enqueued, {report.existing} already existing, "
            f"{report.refused} refused ({report.lines} lines)")
    if report.undispatched:
        text += (f"; {report.undispatched} recorded but not yet in RQ (the controller "
                 f"enqueues them)")
    return text


def run_batch(settings: Settings, name: str, path: str, queue: str | None,
              as_json: bool) -> None:
    settings.load_source()
    from ..engine.authoring import REGISTRY

    REGISTRY.workflow(name)  # an unknown workflow: one line and exit 2, before any read
    if queue is not None and (problem := queue_problem(queue)) is not None:
        raise InvalidIdError(problem)
    show_bar = sys.stderr.isatty() and not as_json

    def refused(item: Refused) -> None:
        if not as_json:
            say(f"line {item.line}: {item.reason}")

    with _open(path) as (fh, size), _progress(show_bar, size) as (say, advance):
        runs = settings.runs()
        rq = settings.rq()
        last: list[BulkReport] = []

        def progress(report: BulkReport) -> None:
            last[:] = [report]
            advance(report)

        try:
            report = bulk_enqueue(runs, rq, name, fh, queue=queue, on_refused=refused,
                                  on_progress=progress)
        except KeyboardInterrupt:
            _stopped(last, "interrupted")
            sys.exit(130)
        except Exception:
            _stopped(last, "stopped by the error below")
            raise
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        click.echo(_summary(report))
    if report.refused:
        sys.exit(EXIT_INPUT)


def _stopped(last: list[BulkReport], why: str) -> None:
    if not last:
        return  # stopped before anything was sent: the error line says it all
    done = last[0]
    click.echo(f"{why} after line {done.lines}: {_summary(done)}; the same command again "
               f"enqueues the rest (lines already in are found by their ids)", err=True)


@contextlib.contextmanager
def _progress(show: bool, size: int | None) -> Iterator[tuple[Any, Any]]:
    """(say, advance): `say` prints a line above the bar (or to stderr without one)."""
    if not show:
        yield (lambda line: click.echo(safe(line), err=True)), (lambda report: None)
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
    if size:
        columns += [DownloadColumn(), TimeRemainingColumn()]
    columns += [TimeElapsedColumn(), TextColumn("{task.fields[counts]}")]
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("enqueue", total=size, counts="")

        def advance(report: BulkReport) -> None:
            bar.update(task, completed=report.bytes_read,
                       counts=f"line {report.lines:,}: {report.enqueued:,} new, "
                              f"{report.existing:,} existing, {report.refused:,} refused")

        yield (lambda line: console.print(safe(line), markup=False, highlight=False)), advance
