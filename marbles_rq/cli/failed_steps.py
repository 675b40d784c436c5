"""Commands for a run paused on a step whose tries ran out (on_exhausted="pause"): `retry
RUN [--input-patch JSON]` runs the step again now, `fail RUN [--reason TEXT]` gives it up."""

from __future__ import annotations

import click

from ..client import Client
from ..deployment import Settings
from ..engine.input_patch import decode_patch
from ..store.ids import check_id
from ..terminal import safe


@click.command()
@click.argument("run_id")
@click.option("--input-patch", "input_patch", default=None, metavar="JSON",
              help="Change the step's arguments first: a JSON object merged over them by "
              "name (RFC 7396 merge patch), recorded in the run's ledger.")
@click.pass_obj
def retry(settings: Settings, run_id: str, input_patch: str | None) -> None:
    """Run the step RUN_ID is paused on (its tries ran out) again now, its tries counted
    from 1. Exit 2 if the run is not paused on a failed step or the patch does not fit."""
    check_id(run_id, "run id")
    patch = None
    if input_patch is not None:
        # With the step's code at hand, the patched values are checked against its
        # parameters' types now (else the worker refuses them when the step runs again).
        settings.load_source()
        patch = decode_patch(input_patch, "--input-patch")
    click.echo(safe(Client(settings).retry(run_id, patch).message))


@click.command()
@click.argument("run_id")
@click.option("--reason", default=None, metavar="TEXT", help="Why it is given up (shown with "
              "the step's error).")
@click.pass_obj
def fail(settings: Settings, run_id: str, reason: str | None) -> None:
    """Give up the step RUN_ID is paused on: it fails with its last error and the reason,
    and the run ends failed (unless its body handles the step's failure). Exit 2 if the run
    is not paused on a failed step."""
    check_id(run_id, "run id")
    click.echo(safe(Client(settings).fail(run_id, reason).message))
