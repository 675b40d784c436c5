"""Session commands: `sessions [--json]`, `sessions show ID [--json] [--follow]`,
`sessions append ID MESSAGE [--key K]`, `sessions delete ID`."""

from __future__ import annotations

import json
import time

import click

from ..deployment import Settings
from ..terminal import safe
from . import render


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the sessions as JSON.")
@click.option("--limit", type=click.IntRange(1, 100_000), default=None,
              help="At most this many (newest activity first).")
@click.pass_context
def sessions(ctx: click.Context, as_json: bool, limit: int | None) -> None:
    """List sessions (conversation transcripts), newest activity first: id, messages, last
    message at, the runs that own it. A session whose record cannot be decoded is skipped
    with a warning on stderr (and never overwritten)."""
    if ctx.invoked_subcommand is not None:
        return
    from ..sessions import SessionStore

    settings: Settings = ctx.obj
    listing = SessionStore(settings.runs(read_only=True)).listing(limit=limit)
    for key in listing.corrupt:
        click.echo(safe(f"warning: skipped session record {key}: it cannot be decoded "
                        f"(repair it, or delete it with 'sessions delete')"), err=True)
    if as_json:
        click.echo(json.dumps([s.to_json() for s in listing.sessions], indent=2))
        return
    if not listing.sessions:
        click.echo("no sessions")
        return
    rows = [[s.id, str(s.messages), _iso(s.last_ms), ",".join(s.owners) or
             ("(kept)" if s.kept else "-"), s.parent or "-"] for s in listing.sessions]
    if render.on_terminal():
        render.table(["SESSION", "MESSAGES", "LAST AT", "OWNERS", "PARENT"], rows)
        return
    for s in listing.sessions:
        owners = ",".join(s.owners) or ("kept" if s.kept else "-")
        parent = f"  parent {s.parent}" if s.parent else ""
        click.echo(safe(f"{s.id}  {s.messages} messages  {_iso(s.last_ms)}  owners "
                        f"{owners}{parent}"))


@sessions.command()
@click.argument("session_id")
@click.option("--json", "as_json", is_flag=True,
              help="Print the session and its messages as JSON (with --follow: one JSON "
                   "line per message).")
@click.option("--after", type=click.IntRange(0), default=0,
              help="Only the messages after this position.")
@click.option("--follow", is_flag=True, help="Then print each new message as it arrives.")
@click.pass_obj
def show(settings: Settings, session_id: str, as_json: bool, after: int,
         follow: bool) -> None:
    """Print a session's messages in order (position, time, JSON). Exit 2 when there is no
    such session or its record cannot be decoded."""
    from ..sessions import SessionStore

    store = SessionStore(settings.runs(read_only=True))
    info = store.info(session_id)
    if follow:
        if not as_json:
            click.echo(safe(f"session {info.id}  {info.messages} messages  (following; "
                            f"Ctrl-C stops)"))
        try:
            for m in store.follow(session_id, after=after):
                click.echo(json.dumps(m.to_json()) if as_json else
                           safe(f"#{m.position}  {_iso(m.at_ms)}  {json.dumps(m.data)}"))
        except KeyboardInterrupt:
            return
        return
    messages = store.read(session_id, after=after)
    if as_json:
        click.echo(json.dumps({**info.to_json(), "count": info.messages,
                               "messages": [m.to_json() for m in messages]}, indent=2))
        return
    owners = ",".join(info.owners) or ("kept until deleted" if info.kept else "-")
    click.echo(safe(f"session {info.id}  {info.messages} messages  owners {owners}"
                    + (f"  parent {info.parent}" if info.parent else "")))
    for m in messages:
        click.echo(safe(f"#{m.position}  {_iso(m.at_ms)}  {json.dumps(m.data)}"))


@sessions.command()
@click.argument("session_id")
@click.argument("message")
@click.option("--key", default=None,
              help="Idempotency key: a resend with it appends nothing and prints the first "
                   "append's position.")
@click.pass_obj
def append(settings: Settings, session_id: str, message: str, key: str | None) -> None:
    """Append MESSAGE (a JSON object) to session SESSION_ID, creating the session if it does
    not exist (a session created here is kept until deleted); print its position."""
    from ..sessions import SessionStore
    from ..sessions.store import decode_message_text

    value = decode_message_text(message)
    store = SessionStore(settings.runs())
    store.open(session_id)
    done = store.append(session_id, value, key=key)
    click.echo(f"{done.position}" + ("  (already appended)" if done.duplicate else ""))


@sessions.command()
@click.argument("session_id")
@click.pass_obj
def delete(settings: Settings, session_id: str) -> None:
    """Delete a session and its messages, whoever uses it (also how a corrupt record is
    removed). Exit 2 when there is no such session."""
    from ..sessions import SessionStore

    n = SessionStore(settings.runs()).delete(session_id)
    click.echo(safe(f"deleted session {session_id} ({n} messages)"))
