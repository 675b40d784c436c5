"""`marbles-rq get RUN KEY`: a value a run published (ctx.publish)."""

from __future__ import annotations

import json

import click

from ..deployment import Settings
from ..engine.published import get_published, wait_published
from ..store.ids import check_id


@click.command()
@click.argument("run_id")
@click.argument("key")
@click.option("--wait", "wait_s", type=click.FloatRange(0, 86_400), default=None,
              help="Wait up to this many seconds for the run to publish KEY.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"run", "key", "value"} as JSON.')
@click.pass_obj
def get(settings: Settings, run_id: str, key: str, wait_s: float | None,
        as_json: bool) -> None:
    """Print the value run RUN_ID published last under KEY (JSON). Exit 1 when it has not
    published KEY (or not within --wait), 2 when there is no such run."""
    check_id(run_id, "run id")
    runs = settings.runs(read_only=True)
    value = (get_published(runs, run_id, key) if wait_s is None
             else wait_published(runs, run_id, key, wait_s))
    if as_json:
        click.echo(json.dumps({"run": run_id, "key": key, "value": value}, indent=2))
        return
    click.echo(json.dumps(value))  # ASCII: a value never carries a control to the terminal
