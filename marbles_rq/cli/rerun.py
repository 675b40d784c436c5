"""`marbles-rq rerun RUN [--from-step PATH] [--id NEW_ID]` (see engine/rerun.py)."""

from __future__ import annotations

import json

import click

from ..deployment import Settings
from ..terminal import safe


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--from-step", "from_step", default=None, metavar="PATH",
              help="Execute from this step (a ledger key `path#n` as `status` shows it, or a "
                   "path for its first call); the results of the steps recorded before it "
                   "are copied and not executed again. Default: from the top.")
@click.option("--id", "new_id", default=None, help="The new run's id (default random); the "
              "same id again returns that run; an id taken by any other run is refused.")
@click.option("--json", "as_json", is_flag=True, help="Print the new run as JSON.")
@click.pass_obj
def rerun(settings: Settings, run_id: str, from_step: str | None, new_id: str | None,
          as_json: bool) -> None:
    """A new run of a finished run's workflow, with its recorded input; it records which run
    it reruns (`status` shows it). A run that has not finished is refused."""
    from ..client import Client

    runs = settings.runs()
    result = Client(settings).rerun(run_id, from_step=from_step, new_id=new_id)
    if as_json:
        view = runs.get(result.run_id)
        data = {} if view is None else view.to_json()
        click.echo(json.dumps({"created": result.created, "copied_steps": result.copied,
                               **data}, indent=2))
        return
    click.echo(safe(result.summary()))
