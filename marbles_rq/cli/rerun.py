"""`marbles-rq rerun RUN [--from-step PATH] [--id NEW_ID]` (see engine/rerun.py)."""

from __future__ import annotations

import json
from typing import Any

import click

from ..deployment import Settings
from ..terminal import safe
from .bulk_ops import filter_options, one_or_many, pop_criteria, run_bulk_command


@click.command()
@click.argument("run_id", metavar="RUN", required=False)
@click.option("--from-step", "from_step", default=None, metavar="PATH",
              help="Execute from this step (a ledger key `path#n` as `status` shows it, or a "
                   "path for its first call); the results of the steps recorded before it "
                   "are copied and not executed again. Default: from the top.")
@click.option("--id", "new_id", default=None, help="The new run's id (default random); the "
              "same id again returns that run; an id taken by any other run is refused.")
@filter_options
@click.option("--json", "as_json", is_flag=True, help="Print the new run as JSON (with a "
              "filter: the summary).")
@click.pass_obj
def rerun(settings: Settings, /, run_id: str | None, from_step: str | None, new_id: str | None,
          as_json: bool, **kwargs: Any) -> None:
    """A new run of a finished run's workflow, with its recorded input; it records which run
    it reruns (`status` shows it). A run that has not finished is refused. With a filter
    instead of RUN (`rerun --status failed --workflow report`), every finished run it
    selects, in batches (see --dry-run, --yes); each rerun's id is derived from the run and
    the filter, so the same command again reruns nothing twice."""
    from ..client import Client

    criteria = pop_criteria(kwargs)
    if one_or_many(run_id, criteria):
        if new_id is not None:
            raise click.UsageError("--id names one rerun: not with a filter")
        run_bulk_command(settings, "rerun", criteria, as_json=as_json, from_step=from_step)
        return
    assert run_id is not None
    runs = settings.runs()
    result = Client(settings).rerun(run_id, from_step=from_step, new_id=new_id)
    if as_json:
        view = runs.get(result.run_id)
        data = {} if view is None else view.to_json()
        click.echo(json.dumps({"created": result.created, "copied_steps": result.copied,
                               **data}, indent=2))
        return
    click.echo(safe(result.summary()))
