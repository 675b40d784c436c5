"""What the dashboard's pages read, built on the CLI's read paths (RunStore.get/output,
WaitStore, Events, list_schedules, list_monitors, lease_holder) plus a few counters that
cost one pipelined round trip over the buckets (ZCARD of the per-bucket indexes)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..controller.loop import LEASE_NAME
from ..deployment import Settings
from ..engine.output_lines import format_event
from ..engine.runs import TERMINAL, OutputEvent, RunView
from ..engine.waits import Question, Report, WaitStore
from ..store.replies import as_text
from ..store.replies import server_ms as read_server_ms
from ..transport import dispatch

OUTPUT_SHOWN = 2000  # output lines rendered with the page; later ones arrive live


def iso(ms: int | None) -> str:
    if ms is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}"


def ago(ms: int | None, now_ms: int | None = None) -> str:
    if ms is None:
        return "-"
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    delta = (now_ms - ms) // 1000
    future = delta < 0
    s = abs(delta)
    text = (f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"
            if s < 172800 else f"{s // 86400}d")
    return f"in {text}" if future else f"{text} ago"


def duration(ms: int | None) -> str:
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms} ms"
    if ms < 120_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms // 60000} min {ms % 60000 // 1000} s"


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)


@dataclass
class StepTry:
    step: str
    attempt: int
    started_ms: int | None
    ended_ms: int | None
    outcome: str  # running | succeeded | failed | retrying | interrupted
    error: str = ""
    run_attempt: int = 0
    entry: str = ""  # the id of its step_started entry: where it sits in the journal

    @property
    def duration_ms(self) -> int | None:
        if self.started_ms is None or self.ended_ms is None:
            return None
        return max(0, self.ended_ms - self.started_ms)


@dataclass
class WaitSpan:
    """A time the run waited, parked between two executions: why (question, timer, signal,
    child, event, paused), on what, and the children it waited for (linked on the page)."""

    reason: str
    what: str
    started_ms: int
    ended_ms: int | None
    children: list[str] = field(default_factory=list)
    cause: str = ""  # what woke it ("answered", "timer", ...), once woken
    entry: str = ""  # the id of its parked entry

    @property
    def duration_ms(self) -> int | None:
        return None if self.ended_ms is None else max(0, self.ended_ms - self.started_ms)


@dataclass
class RunPage:
    view: RunView
    data: dict[str, Any]
    questions: list[Question]
    reports: list[Report]
    lines: list[tuple[str, str, str]]  # (entry id, type, text)
    last_id: str
    tries: list[StepTry] = field(default_factory=list)
    truncated: bool = False
    waits: list[WaitSpan] = field(default_factory=list)

    @property
    def rows(self) -> list[tuple[str, Any]]:
        """The timeline's rows, steps' tries and waits, in the order of their entries in the
        journal (a step's own start time is the executor's reckoning, which errs late: it
        may pass the server's time of the park that followed it)."""
        rows: list[tuple[tuple[int, ...], str, Any]] = [
            (_entry_order(t.entry), "step", t) for t in self.tries]
        rows += [(_entry_order(w.entry), "wait", w) for w in self.waits]
        return [(kind, item) for _, kind, item in sorted(rows, key=lambda r: r[0])]


def _entry_order(entry_id: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in entry_id.split("-", 1))
    except ValueError:
        return (0,)


def timeline(events: list[OutputEvent], finished: bool) -> list[StepTry]:
    """Each try of each step, from the output journal: its start (when it really started,
    `started_ms`) to its outcome, with the delivery (attempt) it ran in."""
    open_: dict[str, StepTry] = {}
    tries: list[StepTry] = []
    for ev in events:
        d = ev.data if isinstance(ev.data, dict) else {}
        step = str(d.get("step", ""))
        if ev.type == "step_started":
            start = d.get("started_ms") if isinstance(d.get("started_ms"), int) else ev.at_ms
            t = StepTry(step, int(d.get("attempt") or 1), start, None, "running",
                        run_attempt=ev.attempt, entry=ev.id)
            open_[step] = t
            tries.append(t)
        elif ev.type in ("step_succeeded", "step_failed", "step_retry") and step in open_:
            t = open_.pop(step)
            t.ended_ms = ev.at_ms
            t.outcome = {"step_succeeded": "succeeded", "step_failed": "failed",
                         "step_retry": "retrying"}[ev.type]
            t.error = str(d.get("error") or "")
        elif ev.type == "parked" and d.get("reason") in ("retry", "failed_step") and (
                step in open_):
            # A failed try that parks the run for its retry, or for a person: its failure.
            t = open_.pop(step)
            t.ended_ms = ev.at_ms
            t.outcome = "retrying" if d.get("reason") == "retry" else "failed"
            t.error = str(d.get("error") or "")
            for t in open_.values():
                t.outcome, t.ended_ms = "parked", ev.at_ms
            open_.clear()
        elif ev.type in ("redelivered", "parked", "final"):
            # What was running when the execution vanished, parked or settled ended there.
            for t in open_.values():
                t.outcome = "parked" if ev.type == "parked" else "interrupted"
                t.ended_ms = ev.at_ms if ev.type == "parked" else None
            open_.clear()
    if finished:
        for t in open_.values():
            t.outcome = "interrupted"
    return tries


def ledger_keys(data: dict[str, Any]) -> set[str]:
    """The keys (``<path>#<position>``) of the steps in a run's ledger (its status JSON):
    what a rerun may start from."""
    return {f"{s.get('path')}#{s.get('position')}" for s in data.get("steps") or []
            if isinstance(s, dict)}


def waits_of(events: list[OutputEvent], finished: bool) -> list[WaitSpan]:
    """Each time the run parked, from the output journal: from `parked` to what ended the
    wait (`woken`, `resumed`, the next execution's start, or the final record)."""
    spans: list[WaitSpan] = []
    open_: WaitSpan | None = None
    for ev in events:
        d = ev.data if isinstance(ev.data, dict) else {}
        if ev.type == "parked":
            what = format_event(ev).split("parked: waiting for ", 1)[-1]
            children = [str(c) for c in d.get("children") or []]
            open_ = WaitSpan(str(d.get("reason") or "wait"), what, ev.at_ms, None, children,
                             entry=ev.id)
            spans.append(open_)
        elif open_ is not None and ev.type in ("woken", "resumed", "attempt_started",
                                                "final"):
            open_.ended_ms = ev.at_ms
            if ev.type == "woken":
                open_.cause = str(d.get("cause") or "")
            elif ev.type == "final":
                open_.cause = "finished"
            open_ = None
    if finished and open_ is not None:
        open_.cause = "finished"
    return spans


def run_page(settings: Settings, run_id: str) -> RunPage | None:
    runs = settings.runs(read_only=True)
    view = runs.get(run_id)
    if view is None:
        from ..flow.debounce import window_view

        view = window_view(runs, run_id) or runs.get(run_id)  # a window's run, or recorded
    if view is None:
        return None
    waits = WaitStore(runs)
    events = runs.output(run_id, count=OUTPUT_SHOWN)
    lines = [(ev.id, ev.type, _line(ev)) for ev in events]
    data = view.to_json()
    from ..sessions import SessionStore

    data["sessions"] = SessionStore(runs).of_run(run_id)  # the sessions it opened
    return RunPage(view, data, waits.questions(run_id), waits.run_reports(run_id),
                   lines, events[-1].id if events else "0-0",
                   timeline(events, view.status in TERMINAL),
                   truncated=len(events) >= OUTPUT_SHOWN,
                   waits=waits_of(events, view.status in TERMINAL))


def _line(ev: OutputEvent) -> str:
    text = format_event(ev)
    return text.split(" ", 1)[1] if " " in text else text  # the page shows its own stamp


def output_after(settings: Settings, run_id: str, after: str,
                 count: int = 500) -> list[tuple[str, str, str, int]]:
    """(id, type, text, at ms) of the output entries after `after`."""
    events = settings.runs(read_only=True).output(run_id, after=after, count=count)
    return [(ev.id, ev.type, _line(ev), ev.at_ms) for ev in events]


@dataclass(frozen=True)
class WorkerRow:
    name: str
    alive: bool
    lost_in_ms: int
    running: list[tuple[str, str]]  # (run id, workflow)


@dataclass(frozen=True)
class System:
    leader: Any
    server_ms: int
    workers: list[WorkerRow]
    queues: list[tuple[str, int]]
    counts: dict[str, int]
    redeliveries_hour: int | None


def system(settings: Settings) -> System:
    reader = settings.reader()
    client = reader.client
    keys = settings.keys
    server_ms = read_server_ms(client)
    pipe = client.pipeline(transaction=False)
    pipe.zrange(keys.workers, 0, -1, withscores=True)
    indexes = {"runs": lambda b: keys.listing("run", b), "executing": keys.run_leases,
               "waiting_due": keys.run_waits, "open_questions": keys.feed,
               "dispatch_checks": keys.run_dispatch, "finished_kept": keys.run_finished}
    for key_of in indexes.values():
        for b in range(keys.buckets):
            pipe.zcard(key_of(b))
    for b in range(keys.buckets):
        pipe.zrange(keys.run_leases(b), 0, -1)
    replies = pipe.execute()
    workers_raw, rest = replies[0], replies[1:]
    counts = {}
    for i, name in enumerate(indexes):
        counts[name] = sum(int(n) for n in rest[i * keys.buckets:(i + 1) * keys.buckets])
    executing = [as_text(r) for part in rest[len(indexes) * keys.buckets:] for r in part]
    pipe = client.pipeline(transaction=False)
    for rid in executing:
        pipe.hmget(keys.run(rid), ["worker", "doc"])
    by_worker: dict[str, list[tuple[str, str]]] = {}
    for rid, (worker, doc) in zip(executing, pipe.execute(), strict=True):
        if worker is None:
            continue
        try:
            name = str(json.loads(doc)["name"]) if doc else "?"
        except (ValueError, KeyError, TypeError):
            name = "?"
        by_worker.setdefault(as_text(worker), []).append((rid, name))
    workers = [WorkerRow(as_text(w), int(score) > server_ms, int(score) - server_ms,
                         sorted(by_worker.pop(as_text(w), [])))
               for w, score in workers_raw]
    # Runs whose worker no longer beats (or predates liveness) still show, under its name.
    workers += [WorkerRow(w, False, 0, sorted(r)) for w, r in sorted(by_worker.items())]
    return System(reader.lease_holder(LEASE_NAME), server_ms, workers,
                  queue_depths(settings), counts, redeliveries_last_hour(settings, server_ms))


def queue_depths(settings: Settings) -> list[tuple[str, int]]:
    """(marbles queue, deliveries waiting in its RQ queues, summed over the lanes) for this
    deployment's queues."""
    depth: dict[str, int] = {}
    for lane in settings.rq().lanes:
        for q in lane.queue_class.all(connection=lane.conn):
            name = dispatch.queue_of(settings.keys.prefix, q.name)
            if name is not None:  # (not another prefix's, `sec.x` when this is `sec`)
                depth[name] = depth.get(name, 0) + int(lane.conn.llen(q.key))
    return sorted(depth.items())


def redeliveries_last_hour(settings: Settings, server_ms: int) -> int:
    """Redeliveries (a vanished execution, a delivery lost in RQ) in the hour before
    `server_ms`, from the per-bucket index the controller's scripts keep for an hour."""
    keys = settings.keys
    pipe = settings.reader().client.pipeline(transaction=False)
    for b in range(keys.buckets):
        pipe.zcount(keys.redeliveries(b), server_ms - 3_600_000, "+inf")
    return sum(int(n) for n in pipe.execute())
