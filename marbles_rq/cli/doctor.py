"""`marbles-rq doctor`: is the configured Redis durable enough for marbles-rq?"""

from __future__ import annotations

import json
import sys
from typing import Any

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
from ..terminal import safe


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
    checks.append(_blob_check(settings))
    bad = problems(checks)
    versions = _versions(settings)
    if as_json:
        doc = {"redis_url": _redacted(url), **report(checks)}
        doc["warnings"] += versions["warnings"]
        doc["workflows"] = versions["workflows"]
        doc["unserved"] = versions["unserved"]
        click.echo(json.dumps(doc, indent=2))
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
        _report_versions(versions)
    if bad:
        sys.exit(1)


def _blob_check(settings: Settings) -> Check:
    """Which blob store this process uses (MARBLES_BLOB_STORE: every process must be given
    the same) and whether it takes a write: a small object written, read back, deleted."""
    from ..payloads.blobs import blob_store_for

    try:
        blobs = blob_store_for(settings.store())
        return Check("blobs", "blob store", blobs.probe(), "reachable and writable", True,
                     "problem", "")
    except Exception as exc:  # unreachable, denied, a bad URL, boto3 missing: one line
        return Check("blobs", "blob store", f"failed: {one_line(exc)}", "reachable and writable",
                     False, "problem", "offloaded payloads and artifact contents could be "
                     "neither written nor read (see MARBLES_BLOB_STORE)")


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


def _versions(settings: Settings) -> dict[str, Any]:
    """Per workflow, the versions live workers serve (and which workers); the not finished
    runs of a version that no live worker serves, per (workflow, version), with a warning
    line for each."""
    from ..engine.unserved import open_runs
    from ..transport.served import live_versions

    out: dict[str, Any] = {"workflows": {}, "unserved": [], "warnings": [], "lines": []}
    try:
        runs = settings.runs(read_only=True)
        live = live_versions(runs)
        scan = open_runs(runs)
    except (redis.RedisError, MarblesError) as exc:
        out["warnings"].append(f"cannot read the workers' versions: {one_line(exc)}")
        return out
    out["workflows"] = {name: {v: sorted(workers) for v, workers in sorted(versions.items())}
                        for name, versions in sorted(live.served.items())}
    for (workflow, version), (count, example) in sorted(scan.runs.items()):
        if live.serves(workflow, version):
            continue
        out["unserved"].append({"workflow": workflow, "version": version, "runs": count,
                                "example": example})
        what = f"version {version!r}" if version else "(recorded before versions)"
        out["warnings"].append(
            f"{count} not finished run{'' if count == 1 else 's'} of workflow {workflow!r} "
            f"{what}: no live worker serves it, so they wait (e.g. run {example}); start a "
            f"worker whose --source declares that version")
    if live.silent:
        out["lines"].append(f"  {len(live.silent)} live worker(s) started by an earlier "
                            f"marbles-rq do not say which versions they serve")
    if not scan.complete:
        out["lines"].append(f"  (runs checked: the newest {scan.scanned}; older ones were "
                            f"not read)")
    return out


def _report_versions(versions: dict[str, Any]) -> None:
    """Per workflow, the versions live workers serve; a warning per (workflow, version) with
    runs that no live worker serves."""
    click.echo("workflows served by live workers:" if versions["workflows"] else
               "workflows served by live workers: none")
    for name, served in versions["workflows"].items():
        click.echo(safe(f"  {name}: " + ", ".join(
            f"version {v} ({len(workers)} worker{'' if len(workers) == 1 else 's'})"
            for v, workers in served.items())))
    for line in versions["lines"]:
        click.echo(line)
    for line in versions["warnings"]:
        click.echo(safe(f"warning: {line}"), err=True)


def _redacted(url: str) -> str:
    from ..store.connection import redact

    return redact(url)
