"""`marbles-rq info`: the deployment at a glance, like `rq info`: each lane with its leader
and its queues' depth, the workers that beat, and how many runs run, wait, ask and failed
in the last hour. Reads only."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from ..deployment import Settings
from ..store.replies import as_text, server_ms
from ..terminal import safe
from . import render

HOUR_MS = 3_600_000
FAILED_SCAN = 10_000  # finished runs looked at per bucket for "failed in the last hour"


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_obj
def info(settings: Settings, as_json: bool) -> None:
    """Queues and lanes with their depth, the leader of each lane, workers alive, and runs
    running, waiting for a due time (a timer, a deadline, children to check), asking (open
    questions) and failed in the last hour."""
    data = read_info(settings)
    if as_json:
        click.echo(json.dumps(data, indent=2))
    elif render.on_terminal():
        _tables(data)
    else:
        for line in plain_lines(data):
            click.echo(safe(line))


def read_info(settings: Settings) -> dict[str, Any]:
    reader = settings.reader()
    keys = settings.keys
    client = reader.client
    now_ms = server_ms(client)
    pipe = client.pipeline(transaction=False)
    pipe.zrange(keys.workers, 0, -1, withscores=True)
    for b in range(keys.buckets):
        pipe.zcard(keys.run_leases(b))
        pipe.zcard(keys.run_waits(b))
        pipe.zcard(keys.feed(b))
    replies = pipe.execute()
    workers_raw, counts = replies[0], replies[1:]
    workers = [{"name": as_text(w), "alive": int(score) > now_ms,
                "lease_left_ms": int(score) - now_ms} for w, score in workers_raw]
    return {
        "prefix": settings.prefix, "buckets": keys.buckets, "server_time": _iso(now_ms),
        "lanes": _lanes(settings),
        "workers": {"alive": sum(w["alive"] for w in workers),
                    "lost": sum(not w["alive"] for w in workers), "list": workers},
        "runs": {"running": sum(int(n) for n in counts[0::3]),
                 "waiting_due": sum(int(n) for n in counts[1::3]),
                 "open_questions": sum(int(n) for n in counts[2::3]),
                 "failed_last_hour": failed_since(settings, now_ms - HOUR_MS, now_ms)},
        "rate_limits": _rate_limits(settings),
    }


def _rate_limits(settings: Settings) -> list[dict[str, Any]]:
    """Each rate limit with its rate in force and the runs it holds (flow/rate_limits.py)."""
    from ..flow.rate_store import catalog_rates

    reader = settings.runs(read_only=True)
    found = reader.rates().list(catalog_rates(reader.client, reader.keys))
    return [{"name": i.name, "rate": i.rate, "burst": i.burst, "held": i.held,
             "last_admission": _iso(i.last_ms or None)} for i in found]


def _lanes(settings: Settings) -> list[dict[str, Any]]:
    from ..controller.loop import LEASE_NAME
    from ..controller.share import lane_leaders
    from ..transport import dispatch

    reader = settings.reader()
    keys = settings.keys
    if keys.lanes > 1:
        held = {ll.lane: ll.info for ll in lane_leaders(reader)}
    else:
        held = {0: reader.lease_holder(LEASE_NAME)}
    out = []
    for lane in settings.rq().lanes:
        lease = held.get(lane.index)
        leader = None
        if lease is not None:
            host, _, rest = lease.token.partition(":")
            leader = {"holder": f"{host}:{rest.partition(':')[0]}", "epoch": lease.epoch,
                      "since": _iso(lease.since_ms), "lease_left_ms": lease.ttl_ms}
        depths = dispatch.queue_depths(lane.conn, keys.prefix, lane.rq_prefix)
        out.append({"lane": lane.index,
                    "buckets": [keys.lane_buckets(lane.index).start,
                                keys.lane_buckets(lane.index).stop - 1],
                    "leader": leader,
                    "queues": [{"queue": name, "queued": q, "in_flight": f}
                               for name, (q, f) in sorted(depths.items())]})
    return out


def failed_since(settings: Settings, since_ms: int, now_ms: int) -> int:
    """Runs that finished failed after `since_ms`. A finished run is indexed by the time it
    may be pruned (its finish plus its workflow's retention), so the candidates are those
    indexed after `since_ms` plus the shortest retention any worker declared; each
    candidate's own finish time decides."""
    import msgspec

    from ..engine.catalog import Declared

    keys = settings.keys
    client = settings.reader().client
    retentions = [7 * 86400.0]
    for raw in client.hvals(keys.workflows):
        try:
            retentions.append(msgspec.json.decode(raw, type=Declared).retention_s)
        except msgspec.DecodeError:
            continue
    low = since_ms + int(min(retentions) * 1000)
    pipe = client.pipeline(transaction=False)
    for b in range(keys.buckets):
        pipe.zrangebyscore(keys.run_finished(b), low, "+inf", start=0, num=FAILED_SCAN)
    candidates = [as_text(rid) for part in pipe.execute() for rid in part]
    failed = 0
    for i in range(0, len(candidates), 500):
        pipe = client.pipeline(transaction=False)
        for rid in candidates[i:i + 500]:
            pipe.hmget(keys.run(rid), ["status", "finished_ms"])
        for status, finished in pipe.execute():
            if status is not None and as_text(status) == "failed" and finished is not None \
                    and since_ms <= int(finished) <= now_ms:
                failed += 1
    return failed


def plain_lines(data: dict[str, Any]) -> list[str]:
    """The piped form: one fact a line, stable for scripts."""
    lanes = data["lanes"]
    out = [f"deployment {data['prefix']}: {data['buckets']} buckets, {len(lanes)} "
           f"lane{'s' if len(lanes) != 1 else ''}"]
    for lane in lanes:
        leader = lane["leader"]
        who = ("no controller leads" if leader is None else
               f"leader {leader['holder']} (epoch {leader['epoch']}, lease left "
               f"{leader['lease_left_ms']} ms)")
        out.append(f"lane {lane['lane']} (buckets {lane['buckets'][0]}-{lane['buckets'][1]}): "
                   f"{who}")
        for q in lane["queues"]:
            out.append(f"  queue {q['queue']}: {q['queued']} queued, {q['in_flight']} "
                       f"in flight")
        if not lane["queues"]:
            out.append("  no queues")
    w = data["workers"]
    alive = [x["name"] for x in w["list"] if x["alive"]]
    out.append(f"workers: {w['alive']} alive, {w['lost']} lost"
               + (f" ({', '.join(alive)})" if alive else ""))
    r = data["runs"]
    out.append(f"runs: {r['running']} running, {r['waiting_due']} waiting for a due time, "
               f"{r['open_questions']} open questions, {r['failed_last_hour']} failed in "
               f"the last hour")
    for limit in data.get("rate_limits", []):
        out.append(f"rate limit {limit['name']}: {limit['rate']}"
                   + (f" burst {limit['burst']}" if limit["burst"] != 1 else "")
                   + f", {limit['held']} held")
    return out


def _tables(data: dict[str, Any]) -> None:
    out = render.console()
    lanes = data["lanes"]
    out.print(f"deployment {safe(data['prefix'])}: {data['buckets']} buckets, {len(lanes)} "
              f"lane{'s' if len(lanes) != 1 else ''}", markup=False)
    out.print()
    rows = []
    for lane in lanes:
        leader = lane["leader"]
        who = (render.cell("none", "bold red") if leader is None else
               render.cell(f"{leader['holder']} (epoch {leader['epoch']}, since "
                           f"{render.when(leader['since'])})"))
        queues = lane["queues"] or [None]
        for i, q in enumerate(queues):
            rows.append([str(lane["lane"]) if i == 0 else "", who if i == 0 else "",
                         "-" if q is None else q["queue"],
                         "-" if q is None else str(q["queued"]),
                         "-" if q is None else str(q["in_flight"])])
    render.table(["LANE", "LEADER", "QUEUE", "QUEUED", "IN FLIGHT"], rows)
    out.print()
    render.table(["WORKER", "STATE"],
                 [[w["name"], render.status_cell("alive" if w["alive"] else "gone")]
                  for w in data["workers"]["list"]], title="workers", empty="none beat")
    out.print()
    r = data["runs"]
    failed = r["failed_last_hour"]
    render.table(["RUNNING", "WAITING (DUE TIME)", "OPEN QUESTIONS", "FAILED (LAST HOUR)"],
                 [[str(r["running"]), str(r["waiting_due"]), str(r["open_questions"]),
                   render.cell(failed, "bold red" if failed else None)]])
    if data.get("rate_limits"):
        out.print()
        render.table(["RATE LIMIT", "RATE", "BURST", "HELD", "LAST ADMISSION"],
                     [[x["name"], x["rate"], str(x["burst"]), str(x["held"]),
                       render.when(x["last_admission"])] for x in data["rate_limits"]],
                     title="rate limits")
