"""`locks [--json]`: each durable mutex's holder and its waiters in order (flow/locks.py)."""

from __future__ import annotations

import json
import time

import click

from ..client import Client
from ..deployment import Settings
from ..flow.lock_store import LockInfo
from ..terminal import safe
from . import render


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


def _line(info: LockInfo) -> str:
    held = (f"held by {info.holder} (epoch {info.epoch}) since {_iso(info.since_ms)}, "
            f"lease until {_iso(info.until_ms)}") if info.holder else "free"
    waiting = ", ".join(info.waiters) if info.waiters else "none"
    return f"{info.name}  {held}  waiters {len(info.waiters)}: {waiting}"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the locks as JSON.")
@click.pass_obj
def locks(settings: Settings, as_json: bool) -> None:
    """Locks taken with mr.lock: each one's holder (run id, the holding execution's epoch,
    since when, until when its lease lasts without a renewal) and the runs waiting for it,
    in order of arrival (the first is next)."""
    found = Client(settings).locks()
    if as_json:
        click.echo(json.dumps([i.to_dict() for i in found], indent=2))
        return
    if not found:
        click.echo("no locks (a body takes one with `with mr.lock(key):`)")
        return
    if render.on_terminal():
        render.table(["LOCK", "HOLDER", "SINCE", "LEASE UNTIL", "WAITERS"],
                     [[i.name, i.holder or "-", render.when(i.since_ms or None),
                       render.when(i.until_ms or None),
                       " ".join(i.waiters) or "-"] for i in found])
        return
    for info in found:
        click.echo(safe(_line(info)))
