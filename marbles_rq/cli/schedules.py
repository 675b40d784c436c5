"""Schedule commands: `schedules [--json]`, `schedules pause KEY`, `schedules resume KEY`."""

from __future__ import annotations

import json
import time

import click

from ..deployment import Settings
from ..terminal import safe
from ..triggers.schedules import (
    KEY_PATTERN,
    SCHEDULES,
    UnknownScheduleError,
    list_schedules,
    set_paused,
)
from . import render


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the schedules as JSON.")
@click.pass_context
def schedules(ctx: click.Context, as_json: bool) -> None:
    """Show declared and registered schedules with their history; a registered schedule
    that --source no longer declares is shown as orphaned (it never fires). Without
    --source, registered schedules show as registered."""
    if ctx.invoked_subcommand is not None:
        return
    settings: Settings = ctx.obj
    settings.load_source()
    views = list_schedules(settings.runs(read_only=True), sources_known=bool(settings.source))
    if as_json:
        click.echo(json.dumps([{"key": v.key, "status": v.status, "workflow": v.workflow,
                                **v.history(), "lastRun": v.last_run, "skipped": v.skipped}
                               for v in views], indent=2))
        return
    if not views:
        click.echo("no schedules (declare them with @mr.schedule in --source)")
        return
    if render.on_terminal():
        render.table(["SCHEDULE", "STATUS", "CADENCE", "WORKFLOW", "LAST START", "LAST RUN",
                      "NEXT DUE"],
                     [[v.key, render.status_cell(v.status), v.label, v.workflow,
                       render.when(v.last_start),
                       render.cell(v.last_status or None,
                                   render.STATUS_STYLES.get(v.last_status or "")),
                       render.when(v.next_due)] for v in views])
        return
    for v in views:
        parts = [v.key, v.status, v.label, f"-> {v.workflow}"]
        if v.last_start is not None:
            parts.append(f"last start {_iso(v.last_start)}")
        if v.last_status:
            parts.append(f"last {v.last_status} {_iso(v.last_finish)}")
        if v.next_due is not None:
            parts.append(f"next due {_iso(v.next_due)}")
        click.echo(safe("  ".join(parts)))


def _pause(settings: Settings, key: str, paused: bool) -> None:
    if not KEY_PATTERN.fullmatch(key):
        raise UnknownScheduleError(f"unknown schedule {key!r}")
    settings.load_source()
    if key not in SCHEDULES.schedules:  # unknown: refused before anything is written
        reader = settings.runs(read_only=True)
        if not reader.client.exists(reader.keys.schedule(key)):
            raise UnknownScheduleError(f"unknown schedule {key!r}: not declared by --source "
                                       f"and never registered")
    was = set_paused(settings.runs(), key, paused)
    word = "paused" if paused else "resumed"
    same = was == paused
    click.echo(safe(f"schedule {key} {'was already ' if same else ''}{word}"))


@schedules.command()
@click.argument("key")
@click.pass_obj
def pause(settings: Settings, key: str) -> None:
    """Pause schedule KEY: it does not fire until resumed (recorded; survives restarts)."""
    _pause(settings, key, True)


@schedules.command()
@click.argument("key")
@click.pass_obj
def resume(settings: Settings, key: str) -> None:
    """Resume schedule KEY."""
    _pause(settings, key, False)
