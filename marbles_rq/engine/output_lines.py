"""One line of text per entry of a run's output journal: what `marbles-rq watch` (and
`enqueue --wait`, `run`) print and what the dashboard shows, before the terminal escaping
each applies."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import msgspec

from .runs import OutputEvent


def format_event(ev: OutputEvent) -> str:
    d = ev.data if isinstance(ev.data, dict) else {"value": ev.data}
    at = ev.happened_ms  # a start written with its commit (or late) says when it was
    stamp = time.strftime("%H:%M:%S", time.gmtime(at / 1000)) + f".{at % 1000:03d}"
    handlers: dict[str, Callable[[], str]] = {
        "queued": lambda: f"queued: {d.get('name')} on {d.get('queue')}",
        "attempt_started": lambda: _started(ev, d),
        "step_started": lambda: f"step {d.get('step')} started (try {d.get('attempt')})",
        "step_succeeded": lambda: f"step {d.get('step')} succeeded",
        "step_retry": lambda: f"step {d.get('step')} failed ({d.get('error')}); retrying in "
                              f"{d.get('retry_in_s')} s",
        "step_failed": lambda: f"step {d.get('step')} failed: {d.get('error')}",
        "output": lambda: d["text"] if "text" in d else json.dumps(d.get("value")),
        "log": lambda: f"{d.get('level')}: {d.get('message')}",
        "redelivered": lambda: f"delivery {d.get('previous')} vanished ({d.get('reason')}); "
                               f"redelivered as delivery {d.get('attempt')}",
        "cancel_requested": lambda: "cancel requested",
        "deferred": lambda: f"handed back: {d.get('reason')}",
        "held": lambda: f"held: {d.get('reason')}",
        "parked": lambda: f"parked: waiting for {_parked(d)}",
        "woken": lambda: f"woken ({d.get('cause')}); delivered again as delivery {ev.attempt}",
        "answered": lambda: f"question {d.get('key')} answered: {json.dumps(d.get('answer'))}",
        "report": lambda: f"{d.get('kind')} {d.get('key')}: {json.dumps(d.get('entry'))}",
        "child_started": lambda: f"child {d.get('child')} started ({d.get('workflow')})",
        "timer_fired": lambda: f"timer {d.get('timer')} fired ({d.get('late_ms')} ms after "
                               f"its due time)",
        "published": lambda: f"published {d.get('key')}",
        "artifact_put": lambda: f"artifact {d.get('artifact')} version {d.get('version')} "
                                f"recorded",
        "clock_read": lambda: f"clock read at {d.get('step')}",
        "patched": lambda: (f"patch {d.get('patch')}: the {'new' if d.get('new') else 'old'} "
                             f"branch, recorded"),
        "event_received": lambda: f"event {d.get('event')} ({_event_kind(d)}) received by "
                                  f"{d.get('wait')}",
        "event_wait_timed_out": lambda: f"wait {d.get('wait')} for an event timed out",
        "signal": lambda: f"signal {d.get('name')} #{d.get('seq')} received",
        "signal_taken": lambda: _taken(d),
        "pause_requested": lambda: "pause requested",
        "step_retried": lambda: f"step {d.get('step')} retried by request"
        + (f" with input patch {json.dumps(d.get('patch'))}" if "patch" in d else ""),
        "step_given_up": lambda: f"step {d.get('step')} given up: {d.get('error')}",
        "resumed": lambda: "resumed",
        "truncated": lambda: f"output truncated: the run's cap of {d.get('max_lines')} lines / "
                             f"{d.get('max_bytes')} bytes is reached; later lines are dropped",
        "final": lambda: _final(d),
    }
    text = handlers.get(ev.type, lambda: f"{ev.type}: {json.dumps(d)}")()
    return f"{stamp} d{ev.attempt} {text}"


def _started(ev: OutputEvent, d: dict[str, Any]) -> str:
    """An execution's start: its attempt (1 + redeliveries) and what made it; the line's
    d<N> is its delivery (a wake is a delivery too, not an attempt)."""
    if "attempt" not in d:  # written before attempts and resumptions were counted apart
        return f"delivery {ev.attempt} started on {d.get('worker')} (epoch {d.get('epoch')})"
    kind = d.get("kind")
    verb = "continues" if kind == "resumption" else "started"
    why = {"resumption": f"resumption {d.get('resumptions')}, ", "redelivery": "redelivery, ",
           "handback": "after a hand-back, "}.get(str(kind), "")
    return (f"attempt {d['attempt']} {verb} on {d.get('worker')} "
            f"({why}epoch {d.get('epoch')})")


def _parked(d: dict[str, Any]) -> str:
    reason = d.get("reason")
    if reason == "question":
        return "an answer to " + ", ".join(d.get("questions") or [])
    if reason == "child":
        return "child " + ", ".join(d.get("children") or [])
    if reason == "signal":
        return "signal " + ", ".join(d.get("signals") or [])
    if reason == "timer" and d.get("until_ms"):
        at = int(d["until_ms"])
        return "a timer due " + time.strftime("%H:%M:%S", time.gmtime(at / 1000)) + (
            f".{at % 1000:03d}")
    if reason == "retry" and d.get("next_at_ms"):
        at = int(d["next_at_ms"])
        return (f"the retry of step {d.get('step')} (attempt {int(d.get('attempt') or 0) + 1} "
                f"of {d.get('max_attempts')}) at "
                + time.strftime("%H:%M:%S", time.gmtime(at / 1000)) + f".{at % 1000:03d}"
                + f"; it failed: {d.get('error')}")
    if reason == "failed_step":
        return (f"retry or fail of step {d.get('step')}: {d.get('attempts')} of "
                f"{d.get('max_attempts')} attempts failed, last {d.get('error')}")
    if reason == "event" and d.get("events"):
        return "an event " + ", ".join(
            _event_kind(e) + "".join(f" {k}={json.dumps(v)}" for k, v in
                                     (e.get("match") or {}).items())
            for e in d["events"] if isinstance(e, dict))
    if reason == "rate_limit" and isinstance(d.get("rate_limit"), dict):
        held = d["rate_limit"]
        at = int(held.get("turn_ms") or 0)
        return (f"rate limit {held.get('limit')} (place {int(held.get('position') or 0) + 1} "
                f"of {held.get('queued')}, turn about "
                + time.strftime("%H:%M:%S", time.gmtime(at / 1000)) + f".{at % 1000:03d})")
    if reason == "lock" and isinstance(d.get("lock"), dict):
        held = d["lock"]
        return (f"lock {held.get('name')} (place {int(held.get('position') or 0) + 1} of "
                f"{held.get('queued')}" + (f", held by {held['holder']})" if held.get("holder")
                                          else ")"))
    return "resume" if reason == "paused" else str(reason)


def _event_kind(d: dict[str, Any]) -> str:
    return str(d.get("source")) + (f"/{d['type']}" if d.get("type") else "")


def _taken(d: dict[str, Any]) -> str:
    if d.get("timed_out"):
        return f"wait for signal {d.get('name')} timed out at {d.get('call')}"
    seqs = d.get("seqs") or []
    taken = "nothing" if not seqs else ", ".join(f"#{s}" for s in seqs)
    return f"signal {d.get('name')} {taken} taken at {d.get('call')}"


def _final(d: dict[str, Any]) -> str:
    status = d.get("status")
    if status == "succeeded":
        return f"run succeeded: {msgspec.json.encode(d.get('result')).decode()}"
    if status == "failed":
        err = d.get("error") or {}
        return f"run failed: {err.get('type')}: {err.get('message')}"
    return f"run {status}" + (f": {d['reason']}" if d.get("reason") else "")
