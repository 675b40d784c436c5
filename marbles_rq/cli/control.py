"""Commands about the controller and what it keeps: leader, roll, list."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
import msgspec

from ..controller.loop import LEASE_NAME
from ..deployment import Settings
from ..terminal import safe


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print {holder, epoch, since} (null when "
              "nobody leads).")
@click.pass_obj
def leader(settings: Settings, as_json: bool) -> None:
    """Show the controller that leads now: its host and pid, its epoch, since when; with
    several lanes, each lane's. Exit 1 when nobody leads (a lane, with several)."""
    if settings.keys.lanes > 1:
        _lane_leaders(settings, as_json)
        return
    info = settings.reader().lease_holder(LEASE_NAME)
    if info is None:
        click.echo("null" if as_json else "no controller leads")
        sys.exit(1)
    host, _, rest = info.token.partition(":")
    pid = rest.partition(":")[0]
    data: dict[str, Any] = {"holder": f"{host}:{pid}", "epoch": info.epoch,
                            "since": _iso(info.since_ms), "token": info.token,
                            "lease_left_ms": info.ttl_ms}
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(safe(f"leader {data['holder']}  epoch {info.epoch}  since {data['since'] or '-'}"
                    f"  lease left {info.ttl_ms} ms"))


def _lane_leaders(settings: Settings, as_json: bool) -> None:
    from ..controller.share import lane_leaders

    leaders = lane_leaders(settings.reader())
    rows: list[dict[str, Any]] = [
        {"lane": ll.lane, "buckets": [ll.buckets.start, ll.buckets.stop - 1],
         "holder": ll.holder,
         **({} if ll.info is None else {
             "epoch": ll.info.epoch, "since": _iso(ll.info.since_ms),
             "token": ll.info.token, "lease_left_ms": ll.info.ttl_ms})}
        for ll in leaders]
    unled = [ll.lane for ll in leaders if ll.info is None]
    if as_json:
        click.echo(json.dumps({"lanes": rows, "unled": unled}, indent=2))
    else:
        for row in rows:
            where = f"lane {row['lane']:>3} (buckets {row['buckets'][0]}-{row['buckets'][1]})"
            if row["holder"] is None:
                click.echo(f"{where}  no controller leads")
            else:
                click.echo(safe(f"{where}  leader {row['holder']}  epoch {row['epoch']}  since "
                                f"{row['since'] or '-'}  lease left {row['lease_left_ms']} ms"))
    if unled:
        sys.exit(1)


@click.command()
@click.argument("name")
@click.option("--input", "input_json", default=None,
              help="The run's input as JSON (a workflow only).")
@click.option("--id", "run_id", default=None, help="Run id (a workflow only; default random).")
@click.pass_obj
def roll(settings: Settings, name: str, input_json: str | None, run_id: str | None) -> None:
    """Run NAME once, now: a workflow name enqueues a run (no lock taken); a schedule key
    runs one tick under that schedule's lock (`skipped: held by <holder>` when another
    holds it); a monitor key polls that monitor once."""
    from ..engine.authoring import REGISTRY, UnknownWorkflowError
    from ..triggers.monitors import MONITORS, roll_monitor
    from ..triggers.schedules import SCHEDULES, roll_schedule

    settings.load_source()
    trigger = name not in REGISTRY.workflows and (
        name in SCHEDULES.schedules or name in MONITORS.by_key)
    if trigger and (input_json is not None or run_id is not None):
        raise click.UsageError("--input and --id apply to a workflow, not a schedule or a "
                               "monitor")
    if trigger and name in SCHEDULES.schedules:
        click.echo(safe(str(roll_schedule(settings.runs(), settings.rq(), name))))
        return
    if trigger:
        outcome = roll_monitor(settings.runs(), settings.rq(), name)
        click.echo(safe(f"monitor {name}: {outcome.status}"
                        + (f" (run {outcome.run_id})" if outcome.run_id else "")
                        + (f": {outcome.detail}" if outcome.detail else "")))
        return
    if name not in REGISTRY.workflows:
        known = sorted([*REGISTRY.workflows, *SCHEDULES.schedules, *MONITORS.by_key])
        raise UnknownWorkflowError(f"no workflow, schedule or monitor named {name!r} (known: "
                                   f"{', '.join(known) or 'none; is --source set?'})")
    from ..client import Client
    from ..engine.ops import max_payload
    from .runs import json_argument

    client = Client(settings)
    limit = max_payload()  # a bad MARBLES_MAX_PAYLOAD is refused whatever the input
    raw = None if input_json is None else json_argument(input_json, "input", limit)
    run = client.start_record(client.prepare(name, input_json=raw, id=run_id,
                                             how="give --input"))  # input errors before Redis
    click.echo(f"run {run.id} queued ({run.workflow} on {run.queue})" if run.created else
               f"run {run.id} exists already ({run.initial_status}); not enqueued again")


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_obj
def list_cmd(settings: Settings, as_json: bool) -> None:
    """What --source declares: workflows (queue, timeout, retention, input schema),
    schedules (cadence, next due, paused) and monitors (kind, interval, next due)."""
    from ..engine.authoring import REGISTRY

    settings.load_source()
    workflows = []
    for name, wf in sorted(REGISTRY.workflows.items()):
        schema: Any = None
        if wf.input_type is not None:
            schema = msgspec.json.schema(wf.input_type)
        workflows.append({"name": name, "queue": wf.queue, "timeout_s": wf.timeout_s,
                          "max_deliveries": wf.max_deliveries, "retention_s": wf.retention_s,
                          "input_schema": schema, "priority": wf.priority,
                          "concurrency": None if not wf.concurrency else {
                              "limit": wf.concurrency, "key": wf.concurrency_key}})
    from ..triggers.monitors import MONITORS, list_monitors
    from ..triggers.schedules import SCHEDULES, list_schedules

    monitors = ([m.to_json() for m in list_monitors(settings.reader(), MONITORS)]
                if MONITORS.by_key else [])
    schedules = [{"key": v.key, "workflow": v.workflow, "kind": v.kind, "cadence": v.label,
                  "status": v.status, "paused": v.status == "paused",
                  "next_due": _iso(v.next_due)}
                 for v in (list_schedules(settings.runs(read_only=True), SCHEDULES)
                           if SCHEDULES.schedules else [])]
    data: dict[str, Any] = {"workflows": workflows, "schedules": schedules,
                            "monitors": monitors}
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo("workflows:" if workflows else "workflows: none (is --source set?)")
    for wf_data in workflows:
        takes = "no input" if wf_data["input_schema"] is None else "input " + json.dumps(
            wf_data["input_schema"], separators=(",", ":"))[:120]
        limits = (f"timeout {wf_data['timeout_s'] or '-'} s, kept {wf_data['retention_s']:g} s"
                  f" after it finishes")
        if (cc := wf_data["concurrency"]) is not None:
            limits += f", at most {cc['limit']} at once" + (
                f" per {cc['key']}" if cc["key"] else "")
        if wf_data["priority"]:
            limits += f", priority {wf_data['priority']}"
        click.echo(safe(f"  {wf_data['name']:24} queue {wf_data['queue']:12} {limits}; "
                        f"{takes}"))
    click.echo("schedules:" if schedules else "schedules: none")
    for sch in schedules:
        click.echo(safe(f"  {sch['key']:24} {sch['cadence']:24} {sch['status']:8} next due "
                        f"{sch['next_due'] or '-'}"))
    click.echo("monitors:" if monitors else "monitors: none")
    for mon in monitors:
        click.echo(safe(f"  {mon['key']:24} {mon['kind']:5} every {mon['interval_s']} s  "
                        f"next due {mon.get('next_due') or '-'}"))
