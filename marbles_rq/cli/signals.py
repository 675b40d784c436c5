"""The signal command: send a signal to a run, or start the run with it (signal-with-start)."""

from __future__ import annotations

import json

import click

from ..client import Client
from ..deployment import Settings
from ..engine.ops import max_payload
from ..store.ids import check_id
from ..terminal import safe
from .runs import json_argument


@click.command("signal")
@click.argument("args", nargs=-1, metavar="RUN NAME | --start WORKFLOW --id RUN NAME")
@click.option("--payload", default=None, metavar="JSON|@FILE",
              help="The signal's payload as JSON; @FILE reads it from a file. Default: null.")
@click.option("--start", "workflow", default=None, metavar="WORKFLOW",
              help="Signal-with-start: start a run of WORKFLOW under --id if no run has that "
                   "id, and give it the signal in the same step.")
@click.option("--id", "run_id", default=None, help="With --start: the run's id.")
@click.option("--input", "input_json", default=None, metavar="JSON|@FILE",
              help="With --start: the new run's input (as `enqueue --input`).")
@click.option("--queue", default=None, help="With --start: RQ queue (default: the workflow's).")
@click.option("--priority", type=int, default=None, help="With --start: -100 to 100.")
@click.option("--request-id", default=None, help="An id for this send: the same command "
              "again with it within a minute (a retry) records nothing twice.")
@click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")
@click.pass_obj
def signal(settings: Settings, args: tuple[str, ...], payload: str | None,
           workflow: str | None, run_id: str | None, input_json: str | None,
           queue: str | None, priority: int | None, request_id: str | None,
           as_json: bool) -> None:
    """Send signal NAME to run RUN (with --payload). The run takes it with
    ctx.wait_for_signal(NAME) or ctx.signals(NAME); sent before it asks, it waits for it.
    A finished run refuses it (exit 1).

    With --start WORKFLOW --id RUN [--input ...]: start the run if no run has that id and
    deliver the signal, in one step (a run that exists just gets the signal)."""
    raw = b"null" if payload is None else json_argument(payload, "payload", max_payload())
    if workflow is None:
        if len(args) != 2:
            raise click.UsageError("expected RUN NAME (or --start WORKFLOW --id RUN NAME)")
        if run_id is not None or input_json is not None or queue is not None or (
                priority is not None):
            raise click.UsageError("--id, --input, --queue and --priority go with --start")
        run, name = args
        check_id(run, "run id")
        sent = Client(settings).signal(run, name, payload_json=raw, request_id=request_id)
        if as_json:
            click.echo(json.dumps(sent.to_json(), indent=2))
            return
        tail = ("; run woken" + ("" if sent.dispatched else
                                 " (the controller will dispatch it)") if sent.woken
                else "; the run takes it when it asks")
        click.echo(safe(f"run {run}: signal {name} #{sent.seq} recorded{tail}"))
        return
    if len(args) != 1:
        raise click.UsageError("with --start, give only NAME as an argument")
    if run_id is None:
        raise click.UsageError("--start needs --id RUN (the id makes the start idempotent)")
    name = args[0]
    started = Client(settings).signal_with_start(
        workflow, id=run_id, signal=(name, None), payload_json=raw, queue=queue,
        priority=priority, input_json=None if input_json is None else json_argument(
            input_json, "input", max_payload()), request_id=request_id, how="give --input")
    if as_json:
        click.echo(json.dumps(started.to_json(), indent=2))
        return
    if started.created:
        what = (f"run {started.run_id} queued ({started.record.name}) with signal {name} "
                f"#{started.seq}" + ("" if started.dispatched else
                                     "; the controller will dispatch it"))
    else:
        what = (f"run {started.run_id} exists already ({started.record.name}, "
                f"{started.status}); signal {name} #{started.seq} recorded"
                + ("; run woken" if started.woken else ""))
    click.echo(safe(what))
