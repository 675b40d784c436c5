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
from ..engine.output_lines import format_event
from ..engine.runs import STATUSES, TERMINAL, OutputEvent, RunStore, RunView
from ..terminal import safe
from . import render
from .bulk_ops import filter_options, one_or_many, pop_criteria, run_bulk_command


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
@click.option("--start-at", "start_at", default=None, metavar="WHEN",
              help="Start no earlier than WHEN: ISO 8601 with a zone (2026-12-24T18:00:00Z) "
                   "or +N s|m|h|d from now (+90s, +2h). Recorded now; the controller "
                   "enqueues it then.")
@click.option("--wait", is_flag=True, help="Follow the run's output until it finishes; exit "
              "like `watch`.")
@click.option("--json", "as_json", is_flag=True, help="Print the run as JSON.")
@click.pass_obj
def enqueue(settings: Settings, name: str, input_json: str | None, batch: str | None,
            run_id: str | None, queue: str | None, priority: int | None,
            start_at: str | None, wait: bool, as_json: bool) -> None:
    """Record a run of workflow NAME, then enqueue it (or one run per line of --batch).
    A workflow with a debounce, throttle or singleton prints what the enqueue did; dropped
    exits 4, skipped exits 5."""
    if batch is not None:
        if (input_json is not None or run_id is not None or wait or priority is not None
                or start_at is not None):
            raise click.UsageError("--batch takes no --input, --id, --priority, --start-at or "
                                   "--wait (each line carries its input and, optionally, its id; "
                                   "runs take the workflow's priority)")
        from .bulk import run_batch

        run_batch(settings, name, batch, queue, as_json)
        return
    # Imported here: starting a run brings in RQ, which this module's other commands never
    # need.
    from ..client.sync import Client, parse_start_at
    from ..engine.ops import max_payload

    client = Client(settings)
    when = None if start_at is None else parse_start_at(start_at)
    limit = max_payload()  # a bad MARBLES_MAX_PAYLOAD is refused whatever the input
    raw = None if input_json is None else json_argument(input_json, "input", limit)
    # Every input error before touching Redis (but a workflow known only from its workers'
    # declarations is looked up there).
    record = client.prepare(name, input_json=raw, id=run_id, queue=queue, priority=priority,
                            start_at=when, how="give --input")
    gated = client._gated(name)
    if gated is not None:
        _enqueue_gated(settings, client, client._start_gated(
            gated, record, given_id=run_id is not None, start_at=when is not None), wait,
            as_json)
        return
    run = client.start_record(record)
    if as_json:
        click.echo(json.dumps({"created": run.created, **client.status_json(run.id)},
                              indent=2))
    elif run.created:
        _echo(f"run {run.id} queued ({run.workflow} on {run.queue})"
              + (f"; it starts at {_iso(record.not_before_ms)}" if record.not_before_ms else
                 "" if run.dispatched else "; the controller will dispatch it"))
    else:
        _echo(f"run {run.id} exists already ({run.workflow}, {run.initial_status}); not "
              f"enqueued again")
    if wait:
        sys.exit(_follow(settings.runs(), run.id))


def _enqueue_gated(settings: Settings, client: Any, run: Any, wait: bool,
                   as_json: bool) -> None:
    """What a debounce, throttle or singleton decided (flow/gate_specs.py): printed, in
    --json under "decision"; dropped and skipped exit 4 and 5 (cli/exits.py)."""
    from .exits import EXIT_DROPPED, EXIT_SKIPPED

    decision = run.decision
    if as_json:
        data: dict[str, Any] = {"created": bool(run.created), "decision": decision.to_json()}
        if decision.outcome != "dropped":
            data.update(client.status_json(run.id))
            data["created"] = bool(run.created)
        click.echo(json.dumps(data, indent=2))
    else:
        _echo(decision.message())
    if decision.outcome == "dropped":
        sys.exit(EXIT_DROPPED)
    if decision.outcome == "skipped":
        sys.exit(EXIT_SKIPPED)
    if wait:
        sys.exit(_follow(settings.runs(), run.id))


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


def read_input(name: str, input_json: str | None) -> bytes:
    """--input as bytes: JSON text, @FILE read up to the payload limit, or for an omitted
    one what the workflow takes without input (see ops.omitted_input)."""
    from ..engine.ops import max_payload, omitted_input

    limit = max_payload()  # a bad MARBLES_MAX_PAYLOAD is refused whatever the input
    if input_json is None:
        return omitted_input(name)
    return json_argument(input_json, "input", limit)


def json_argument(text: str, noun: str, limit: int) -> bytes:
    """A JSON option's bytes: the text itself, or @FILE read up to `limit` bytes."""
    from ..engine.ops import MAX_PAYLOAD_ENV, PayloadTooLargeError

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
    from ..client import Client

    data = Client(settings).status_json(run_id)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    if render.on_terminal():
        _status_table(data)
        return
    for line in _status_lines(data):
        _echo(line)


def _status_lines(data: dict[str, Any], *, head: bool = True,
                  steps: bool = True) -> list[str]:
    """The plain form of `status` (piped output; tests and scripts read it)."""
    out: list[str] = []
    if head:
        out.append(f"run {data['id']}  {data['name']}  {data['status']}  attempt "
                   f"{data['attempt']}" + _resumed(data["resumptions"]))
        out.append(f"  queue {data['queue']}  lane {data['lane']}  created "
                   f"{data['created_at']}  started {data['started_at'] or '-'}  finished "
                   f"{data['finished_at'] or '-'}")
        if data.get("version"):
            out.append(f"  version {data['version']}")
    if data["priority"] or data["concurrency"]:
        limit = data["concurrency"]
        out.append(f"  priority {data['priority']}" + ("" if not limit else
                   f"  at most {limit['limit']} at once ({limit['key'] or data['name']})"))
    if data["tags"]:
        out.append("  tags " + " ".join(f"{k}={v}" for k, v in sorted(data["tags"].items())))
    if data["start_at"] and data["status"] == "queued":
        out.append(f"  starts at {data['start_at']}")
    if data["worker"] and data["status"] == "running":
        out.append(f"  worker {data['worker']}")
    if data["cancel_requested"] and data["status"] not in TERMINAL:
        out.append("  cancel requested")
    if data["note"] and data["status"] not in TERMINAL:
        out.append(f"  {data['note']}")
    if data["waiting"]:
        out.append(f"  waiting: {_waiting(data['waiting'])}")
    if data["pause_requested"]:
        out.append("  pause requested: it parks at its next step boundary")
    if data.get("batch"):
        b = data["batch"]
        out.append(f"  batch of {b['events']} event{'' if b['events'] == 1 else 's'} from "
                   f"trigger {b['trigger']}" + (f" (key {b['key']})" if b["key"] else "")
                   + f", sealed by {b['sealed_by']} at {b['sealed_at']}")
    if data["parent"]:
        out.append(f"  parent {data['parent']}")
    if data.get("sessions"):  # marbles_rq/sessions/: the sessions it opened
        out.append(f"  sessions: {', '.join(data['sessions'])}")
    if data["rerun_of"]:
        out.append(f"  rerun of {data['rerun_of']} "
                   + (f"from step {data['rerun_from_step']}" if data["rerun_from_step"] else
                      "from the top"))
    for child in data["children"]:
        out.append(f"  child {child['id']} ({child['workflow']})")
    for q in data["questions"]:
        answer = "" if q["answer"] is None else f" -> {json.dumps(q['answer'])}"
        out.append(f"  question {q['key']}  {q['state']}{answer}  {q['title']}")
    for timer in data["timers"]:
        fired = f"  fired {timer['fired_at']}" if timer.get("fired_at") else ""
        out.append(f"  timer {timer['path']}#{timer['position']}  due {timer['due_at']}{fired}")
    for patch in data.get("patches", []):
        out.append(f"  patch {patch['id']}  {'new' if patch['new'] else 'old'} branch  "
                   f"(at {patch['path']})")
    if data.get("phase") == "compensating":
        out.append("  compensating: its undos run, then it ends")
    for c in data.get("compensations", []):
        out.append(f"  compensation {c['name']}  {c['status']}"
                   + (f"  {c['at']}" if c.get("at") else "")
                   + (f"  {c['error']}" if c.get("error") else ""))
    if steps:
        for s in data["steps"]:
            out.append(f"  step {s['path']}#{s['position']}  {s['status']}  attempts "
                       f"{s['attempts']}")
    if data["result"] is not None:
        out.append(f"  result {json.dumps(data['result'])}")
    if data["error"] is not None:
        out.append(f"  error {data['error']['type']}: {data['error']['message']}")
    for r in data["reports"]:
        out.append(f"  {r['kind']} {r['key']}  {json.dumps(r['entry'])[:200]}")
    for name, c in data.get("signals", {}).items():
        out.append(f"  signal {name}  sent {c['sent']}  taken {c['taken']}  buffered "
                   f"{c['buffered']}")
    return out


def _status_table(data: dict[str, Any]) -> None:
    """`status` on a terminal: the run's facts as a two-column table, its steps as a table,
    the rest as the plain lines, and for each open question the command that answers it."""
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    facts: list[tuple[str, Any]] = [
        ("run", render.cell(data["id"])), ("workflow", render.cell(data["name"])),
        ("version", render.cell(data.get("version") or "-")),
        ("status", render.status_cell(data["status"])),
        ("attempt", render.cell(f"{data['attempt']}" + _resumed(data["resumptions"]))),
        ("queue", render.cell(f"{data['queue']} (lane {data['lane']})")),
        ("created", render.cell(render.when(data["created_at"]))),
        ("started", render.cell(render.when(data["started_at"]))),
        ("finished", render.cell(render.when(data["finished_at"]))),
        ("duration", render.cell(render.took(data["started_at"], data["finished_at"]))),
    ]
    for name, value in facts:
        grid.add_row(name, value)
    out = render.console()
    out.print(grid)
    for line in _status_lines(data, head=False, steps=False):
        out.print(safe(line), markup=False)
    if data["steps"]:
        out.print()
        render.table(["STEP", "STATUS", "ATTEMPTS"],
                     [[f"{s['path']}#{s['position']}", render.status_cell(s["status"]),
                       s["attempts"]] for s in data["steps"]])
    hints = [answer_hint(data["id"], q["key"], q.get("kind") or q.get("ask"), q.get("choices"))
             for q in data["questions"] if q["state"] == "open"]
    if hints:
        out.print()
        for hint in hints:
            out.print(safe(hint), markup=False)


def answer_hint(run_id: str, key: str, kind: str | None, choices: Any = None) -> str:
    """The command that answers an open question, to copy."""
    import shlex

    run, k = shlex.quote(run_id), shlex.quote(key)
    if kind == "approval":
        return f"answer it: marbles-rq approve {run} {k}   (or: marbles-rq reject {run} {k})"
    pick = ""
    if isinstance(choices, list) and choices:
        pick = "  (choices: " + ", ".join(f"{i}={c}" for i, c in enumerate(choices, 1)) + ")"
    return f"answer it: marbles-rq answer {run} {k} VALUE{pick}"


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
    for wanted in what.get("events") or []:
        parts.append("event " + wanted.get("source", "?")
                     + (f"/{wanted['type']}" if wanted.get("type") else "")
                     + "".join(f" {k}={json.dumps(v)}" for k, v in
                               (wanted.get("match") or {}).items()))
    if what.get("signals"):
        parts.append("signal " + ", ".join(what["signals"]))
    held = what.get("rate_limit")
    if isinstance(held, dict):
        turn = int(held.get("turn_ms") or 0)
        parts.append(f"limit {held.get('limit')}, place {int(held.get('position') or 0) + 1} "
                     f"of {held.get('queued')}, turn about "
                     + time.strftime("%H:%M:%S", time.gmtime(turn / 1000)) + f".{turn % 1000:03d}Z")
    waits_lock = what.get("lock")
    if isinstance(waits_lock, dict):
        parts.append(_lock_wait(waits_lock))
    if waiting.get("reason") in ("retry", "failed_step") or what.get("max_attempts"):
        parts.append(_step_wait(what))
    elif what.get("until_ms"):
        at = what["until_ms"]
        parts.append("until " + time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at / 1000))
                     + f".{at % 1000:03d}Z")
    return "; ".join(parts) + f" (since {waiting.get('since')})"


def _lock_wait(d: dict[str, Any]) -> str:
    """A wait for a lock (flow/locks.py): its place in the queue, and who holds it."""
    holder = f", held by {d['holder']}" if d.get("holder") else ""
    return (f"lock {d.get('name')}, place {int(d.get('position') or 0) + 1} of "
            f"{d.get('queued')}{holder}")


def _run_wait(waiting: dict[str, Any] | None) -> str:
    """A `runs` row's note of a wait for a step's retry, or for a person to act on a failed
    step ("" for any other)."""
    if not waiting or waiting.get("reason") not in ("retry", "failed_step"):
        return ""
    what = waiting.get("for") or {}
    return _step_wait(what) if what.get("step") else ""


def _step_wait(what: dict[str, Any]) -> str:
    """`step charge#0: attempt 3 of 10, next at 12:00:05.250Z, last error ValueError: ...`
    (a retry's wait: the next try's number and time), or the tries of a step that ran out
    of them and what to do."""
    step = str(what.get("step") or "?").rsplit(".", 1)[-1]
    if "next_at_ms" in what:
        at = int(what["next_at_ms"])
        return (f"step {step}: attempt {int(what.get('attempt') or 0) + 1} of "
                f"{what.get('max_attempts')}, next at "
                f"{time.strftime('%H:%M:%S', time.gmtime(at / 1000))}"
                f".{at % 1000:03d}Z, last error {what.get('error')}")
    patched = "".join(f", patched {json.dumps(p)}" for p in what.get("patches") or [])
    return (f"step {step}: {what.get('attempts')} of {what.get('max_attempts')} attempts "
            f"failed, last error {what.get('error')}{patched} (marbles-rq retry / fail)")


@click.command("runs")
@click.option("--status", "status_", type=click.Choice(STATUSES), default=None)
@click.option("--name", "--workflow", "name", default=None, help="Only runs of this workflow.")
@click.option("--queue", default=None, help="Only runs on this queue.")
@click.option("--since", default=None, metavar="WHEN", help="Only runs created at or after "
              "WHEN (ISO 8601 with a zone, or a time ago: 90s, 2h, 7d).")
@click.option("--until", default=None, metavar="WHEN", help="Only runs created at or before "
              "WHEN (as --since).")
@click.option("--tag", "tags", multiple=True, metavar="KEY=VALUE",
              help="Only runs carrying this tag (repeat: every one).")
@click.option("--cursor", default=None, help="Start after this cursor (the previous page "
              "prints it: 'next page: --cursor ...').")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.pass_obj
def runs_cmd(settings: Settings, status_: str | None, name: str | None, queue: str | None,
             since: str | None, until: str | None, tags: tuple[str, ...],
             cursor: str | None, limit: int, as_json: bool) -> None:
    """List runs, newest first, a page at a time (the next page's cursor goes to stderr)."""
    from ..client import Client
    from .bulk_ops import parse_when

    client = Client(settings)
    page = client.runs(status=status_, workflow=name, queue=queue,
                       since=parse_when(since, "since"), until=parse_when(until, "until"),
                       tag=list(tags), limit=limit, cursor=cursor)
    if as_json:
        views = client.reader.views([r.id for r in page.runs])
        click.echo(json.dumps([v.to_json() for v in views], indent=2))
    elif not page.runs:
        render.none_match("no runs match")
    elif render.on_terminal():
        render.table(["RUN", "WORKFLOW", "STATUS", "ATTEMPT", "CREATED", "DURATION", "VERSION",
                      "TAGS"],
                     [[r.id, r.name, render.status_cell(r.status),
                       f"{r.attempt}" + (f" (resumed {r.resumptions})" if r.resumptions
                                         else ""),
                       render.when(_iso(r.created_ms)),
                       render.took(None if r.started_ms is None else _iso(r.started_ms),
                                   None if r.finished_ms is None else _iso(r.finished_ms)),
                       r.version or "-",
                       " ".join(f"{k}={v}" for k, v in sorted(r.tags.items()))]
                      for r in page.runs])
    else:
        for r in page.runs:
            tag_text = " ".join(f"{k}={v}" for k, v in sorted(r.tags.items()))
            _echo(f"{r.id:34} {r.name:16} {r.status:10} a{r.attempt:<3} r{r.resumptions:<3} "
                  f"{_iso(r.created_ms)}" + (f"  {tag_text}" if tag_text else "")
                  + (f"  {note}" if (note := _run_wait(r.waiting)) else ""))
    if page.cursor is not None:
        click.echo(f"next page: --cursor {page.cursor}"
                   + ("" if page.complete else " (this page stopped at its scan budget)"),
                   err=True)


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
@click.argument("run_id", required=False)
@filter_options
@click.option("--json", "as_json", is_flag=True, help="With a filter: print the summary as "
              "JSON.")
@click.option("--compensate", is_flag=True, help="First run the undos its steps registered "
              "(in a delivery of their own, the last registered first), then end it "
              "cancelled. One RUN_ID only.")
@click.pass_obj
def cancel(settings: Settings, /, run_id: str | None, as_json: bool, compensate: bool,
           **kwargs: Any) -> None:
    """Cancel a run: a queued or waiting run never starts again; a running one stops at its
    next step boundary (its horse is stopped) and never resumes. Its child runs are
    cancelled with it. With --compensate, the run's registered undos run before it ends
    cancelled (docs/how-to/compensation.md). With a filter instead of RUN_ID (`cancel
    --status queued --workflow report`), every run it selects, in batches (see --dry-run,
    --yes)."""
    from ..client import Client

    criteria = pop_criteria(kwargs)
    if one_or_many(run_id, criteria):
        if compensate:
            raise click.UsageError("--compensate takes one RUN_ID, not a filter")
        run_bulk_command(settings, "cancel", criteria, as_json=as_json)
        return
    assert run_id is not None
    done = Client(settings).cancel(run_id, compensate=compensate)
    _echo(done.message)
    if done.children:
        _echo(f"cancelled {len(done.children)} child runs: {', '.join(done.children[:10])}"
              + (" ..." if len(done.children) > 10 else ""))


def _get(runs: RunStore, run_id: str) -> RunView:
    view = runs.get(run_id)
    if view is None:
        raise RunNotFoundError(f"no run with id {run_id!r} (finished runs are pruned once "
                               f"their retention ends, 7 days unless the workflow sets "
                               f"retention_s)")
    return view


OUTPUT_PAGE = 1000  # output entries read per call


def _park_hints(runs: RunStore, run_id: str, keys: list[str]) -> None:
    """The run parked on questions: how to answer each one still open, on stderr (stdout
    stays the run's output)."""
    from ..engine.waits import WaitStore

    for q in WaitStore(runs).questions(run_id):
        if q.key in keys and q.state == "open":
            click.echo(safe(answer_hint(run_id, q.key, q.record.ask, q.record.choices)),
                       err=True)


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
                if ev.type == "parked" and ev.data.get("reason") == "question":
                    _park_hints(runs, run_id, ev.data.get("questions") or [])
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
