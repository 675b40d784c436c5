"""`marbles-rq run NAME [--input JSON] [--dry-run]`: without --dry-run, enqueue and follow
(as `enqueue --wait`); with it, execute here on memory (engine/dryrun.py), asking questions
on the terminal, and print the output and the result. A dry run opens no connection."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ..deployment import Settings
from ..engine.waits import Question, match_choice
from ..terminal import safe


@click.command("run")
@click.argument("name")
@click.option("--input", "input_json", default=None,
              help="The run's input as JSON; @FILE reads it from a file. Omitted: none, or "
                   "{} when every field of the workflow's input has a default.")
@click.option("--dry-run", is_flag=True, help="Execute in this process on memory: nothing "
              "is written to Redis. Questions are asked on the terminal (without one, the "
              "run is cancelled at its first question); timers do not wait.")
@click.option("--id", "run_id", default=None, help="Run id (default random).")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the finished "
              "run (as `status --json`, plus its output events) instead of text.")
@click.pass_context
def run_cmd(ctx: click.Context, name: str, input_json: str | None, dry_run: bool,
            run_id: str | None, as_json: bool) -> None:
    """Run workflow NAME now: enqueue it and follow it to the end, or with --dry-run execute
    it here without Redis. Exit 0 if it succeeded, 1 if it failed or was cancelled."""
    settings: Settings = ctx.obj
    if not dry_run:
        from .runs import enqueue

        ctx.invoke(enqueue, name=name, input_json=input_json, batch=None, run_id=run_id,
                   queue=None, wait=True, as_json=False)
        return
    from ..engine.dryrun import dry_run as execute_dry
    from ..engine.output_lines import format_event
    from .runs import read_input

    settings.load_source()
    raw = read_input(name, input_json)
    interactive = sys.stdin.isatty()

    root: list[str] = []  # the run asked for: the first to say anything (children after it)

    def on_event(rid: str, ev: Any) -> None:
        if not root:
            root.append(rid)
        if not as_json:
            prefix = "" if rid == root[0] else f"[{rid}] "
            click.echo(safe(prefix + format_event(ev)))

    def on_note(text: str) -> None:
        if not as_json:
            click.echo(safe(f"dry run: {text}"))

    done = execute_dry(name, raw, answer=_ask if interactive else None, on_event=on_event,
                       on_note=on_note, run_id=run_id)
    view = done.view
    if as_json:
        data = view.to_json()
        data["dry_run"] = True
        data["output"] = [{"type": e.type, "delivery": e.attempt, "data": e.data}
                          for e in done.runs.runs[view.record.id].output]
        click.echo(json.dumps(data, indent=2))
    else:
        if view.result is not None:
            click.echo(json.dumps(json.loads(bytes(view.result)), indent=2))
        click.echo(safe(f"[run] {view.record.name} {view.status} {view.record.id} (dry run: "
                        f"nothing was written)"))
    sys.exit(0 if view.status == "succeeded" else 1)


def _ask(question: Question) -> Any:
    """Ask on the terminal; the answer as `answer`/`approve`/`reject` would record it."""
    record = question.record
    click.echo(safe(f"question {record.key}: {record.title}"), err=True)
    if record.body:
        click.echo(safe(f"  {record.body}"), err=True)
    if record.ask == "approval":
        approved = click.confirm("approve?", err=True)
        note = click.prompt("note (empty for none)", default="", show_default=False, err=True)
        return {"approved": approved, "note": note or None}
    choices = record.choices or []
    for i, choice in enumerate(choices, 1):
        click.echo(safe(f"  {i}) {choice}"), err=True)
    while True:
        value = click.prompt("answer", err=True)
        found = match_choice(choices, value)
        if found is not None:
            return found
        click.echo(f"one of 1 to {len(choices)}, or a choice's text", err=True)
