"""`marbles-rq doctor`: is the configured Redis durable enough for marbles-rq?"""

from __future__ import annotations

import json
import sys

import click
import redis

from ..deployment import Settings
from ..errors import MarblesError
from ..store.connection import refused, unavailable
from ..store.doctor import (
    Check,
    check_durability,
    problem_line,
    problems,
    report,
    warnings,
)
from ..store.redis_errors import one_line


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the checks as one JSON object.")
@click.pass_obj
def doctor(settings: Settings, as_json: bool) -> None:
    """Check Redis: durability settings, script permission, memory headroom, replication.
    Exit 1 on a problem (a write could be lost, evicted or refused); warnings do not fail."""
    url = settings.redis_url
    client = settings.client()
    try:
        checks = check_durability(client)
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError) as exc:
        raise unavailable(url, exc) from None
    except redis.ResponseError as exc:  # e.g. INFO denied by an ACL: say so, not "unreachable"
        raise refused(exc, doctor_hint=False) from None
    if settings.keys.lanes > 1:
        checks += _lane_checks(settings)
    bad = problems(checks)
    if as_json:
        click.echo(json.dumps({"redis_url": _redacted(url), **report(checks)}, indent=2))
    else:
        click.echo(f"Redis {_redacted(url)}")
        for check in checks:
            click.echo("  " + check.line())
        for check in bad:
            click.echo(f"problem: {problem_line(check)}", err=True)
        for check in warnings(checks):
            click.echo(f"warning: {problem_line(check)}", err=True)
        if not bad:
            click.echo("ok: acknowledged writes survive a crash and are never evicted")
        _report_lanes(settings)
    if bad:
        sys.exit(1)


def _lane_checks(settings: Settings) -> list[Check]:
    """One line per lane: who leads it. An unled lane is a warning (no controller started
    yet, or a takeover under way), since doctor also runs before the controllers start."""
    from ..controller.share import lane_leaders

    checks = []
    for ll in lane_leaders(settings.reader()):
        value = (f"led by {ll.holder} (epoch {ll.info.epoch})" if ll.info is not None
                 else "no controller leads")
        checks.append(Check("controller", f"lane {ll.lane} (buckets {ll.buckets.start}-"
                            f"{ll.buckets.stop - 1})", value, "led", ll.info is not None,
                            "warning", "nothing in its buckets is redelivered, dispatched, "
                            "woken or fired until a controller takes it (start one, or see "
                            "'marbles-rq leader')"))
    return checks
def _report_lanes(settings: Settings) -> None:
    """Which lanes live workers serve; a lane none serves is a warning (its runs wait)."""
    from ..transport.liveness import lane_workers

    try:
        served = lane_workers(settings.runs(read_only=True))
    except (redis.RedisError, MarblesError) as exc:
        click.echo(f"warning: cannot read the workers' lanes: {one_line(exc)}", err=True)
        return
    click.echo(f"lanes: {len(served)}")
    for lane, workers in served.items():
        click.echo(f"  lane {lane}: {len(workers)} live worker(s)"
                   + (f" ({', '.join(sorted(workers)[:5])}{', ...' if len(workers) > 5 else ''})"
                      if workers else ""))
    for lane, workers in served.items():
        if not workers:
            click.echo(f"warning: lane {lane} has no live worker: its runs wait (start "
                       f"'marbles-rq worker --lanes {lane}' or '--lanes all')", err=True)


def _redacted(url: str) -> str:
    from ..store.connection import redact

    return redact(url)
