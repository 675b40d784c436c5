"""Rate limit commands: `limits [--json]`, `limits set NAME RATE [--burst N]`, `limits reset
NAME` (flow/rate_limits.py)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import click

from ..client import Client
from ..deployment import Settings
from ..terminal import safe
from . import render

if TYPE_CHECKING:
    from ..flow.rate_store import RateLimitInfo


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


def _line(info: RateLimitInfo) -> str:
    rate = info.rate + (f" burst {info.burst}" if info.burst != 1 else "")
    source = "" if not info.overridden else (
        f" (set at run time; source: {info.source or 'unknown'})")
    last = _iso(info.last_ms) if info.last_ms else "never"
    return (f"{info.name}  {rate or '?'}{source}  held {info.held}  admitted "
            f"{info.admissions}  last {last}")


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the limits as JSON.")
@click.pass_context
def limits(ctx: click.Context, as_json: bool) -> None:
    """Rate limits: each limit's rate in force (set at run time, else the source's), burst,
    runs it holds, admissions and the last one. A workflow's limit per key shows one line
    per key value seen (`name[field=value]`)."""
    if ctx.invoked_subcommand is not None:
        return
    settings: Settings = ctx.obj
    found = Client(settings).rate_limits()
    if as_json:
        click.echo(json.dumps([i.to_dict() for i in found], indent=2))
        return
    if not found:
        click.echo("no rate limits (declare them with @mr.workflow(rate_limit=...) or "
                   "mr.rate_limit(...))")
        return
    if render.on_terminal():
        render.table(["LIMIT", "RATE", "BURST", "SOURCE", "HELD", "ADMITTED", "LAST"],
                     [[i.name, i.rate + (" (set)" if i.overridden else ""), str(i.burst),
                       i.source or "-", str(i.held), str(i.admissions),
                       render.when(i.last_ms or None)] for i in found])
        return
    for info in found:
        click.echo(safe(_line(info)))


@limits.command("set")
@click.argument("name")
@click.argument("rate")
@click.option("--burst", type=int, default=None,
              help="How many may pass at once after a quiet spell (default 1: strict "
                   "spacing).")
@click.option("--json", "as_json", is_flag=True, help="Print the limit as JSON.")
@click.pass_obj
def set_cmd(settings: Settings, name: str, rate: str, burst: int | None,
            as_json: bool) -> None:
    """Set limit NAME (or every limit of workflow NAME) to RATE: N/s, N/min, N/h or
    N/<count><unit> such as 5/10s. Workers apply it within a second; `limits reset NAME`
    goes back to the source's."""
    info = Client(settings).set_rate_limit(name, rate, burst)
    if as_json:
        click.echo(json.dumps(info.to_dict(), indent=2))
        return
    click.echo(safe(f"rate limit {name} set: {_line(info)}"))


@limits.command("reset")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the limit as JSON.")
@click.pass_obj
def reset_cmd(settings: Settings, name: str, as_json: bool) -> None:
    """Limit NAME back to the rate its source declares."""
    info = Client(settings).reset_rate_limit(name)
    if as_json:
        click.echo(json.dumps(info.to_dict(), indent=2))
        return
    click.echo(safe(f"rate limit {name} reset: {_line(info)}"))
