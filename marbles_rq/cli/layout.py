"""`marbles-rq buckets show|grow`: a deployment's bucket layout, and growing its count."""

from __future__ import annotations

import json
import sys

import click

from ..deployment import Settings
from ..store.grow import Grower, read_state
from ..store.keys import SLOTS, Keyspace, slot_range


@click.group()
def buckets() -> None:
    """A deployment's buckets: how many, which layout, and growing their count."""


@buckets.command()
@click.option("--json", "as_json", is_flag=True, help="Print the fields as JSON.")
@click.pass_obj
def show(settings: Settings, as_json: bool) -> None:
    """Show the recorded bucket count, layout and lanes (and a growth under way). Exit 1
    when nothing is recorded for the prefix yet. Writes nothing."""
    state = read_state(settings.client(), settings.prefix)
    if state is None:
        click.echo("null" if as_json else f"nothing recorded for prefix {settings.prefix!r} "
                   f"(a new deployment gets 1024 buckets, layout 2)")
        sys.exit(1)
    keys = Keyspace(settings.prefix, state.buckets, lanes=state.lanes, layout=state.layout)
    data = {"prefix": settings.prefix, "buckets": state.buckets, "layout": state.layout,
            "lanes": state.lanes, "growing_to": state.grow_to, "moved": state.moved,
            "first_tag": keys.tag(0), "last_tag": keys.tag(state.buckets - 1),
            "lane_rq_prefixes": [keys.lane_rq_prefix(k) for k in range(keys.lanes)]}
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    spread = (f"bucket b on a slot in [b*{SLOTS}/B, (b+1)*{SLOTS}/B), e.g. bucket 0 on slots "
              f"{slot_range(0, state.buckets).start}.."
              f"{slot_range(0, state.buckets).stop - 1}" if state.layout >= 2
              else "tags {prefix:bNNNN}, slots where they hash")
    click.echo(f"prefix {settings.prefix}: {state.buckets} buckets, layout {state.layout} "
               f"({spread}), {state.lanes} lane{'s' if state.lanes != 1 else ''}")
    if keys.lanes > 1:
        click.echo("lanes' RQ prefixes: " + " ".join(
            f"{k}={keys.lane_rq_prefix(k)}" for k in range(keys.lanes)))
    if state.grow_to is not None:
        click.echo(f"growing to {state.grow_to} buckets: {state.moved} keys moved so far; "
                   f"finish with `marbles-rq buckets grow --to {state.grow_to}`")


@buckets.command()
@click.option("--to", "to", type=int, required=True, help="The new bucket count (larger).")
@click.option("--progress-every", type=click.IntRange(1), default=1000, show_default=True,
              help="Print a progress line after this many keys.")
@click.pass_obj
def grow(settings: Settings, to: int, progress_every: int) -> None:
    """Grow the bucket count to --to, offline: stop every controller and worker first (it
    refuses while a controller leads or a worker beats). Every key moves to its new bucket;
    a kill at any point is safe: run the same command again and it finishes."""
    grower = Grower(settings.client(), settings.prefix, to,
                    progress=lambda line: click.echo(line), progress_every=progress_every)
    grower.run()
