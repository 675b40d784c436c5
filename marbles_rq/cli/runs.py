"""Run commands: enqueue, status, runs, watch, cancel."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from ..deployment import Settings
from ..engine.authoring import InputError
from ..engine.execution import RunNotFoundError
from ..engine.ops import (
    MAX_PAYLOAD_ENV,
    PayloadTooLargeError,
    RunRequest,
    enqueue_record,
    max_payload,
    prepare,
)
from ..engine.output_lines import format_event
from ..engine.runs import STATUSES, TERMINAL, OutputEvent, RunStore, RunView
from ..terminal import safe


def _echo(line: str) -> None:
    """A line of text output: run data in it is escaped for the terminal (`--json` is not)."""
    click.echo(safe(line))


@click.command()
@click.argument("name")
@click.option("--input", "input_json", default=None,
              help="The run's input as JSON; @FILE reads it from a file. Omitted: none, or "
                   "{} when every field of the workflow's input has a default.")
@click.option("--batch", "batch", default=None, metavar="FILE.jsonl",
              help="Enqueue one run per line of FILE ('-' reads stdin): a line is the input, "
                   "or {\"id\": ..., \"input\": ...}; see the README, 'Bulk enqueue'.")
@click.option("--id", "run_id", default=None, help="Run id; the same id again returns the "
              "existing run. Default: a random id.")
@click.option("--queue", default=None, help="RQ queue (default: the workflow's).")
@click.option("--priority", type=int, default=None, help="-100 to 100; higher runs first "
              "within its queue (default: the workflow's, else 0).")
@click.option("--wait", is_flag=True, help="Follow the run's output until it finishes; exit "
              "like `watch`.")
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@click.pass_obj
def enqueue(settings: Settings, name: str, input_json: str | None, batch: str | None,
            run_id: str | None, queue: str | None, priority: int | None, wait: bool,
            as_json: bool) -> None:
    """Record a run of workflow NAME, then enqueue it (or one run per line of --batch)."""
    if batch is not None:
        if input_json is not None or run_id is not None or wait or priority is not None:
            raise click.UsageError("--batch takes no --input, --id, --priority or --wait "
                                   "(each line carries its input and, optionally, its id; "
                                   "runs take the workflow's priority)")
        from .bulk import run_batch

        run_batch(settings, name, batch, queue, as_json)
        return
    settings.load_source()
    raw = read_input(name, input_json)
    request = RunRequest(name, raw, run_id, queue, strict=True, priority=priority)
    record = prepare(request)  # every input error before touching Redis
    runs = settings.runs()
    result = enqueue_record(runs, settings.rq(), record)
    if as_json:
        view = runs.get(result.run_id)
        click.echo(json.dumps({"created": result.created, **_view_json(view)}, indent=2))
    elif result.created:
        _echo(f"run {result.run_id} queued ({result.record.name} on "
                   f"{result.record.queue})" + ("" if result.dispatched else
                                                "; the controller will dispatch it"))
    else:
        _echo(f"run {result.run_id} exists already ({result.record.name}, "
                   f"{result.status}); not enqueued again")
    if wait:
        sys.exit(_follow(runs, result.run_id))


def read_input(name: str, input_json: str | None) -> bytes:
    """--input as bytes: JSON text, @FILE read up to the payload limit, or for an omitted
    one what the workflow takes without input (see ops.omitted_input)."""
    from ..engine.ops import omitted_input

    limit = max_payload()  # a bad MARBLES_MAX_PAYLOAD is refused whatever the input
    if input_json is None:
        return omitted_input(name)
    return json_argument(input_json, "input", limit)


def json_argument(text: str, noun: str, limit: int) -> bytes:
    """A JSON option's bytes: the text itself, or @FILE read up to `limit` bytes."""
    if not text.startswith("@"):
        return text.encode()
    try:
        with open(text[1:], "rb") as fh:
            # One byte past the limit tells "too large" without reading the rest:
            # @/dev/zero or a huge file must not be read into memory whole.
            raw = fh.read(limit + 1)
    except OSError as exc:
        raise InputError(f"cannot read the {noun} file: {exc}") from None
    if len(raw) > limit:
        raise PayloadTooLargeError(f"the {noun} file is larger than the limit of {limit} "
                                   f"bytes (set {MAX_PAYLOAD_ENV} to change it)")
    return raw


@click.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@click.pass_obj
def status(settings: Settings, run_id: str, as_json: bool) -> None:
    """Show one run: status, attempt, timings, result or error, steps."""
    from ..engine.signals import signals_json
    from .waits import questions_json, reports_json

    runs = settings.runs(read_only=True)
    view = _get(runs, run_id)
    data = view.to_json()
    data["questions"] = questions_json(settings, run_id)
    data["reports"] = reports_json(settings, run_id)
    data["signals"] = signals_json(runs, run_id)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    _echo(f"run {data['id']}  {data['name']}  {data['status']}  attempt {data['attempt']}"
          + _resumed(data["resumptions"]))
    _echo(f"  queue {data['queue']}  lane {data['lane']}  created {data['created_at']}  started "
               f"{data['started_at'] or '-'}  finished {data['finished_at'] or '-'}")
    if data["priority"] or data["concurrency"]:
        limit = data["concurrency"]
        _echo(f"  priority {data['priority']}" + ("" if not limit else
              f"  at most {limit['limit']} at once ({limit['key'] or data['name']})"))
    if data["worker"] and data["status"] == "running":
        _echo(f"  worker {data['worker']}")
    if data["cancel_requested"] and data["status"] not in TERMINAL:
        _echo("  cancel requested")
    if data["note"] and data["status"] not in TERMINAL:
        _echo(f"  {data['note']}")
    if data["waiting"]:
        _echo(f"  waiting: {_waiting(data['waiting'])}")
    if data["pause_requested"]:
        _echo("  pause requested: it parks at its next step boundary")
    if data["parent"]:
        _echo(f"  parent {data['parent']}")
    if data["rerun_of"]:
        _echo(f"  rerun of {data['rerun_of']} "
              + (f"from step {data['rerun_from_step']}" if data["rerun_from_step"] else
                 "from the top"))
    for child in data["children"]:
        _echo(f"  child {child['id']} ({child['workflow']})")
    for q in data["questions"]:
        answer = "" if q["answer"] is None else f" -> {json.dumps(q['answer'])}"
        _echo(f"  question {q['key']}  {q['state']}{answer}  {q['title']}")
    for timer in data["timers"]:
        fired = f"  fired {timer['fired_at']}" if timer.get("fired_at") else ""
        _echo(f"  timer {timer['path']}#{timer['position']}  due {timer['due_at']}{fired}")
    for s in data["steps"]:
        _echo(f"  step {s['path']}#{s['position']}  {s['status']}  attempts {s['attempts']}")
    if data["result"] is not None:
        _echo(f"  result {json.dumps(data['result'])}")
    if data["error"] is not None:
        _echo(f"  error {data['error']['type']}: {data['error']['message']}")
    for r in data["reports"]:
        _echo(f"  {r['kind']} {r['key']}  {json.dumps(r['entry'])[:200]}")
    for name, c in data["signals"].items():
        _echo(f"  signal {name}  sent {c['sent']}  taken {c['taken']}  buffered {c['buffered']}")


def _resumed(resumptions: int) -> str:
    """How often a run was woken after a wait (not attempts: it did not fail)."""
    return "" if not resumptions else (
        f"  resumed {resumptions} time{'' if resumptions == 1 else 's'}")


def _waiting(waiting: dict[str, Any]) -> str:
    what = waiting.get("for") or {}
    parts = [waiting.get("reason") or "?"]
    if what.get("questions"):
        parts.append("questions " + ", ".join(what["questions"]))
    if what.get("children"):
        parts.append("children " + ", ".join(what["children"]))
    if what.get("signals"):
        parts.append("signal " + ", ".join(what["signals"]))
    if what.get("until_ms"):
        at = what["until_ms"]
        parts.append("until " + time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at / 1000))
                     + f".{at % 1000:03d}Z")
    return "; ".join(parts) + f" (since {waiting.get('since')})"


@click.command("runs")
@click.option("--status", "status_", type=click.Choice(STATUSES), default=None)
@click.option("--name", default=None, help="Only runs of this workflow.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.pass_obj
def runs_cmd(settings: Settings, status_: str | None, name: str | None, limit: int,
             as_json: bool) -> None:
    """List runs, newest first."""
    views = settings.runs(read_only=True).list_runs(limit=limit, status=status_, name=name)
    if as_json:
        click.echo(json.dumps([_view_json(v) for v in views], indent=2))
        return
    for v in views:
        data = v.to_json()
        _echo(f"{data['id']:34} {data['name']:16} {data['status']:10} a{data['attempt']:<3} "
              f"r{data['resumptions']:<3} {data['created_at']}")


@click.command()
@click.argument("run_id")
@click.option("--no-follow", is_flag=True, help="Print what is there and stop.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per output event "
              "(id, type, delivery, at, data), a line each.")
@click.pass_obj
def watch(settings: Settings, run_id: str, no_follow: bool, as_json: bool) -> None:
    """Print a run's output from the start and follow it. Exit 0 if it succeeded, 1 if it
    failed or was cancelled."""
    runs = settings.runs(read_only=True)
    _get(runs, run_id)
    sys.exit(_follow(runs, run_id, follow=not no_follow,
                     emit=_json_line if as_json else None))


def _json_line(ev: OutputEvent) -> None:
    at = ev.happened_ms  # the time the text shows
    click.echo(json.dumps({"id": ev.id, "type": ev.type, "delivery": ev.attempt,
                           "at": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at / 1000))
                           + f".{at % 1000:03d}Z", "data": ev.data}))


@click.command()
@click.argument("run_id")
@click.pass_obj
def cancel(settings: Settings, run_id: str) -> None:
    """Cancel a run: a queued or waiting run never starts again; a running one stops at its
    next step boundary (its horse is stopped) and never resumes. Its child runs are
    cancelled with it."""
    from ..engine.waits import WaitStore

    runs = settings.runs()
    outcome = runs.cancel(run_id)
    if outcome == "missing":
        raise RunNotFoundError(f"no run with id {run_id!r}")
    click.echo({"cancelled": f"run {run_id} cancelled",
                "requested": f"run {run_id} is running; cancel requested, it stops at its "
                             f"next step boundary",
                "settled": f"run {run_id} has already finished; nothing to cancel"}[outcome])
    if outcome != "settled":
        children = WaitStore(runs).cancel_children(run_id)
        if children:
            _echo(f"cancelled {len(children)} child runs: {', '.join(children[:10])}"
                  + (" ..." if len(children) > 10 else ""))


def _get(runs: RunStore, run_id: str) -> RunView:
    view = runs.get(run_id)
    if view is None:
        raise RunNotFoundError(f"no run with id {run_id!r} (finished runs are pruned once "
                               f"their retention ends, 7 days unless the workflow sets "
                               f"retention_s)")
    return view


def _view_json(view: RunView | None) -> dict[str, Any]:
    return {} if view is None else view.to_json()


OUTPUT_PAGE = 1000  # output entries read per call


def _follow(runs: RunStore, run_id: str, *, follow: bool = True,
            emit: Callable[[OutputEvent], None] | None = None) -> int:
    """Print the output journal; return the exit code of the run's final status."""
    after = "0-0"
    while True:
        events = runs.output(run_id, after=after, count=OUTPUT_PAGE,
                             block_ms=2000 if follow and after != "0-0" else None)
        for ev in events:
            if emit is not None:
                emit(ev)
            else:
                _echo(format_event(ev))
            after = ev.id
            if ev.type == "final":
                return 0 if ev.data.get("status") == "succeeded" else 1
        if not follow and len(events) >= OUTPUT_PAGE:
            continue  # a full page: there may be more already written
        if not follow:
            view = runs.get(run_id)
            return 0 if view is not None and view.status == "succeeded" else 1
        if not events and after == "0-0":
            time.sleep(0.2)
