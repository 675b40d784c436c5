"""Commands about the controller and what it keeps: leader, roll, list."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
import msgspec
import redis

from ..controller.loop import LEASE_NAME
from ..deployment import Settings
from ..terminal import safe
from . import render


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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with each "
              "workflow's input as a JSON Schema).")
@click.pass_obj
def list_cmd(settings: Settings, as_json: bool) -> None:
    """What --source declares: workflows (version, queue, timeout, retention, input), schedules
    (cadence, next due, paused) and monitors (kind, interval, next due). Needs no Redis for
    the declarations; when Redis answers, schedules and monitors show their state too."""
    from ..engine.authoring import REGISTRY
    from ..triggers.monitors import MONITORS
    from ..triggers.schedules import SCHEDULES

    settings.load_source()
    workflows = []
    prose = {}
    served = REGISTRY.versions
    for name, wf in sorted(REGISTRY.workflows.items()):
        schema: Any = None
        if wf.input_type is not None:
            schema = msgspec.json.schema(wf.input_type)
        others = sorted(v for v in served.get(name, {}) if v != wf.version)
        workflows.append({"name": name, "version": wf.version,
                          "versions": sorted([wf.version, *others]),
                          "queue": wf.queue, "timeout_s": wf.timeout_s,
                          "max_deliveries": wf.max_deliveries, "retention_s": wf.retention_s,
                          "input_schema": schema, "priority": wf.priority,
                          "concurrency": None if not wf.concurrency else {
                              "limit": wf.concurrency, "key": wf.concurrency_key},
                          **_flow_json(wf)})
        prose[name] = f"  {name}: {_workflow_prose(wf)}\n    version {wf.version}" + (
            f" (new runs start on it); also serves {', '.join(others)}" if others else "")
    state, unreachable = _trigger_state(settings, SCHEDULES, MONITORS)
    monitors = [state["monitors"].get(key) or {
        "key": key, "kind": m.kind, "source": m.source, "interval_s": m.interval_s,
        "next_due": None, "last_poll": None, "last_change": None, "last_error": None,
        "pending_run": None} for key, m in sorted(MONITORS.by_key.items())]
    schedules = [state["schedules"].get(key) or {
        "key": key, "workflow": d.workflow, "kind": d.kind, "cadence": d.label,
        "status": None, "paused": None, "next_due": None}
        for key, d in sorted(SCHEDULES.schedules.items())]
    data: dict[str, Any] = {"workflows": workflows, "schedules": schedules,
                            "monitors": monitors}
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo("workflows:" if workflows else "workflows: none (is --source set?)")
    for wf_data in workflows:
        for line in prose[wf_data["name"]].splitlines():
            click.echo(safe(line))
    click.echo("schedules:" if schedules else "schedules: none")
    for sch in schedules:
        status = "" if sch["status"] is None else f", {sch['status']}"
        due = "" if sch["next_due"] is None else f", next due {sch['next_due']}"
        click.echo(safe(f"  {sch['key']}: {sch['cadence']} -> {sch['workflow']}{status}{due}"))
    click.echo("monitors:" if monitors else "monitors: none")
    for mon in monitors:
        due = "" if mon.get("next_due") is None else f", next due {mon['next_due']}"
        click.echo(safe(f"  {mon['key']}: {mon['kind']} {mon.get('source') or ''}, every "
                        f"{render.seconds(mon['interval_s'])}{due}"))
    if unreachable and (schedules or monitors):
        click.echo(safe(f"(Redis not reachable: {unreachable}; schedules and monitors are "
                        f"shown as declared, without their state)"), err=True)


def _trigger_state(settings: Settings, schedules_reg: Any,
                   monitors_reg: Any) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The declared schedules' and monitors' state in Redis, by key, and why it could not
    be read (None: it was)."""
    from ..errors import RedisUnavailableError
    from ..triggers.monitors import list_monitors
    from ..triggers.schedules import list_schedules

    state: dict[str, dict[str, Any]] = {"schedules": {}, "monitors": {}}
    if not schedules_reg.schedules and not monitors_reg.by_key:
        return state, None  # nothing whose state lives in Redis: no connection at all
    try:
        if monitors_reg.by_key:
            for m in list_monitors(settings.reader(), monitors_reg):
                state["monitors"][m.key] = m.to_json()
        if schedules_reg.schedules:
            for v in list_schedules(settings.runs(read_only=True), schedules_reg):
                state["schedules"][v.key] = {
                    "key": v.key, "workflow": v.workflow, "kind": v.kind, "cadence": v.label,
                    "status": v.status, "paused": v.status == "paused",
                    "next_due": _iso(v.next_due)}
    except (RedisUnavailableError, redis.ConnectionError, redis.TimeoutError) as exc:
        return {"schedules": {}, "monitors": {}}, str(exc).splitlines()[0].rstrip(".")
    return state, None


def _workflow_prose(wf: Any) -> str:
    """`queue default, timeout 10 min, kept 7 d, input: email: str, plan: str = 'free'`."""
    parts = [f"queue {wf.queue}",
             f"timeout {render.seconds(wf.timeout_s)}" if wf.timeout_s else "no timeout",
             f"kept {render.seconds(wf.retention_s)}"]
    if wf.concurrency:
        parts.append(f"at most {wf.concurrency} at once"
                     + (f" per {wf.concurrency_key}" if wf.concurrency_key else ""))
    if wf.priority:
        parts.append(f"priority {wf.priority}")
    if wf.max_deliveries != DEFAULT_DELIVERIES:
        parts.append(f"at most {wf.max_deliveries} deliveries")
    flow = _flow_json(wf)
    if flow["rate_limit"]:
        parts.append(f"rate limit {flow['rate_limit']['rate']}"
                     + (f" per {flow['rate_limit']['key']}" if flow["rate_limit"]["key"] else ""))
    if wf.gate is not None:
        parts.append(wf.gate.describe())
    if flow["retry"]:
        parts.append(f"steps retried up to {flow['retry']['max_attempts']} tries")
    if wf.on_exhausted == "pause":
        parts.append("a step out of tries pauses the run")
    return ", ".join(parts) + ", " + _input_prose(wf)


def _flow_json(wf: Any) -> dict[str, Any]:
    """What `list --json` says of a workflow's flow control and failure policy: its rate
    limit, enqueue gate (debounce, throttle, singleton), default retry policy and
    on_exhausted (None where it declares none)."""
    key = wf.rate_key if isinstance(wf.rate_key, str) else (
        "<function>" if wf.rate_key is not None else None)
    retry = wf.retry
    return {
        "rate_limit": None if wf.rate_limit is None else {
            "rate": wf.rate_limit.spec(), "key": key},
        "gate": None if wf.gate is None else {"text": wf.gate.describe(),
                                              **wf.gate.to_json()},
        "retry": None if retry is None else {
            "initial_s": retry.initial_s, "backoff": retry.backoff,
            "max_interval_s": retry.max_interval_s, "max_attempts": retry.max_attempts,
            "non_retryable": [t.__name__ for t in retry.non_retryable],
            "jitter": retry.jitter},
        "on_exhausted": wf.on_exhausted}


def _input_prose(wf: Any) -> str:
    if wf.input_param is None:
        return "no input"
    tp = wf.input_type
    fields = _fields_of(tp)
    if fields is None:
        return f"input: {_type_name(tp)}"
    if not fields:
        return "input: {}"
    return "input: " + ", ".join(
        f"{name}: {_type_name(kind)}" + ("" if default is _REQUIRED else f" = {default!r}")
        for name, kind, default in fields)


_REQUIRED = object()
DEFAULT_DELIVERIES = 20  # @mr.workflow's default max_deliveries: not worth a mention


def _fields_of(tp: Any) -> list[tuple[str, Any, Any]] | None:
    """(name, type, default or _REQUIRED) of a Struct's or dataclass's fields; None for
    another type."""
    import dataclasses
    import typing

    try:
        hints = typing.get_type_hints(tp)
    except Exception:
        hints = {}
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        out = []
        for f in msgspec.structs.fields(tp):
            if f.default is not msgspec.NODEFAULT:
                default: Any = f.default
            elif f.default_factory is not msgspec.NODEFAULT:
                default = f.default_factory()
            else:
                default = _REQUIRED
            out.append((f.encode_name, hints.get(f.name, f.type), default))
        return out
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return [(f.name, hints.get(f.name, f.type),
                 f.default if f.default is not dataclasses.MISSING else
                 f.default_factory() if f.default_factory is not dataclasses.MISSING
                 else _REQUIRED) for f in dataclasses.fields(tp)]
    return None


def _type_name(tp: Any) -> str:
    """`str`, `list[Order]`, `Options | None`: a type as its annotation reads."""
    import types
    import typing

    if tp is type(None):
        return "None"
    if tp is typing.Any:
        return "any"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    return getattr(tp, "__name__", str(tp))
