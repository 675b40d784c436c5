"""`marbles-rq events`: list recent inbound events; `events send`: send one."""

from __future__ import annotations

import json

import click

from ..deployment import Settings
from ..engine.ops import max_payload
from ..terminal import safe
from ..triggers.batches import Batches, OpenBatch
from ..triggers.events import Events
from .runs import json_argument


@click.group(invoke_without_command=True)
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True,
              help="How many of the newest events.")
@click.option("--json", "as_json", is_flag=True, help="Print the events as JSON.")
@click.pass_context
def events(ctx: click.Context, limit: int, as_json: bool) -> None:
    """Inbound events: list the newest ones and the runs they started (reads only)."""
    if ctx.invoked_subcommand is not None:
        return
    settings: Settings = ctx.obj
    views = Events(settings.runs(read_only=True)).recent(limit)
    if as_json:
        click.echo(json.dumps([v.to_json() for v in views], indent=2))
        return
    for v in views:
        what = v.source + (f"/{v.type}" if v.type else "")
        run = f"run {v.run_id} ({v.workflow}, {v.run_status or 'not recorded'})" \
            if v.run_id else "no trigger"
        if v.state == "batched" and v.run_status is None:
            run = f"batch {v.run_id} ({v.workflow}, open)"
        note = f"  [{v.note}]" if v.note else ""
        click.echo(safe(f"{v.to_json()['received_at']}  {v.key}  {what}  id={v.id}  "
                        f"{v.state}  {run}{note}"))
    _echo_batches(Batches(settings.runs(read_only=True)).open())


@events.command()
@click.option("--json", "as_json", is_flag=True, help="Print the open batches as JSON.")
@click.pass_obj
def batches(settings: Settings, as_json: bool) -> None:
    """Open event batches (triggers declared with batch=): per trigger and key value, how
    many events each holds, when it opened and when it seals by time (reads only)."""
    from ..client import Client

    found = Client(settings).open_batches()
    if as_json:
        click.echo(json.dumps([b.to_json() for b in found], indent=2))
        return
    if not found:
        click.echo("no open batches")
    _echo_batches(found)


def _echo_batches(found: list[OpenBatch]) -> None:
    for b in found:
        data = b.to_json()
        key = f"  key={b.key}" if b.key else ""
        click.echo(safe(f"open batch {b.batch_id}  {b.trigger} -> {b.workflow}{key}  "
                        f"{b.size} event{'' if b.size == 1 else 's'}  opened "
                        f"{data['opened_at']}  seals {data['seals_at']}"))


@events.command()
@click.argument("source")
@click.option("--id", "event_id", required=True, help="The provider's event id: the same "
              "source and id again create nothing.")
@click.option("--type", "event_type", default="", help="The event's type (triggers may "
              "select on it).")
@click.option("--payload", default="null", show_default=True,
              help="The event's payload as JSON; @FILE reads it from a file.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_obj
def send(settings: Settings, source: str, event_id: str, event_type: str, payload: str,
         as_json: bool) -> None:
    """Journal an inbound event of SOURCE, deliver it to the runs waiting for it, then start
    the run its trigger names: a trigger of --source for the sources it names, else one the
    deployment's workers declared (none: the event is journaled as unmatched)."""
    from ..client import Client

    client = Client(settings)
    raw = json_argument(payload, "payload", max_payload())
    sent = client.send_event(source, event_id, event_type, payload_json=raw)
    if as_json:
        click.echo(json.dumps({"key": sent.key, "created": sent.created, "state": sent.state,
                               "workflow": sent.workflow or None, "run": sent.run_id or None,
                               "run_created": sent.run_created,
                               "delivered": list(sent.delivered)}, indent=2))
        return
    if sent.delivered:
        click.echo(safe(f"event {sent.key} delivered to {len(sent.delivered)} waiting "
                        f"run{'' if len(sent.delivered) == 1 else 's'}: "
                        f"{', '.join(sent.delivered)}"))
    if not sent.created:
        run = f", run {sent.run_id}" if sent.run_id else ""
        click.echo(safe(f"event {sent.key} was received before ({sent.state}{run}); nothing "
                        f"created"))
    elif sent.state == "batched":
        click.echo(safe(f"event {sent.key} received; in batch {sent.run_id} ({sent.workflow})"
                        + ("; the batch is full: run queued" if sent.run_created else "")))
    elif not sent.workflow:
        click.echo(safe(f"event {sent.key} journaled; no trigger matches {source}"
                        + (f"/{event_type}" if event_type else "") + ", so no run"))
    else:
        click.echo(safe(f"event {sent.key} received; run {sent.run_id} queued "
                        f"({sent.workflow})"))
