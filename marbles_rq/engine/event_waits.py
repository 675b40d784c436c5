"""Runs that wait for a matching inbound event.

    order = ctx.wait_for_event("shop", type="paid", match={"order": "A-17"}, timeout_s=3600)
    order.payload["amount"]

The run parks (no worker held) until an event of that source (and type, when given) whose
JSON payload has each `match` field at the given value (top-level equality) is sent
(`marbles-rq events send`, `mr.send_event`, a signed webhook), and the call returns it. An
event received before the wait opened counts if it came within `lookback_s` (1 h by default,
at most MARBLES_EVENT_LOOKBACK_S). Each run consumes an event at most once; one event wakes
every run it matches.

How it is kept:

* the run's side, in its own slot: the event inbox hash (`keys.event_inbox`) records when each
  wait opened and when it times out, and how it ended (the event, or the timeout), together
  with the ledger entry at the wait's position (lua/open_event_wait.lua,
  lua/deliver_event.lua). A replay finds that entry and returns the same event.
* the index, in one slot of its own (`{<prefix>:evwait}`): each open wait is listed under
  one *term*, a digest of (source, type or "*", its first match field, that field's value),
  and recent events under every term they have (each top-level field with a scalar value),
  kept for the longest lookback (lua/add_event_wait.lua, lua/note_event.lua). An event reads
  only the waits under its own terms: its cost grows with the waits that share a term with
  it, not with every waiting run. Each matched run is then delivered to with a call in that
  run's slot, so no script spans two slots on a cluster.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import TYPE_CHECKING, Any

import msgspec
import redis

from ..envvars import env_int
from ..errors import MarblesError
from ..payloads.fields import open_record, run_holder, seal_record
from ..store.records import EventRecord, StepRecord, decode, encode
from ..store.redis_errors import one_line
from ..store.replies import as_text
from .authoring import InputError
from .context import check_branch, check_not_in_foreign_thread, now_ms
from .execution import DISPATCH_GRACE_MS, stamp, step_doc
from .waiting import ParkRun, Wait

if TYPE_CHECKING:
    from ..store.keys import Keyspace
    from .context import Run
    from .runs import RunStore

log = logging.getLogger("marbles_rq.engine.event_waits")

# The same rules as events' own (triggers/events.py), which imports the engine.
SOURCE_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
TYPE_PATTERN = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
LOOKBACK_ENV = "MARBLES_EVENT_LOOKBACK_S"
DEFAULT_LOOKBACK_S = 3600
MAX_MATCH_FIELDS = 16
MAX_MATCH_VALUE = 512      # bytes of a match value's JSON
MAX_EVENT_TERMS = 256      # top-level fields of an event indexed for lookups
MAX_TIMEOUT_S = 366 * 86400


class EventWaitTimeoutError(MarblesError):
    """No matching event came within the wait's timeout_s."""

    code = "event_wait_timeout"


class EventWaitError(InputError):
    """A wait_for_event the engine refuses (bad source, type, match or window)."""

    code = "invalid_event_wait"


class ReceivedEvent(msgspec.Struct, kw_only=True, frozen=True):
    """The event a wait received (the same field names as `mr.Event`)."""

    key: str
    source: str
    type: str = ""
    id: str
    payload: Any = None
    received_at_ms: int = 0


def max_lookback_s() -> int:
    """How long an event stays findable by a wait that opens after it (seconds)."""
    return env_int(LOOKBACK_ENV, DEFAULT_LOOKBACK_S, unit="seconds")


# -- terms ---------------------------------------------------------------------------------

def _canon(value: Any) -> bytes:
    """A scalar's JSON, one spelling per value (1.0 and 1 are the same number)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        value = int(value)
    return msgspec.json.encode(value)


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _digest(source: str, type: str, field: str, value: bytes) -> str:
    raw = msgspec.json.encode([source, type, field]) + b"\0" + value
    return hashlib.sha1(raw).hexdigest()[:24]


def wait_term(source: str, type: str | None, match: dict[str, Any]) -> str:
    """The one term a wait is indexed under: its first match field (by name) and value."""
    if not match:
        return _digest(source, type or "*", "", b"")
    field = min(match)
    return _digest(source, type or "*", field, _canon(match[field]))


def event_terms(source: str, type: str, payload: Any) -> list[str]:
    """Every term an event is found under: for its type and for "any type", the bare
    (source, type) and each top-level field with a scalar value."""
    fields: list[tuple[str, bytes]] = [("", b"")]
    if isinstance(payload, dict):
        for name in sorted(payload)[:MAX_EVENT_TERMS]:
            if _scalar(payload[name]):
                encoded = _canon(payload[name])
                if len(encoded) <= MAX_MATCH_VALUE:
                    fields.append((name, encoded))
    types = [type, "*"] if type else ["*"]
    return [_digest(source, t, name, value) if name else _digest(source, t, "", b"")
            for t in types for name, value in fields]


def matches(spec: dict[str, Any], source: str, type: str, payload: Any) -> bool:
    """Does an event (source, type, payload) satisfy a wait's spec in full?"""
    if spec.get("source") != source or (spec.get("type") and spec["type"] != type):
        return False
    match = spec.get("match") or {}
    if not match:
        return True
    if not isinstance(payload, dict):
        return False
    return all(name in payload and _scalar(payload[name])
               and _canon(payload[name]) == _canon(value) for name, value in match.items())


def _term_keys(keys: Keyspace, term: str) -> tuple[str, str]:
    tag = keys.event_waits_tag()
    return f"{tag}:r:{term}", f"{tag}:w:{term}"


def _spec_key(keys: Keyspace) -> str:
    return f"{keys.event_waits_tag()}:spec"


# -- in a run body -------------------------------------------------------------------------

def check_wait(source: str, type: str | None, match: dict[str, Any] | None,
               timeout_s: float | None, lookback_s: float | None) -> dict[str, Any]:
    """The wait's match, validated (raises EventWaitError)."""
    if not isinstance(source, str) or not SOURCE_PATTERN.fullmatch(source):
        raise EventWaitError(f"invalid event source {source!r}: use 1 to 64 of "
                             f"A-Z a-z 0-9 _ . -")
    if type is not None and (not isinstance(type, str) or not TYPE_PATTERN.fullmatch(type)):
        raise EventWaitError(f"invalid event type {type!r}: use 1 to 128 of "
                             f"A-Z a-z 0-9 _ . : / -")
    match = {} if match is None else match
    if not isinstance(match, dict) or len(match) > MAX_MATCH_FIELDS:
        raise EventWaitError(f"match is a dict of at most {MAX_MATCH_FIELDS} fields")
    for name, value in match.items():
        if not isinstance(name, str) or not name:
            raise EventWaitError(f"a match field is a non-empty string, not {name!r}")
        if not _scalar(value) or len(_canon(value)) > MAX_MATCH_VALUE:
            raise EventWaitError(f"match field {name!r}: a string, number, bool or None of "
                                 f"at most {MAX_MATCH_VALUE} bytes of JSON")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(
            timeout_s, int | float) or not 0 < timeout_s <= MAX_TIMEOUT_S):
        raise EventWaitError("timeout_s must be between 0 and a year")
    limit = max_lookback_s()
    if lookback_s is not None and (isinstance(lookback_s, bool) or not isinstance(
            lookback_s, int | float) or not 0 <= lookback_s <= limit):
        raise EventWaitError(f"lookback_s must be between 0 and {limit} s ({LOOKBACK_ENV})")
    return match


def wait_for_event(run: Run, source: str, type: str | None = None,
                   match: dict[str, Any] | None = None, timeout_s: float | None = None,
                   lookback_s: float | None = None) -> ReceivedEvent:
    """The first event of `source` (and `type`) whose payload matches `match`, received
    within `lookback_s` before the wait opened or while it waits; parks the run until then.
    Raises EventWaitTimeoutError after `timeout_s`."""
    check_not_in_foreign_thread("wait_for_event")
    check_branch()
    match = check_wait(source, type, match, timeout_s, lookback_s)
    lookback_ms = int((DEFAULT_LOOKBACK_S if lookback_s is None else lookback_s) * 1000)
    lookback_ms = min(lookback_ms, max_lookback_s() * 1000)
    wait_key, seq = run.position("|event")
    recorded = run.ex.ledger.get(wait_key)
    if recorded is not None:
        return _ended(recorded)
    spec = {"run": run.run_id, "key": wait_key, "seq": seq, "source": source, "type": type,
            "match": match}
    wait = {"source": source, "type": type, "match": match}
    if getattr(run.runs, "scripts", None) is None:
        # Runs in memory (engine/memory_store.py: a dry run, the test kit) keep their events.
        memory: Any = run.runs
        got: ReceivedEvent = memory.event_wait(run, spec, wait, timeout_s, lookback_ms)
        return got
    timeout_record = StepRecord(version=1, key=wait_key, name="|event", status="timed_out",
                                attempts=0, result=msgspec.Raw(msgspec.json.encode(wait)),
                                at_ms=now_ms(), seq=seq)
    ex = run.ex
    runs = run.runs
    reply = run.call_store(lambda: runs.scripts.open_event_wait(
        keys=ex.keys, epoch=ex.epoch, wait_key=wait_key,
        timeout_ms=0 if timeout_s is None else int(timeout_s * 1000),
        timeout_record=step_doc(runs.store, ex, stamp(timeout_record, ex)),
        event=msgspec.json.encode({"wait": wait_key, **wait})))
    if reply.status in ("stale", "settled"):
        run.check_reply("stale")
    if reply.status in ("done", "timed_out"):
        if reply.status == "timed_out":
            _drop(runs, run.run_id, wait_key, spec)
        return _ended(_record(runs, reply.values[0], ex.keys.event_inbox))
    since, due = int(reply.values[0]), int(reply.values[1])
    term = wait_term(source, type, match)
    run.call_store(lambda: runs.scripts.add_event_wait(
        term_key=_term_keys(runs.keys, term)[1], spec_key=_spec_key(runs.keys),
        member=f"{run.run_id}|{wait_key}", spec=msgspec.json.encode(spec)))
    found: ReceivedEvent | None = run.call_store(_look_back, run, spec, term,
                                                 since - lookback_ms)
    if found is not None:
        return found
    raise ParkRun([Wait("event", wake_at_ms=due, until_ms=due, events=[wait])])


def _ended(record: StepRecord) -> ReceivedEvent:
    if record.status == "received":
        return msgspec.json.decode(record.result, type=ReceivedEvent)
    wait = msgspec.json.decode(record.result)
    raise EventWaitTimeoutError(f"no event of {wait.get('source')!r}"
                                + (f" type {wait['type']!r}" if wait.get("type") else "")
                                + (f" matching {wait['match']!r}" if wait.get("match") else "")
                                + " came within the wait's timeout")


def _record(runs: RunStore, raw: bytes, where: str) -> StepRecord:
    return open_record(runs.store, decode(StepRecord, raw, where))


def _look_back(run: Run, spec: dict[str, Any], term: str, since_ms: int
               ) -> ReceivedEvent | None:
    """An event received since `since_ms` that matches, taken by this execution; None if
    there is none (the wait stays open, indexed: a later event is delivered to it)."""
    runs, ex = run.runs, run.ex
    recent = _term_keys(runs.keys, term)[0]
    event_keys = [as_text(k) for k in runs.client.zrangebyscore(recent, since_ms, "+inf")]
    if not event_keys:
        return None
    pipe = runs.client.pipeline(transaction=False)
    for key in event_keys:
        pipe.hget(runs.keys.event(key), "doc")
    for key, doc in zip(event_keys, pipe.execute(raise_on_error=False), strict=True):
        if not isinstance(doc, bytes):
            continue  # pruned meanwhile, or unreadable: it costs only itself
        try:
            event = open_record(runs.store, decode(EventRecord, doc, runs.keys.event(key)))
            payload = msgspec.json.decode(event.payload)
        except (MarblesError, msgspec.DecodeError):
            continue
        if not matches(spec, event.source, event.type, payload):
            continue
        runs.flush_starts(ex)  # the steps started before it come first in the output
        status = _deliver(runs, spec, event, payload, epoch=ex.epoch)[0]
        if status == "taken_now":
            _drop(runs, run.run_id, spec["key"], spec)
            return received(event, payload)
        if status == "taken":  # a sender delivered one meanwhile
            raw = runs.client.hget(runs.keys.event_inbox(run.run_id), spec["key"])
            if isinstance(raw, bytes):
                _drop(runs, run.run_id, spec["key"], spec)
                return _ended(_record(runs, raw, runs.keys.event_inbox(run.run_id)))
        if status in ("stale", "idle"):
            run.check_reply("stale")
    return None


def received(event: EventRecord, payload: Any) -> ReceivedEvent:
    return ReceivedEvent(key=event.id, source=event.source, type=event.type,
                         id=event.event_id, payload=payload,
                         received_at_ms=event.received_at_ms)


def _deliver(runs: RunStore, spec: dict[str, Any], event: EventRecord, payload: Any, *,
             epoch: int | None) -> tuple[str, int, str]:
    run_id, wait_key = str(spec["run"]), str(spec["key"])
    got = received(event, payload)
    record = StepRecord(version=1, key=wait_key, name="|event", status="received",
                        attempts=0, result=msgspec.Raw(msgspec.json.encode(got)),
                        at_ms=now_ms(), seq=int(spec.get("seq", -1)))
    reply = runs.scripts.deliver_event(
        keys=runs.keys.run_keys(run_id), run_id=run_id, wait_key=wait_key,
        record=encode(seal_record(runs.store, record, run_holder(run_id))), event_key=event.id,
        epoch=epoch, grace_ms=DISPATCH_GRACE_MS,
        event=msgspec.json.encode({"wait": wait_key, "event": event.id,
                                   "source": event.source, "type": event.type}),
        woken=msgspec.json.encode({"cause": "event", "event": event.id}))
    if reply.status == "woken":
        return "woken", int(reply.values[0]), as_text(reply.values[1])
    return reply.status, 0, ""


def _drop(runs: RunStore, run_id: str, wait_key: str, spec: dict[str, Any]) -> None:
    """Unindex an ended wait (best effort: a stale entry is dropped by the next event that
    finds it ended)."""
    term = wait_term(spec["source"], spec.get("type"), spec.get("match") or {})
    try:
        runs.scripts.drop_event_wait(term_key=_term_keys(runs.keys, term)[1],
                                     spec_key=_spec_key(runs.keys), member=f"{run_id}|{wait_key}")
    except redis.RedisError as exc:
        log.warning("run %s: could not unindex its wait %s (%s)", run_id, wait_key,
                    one_line(exc))


# -- from the sender of an event --------------------------------------------------------------

def offer_event(runs: RunStore, record: EventRecord, enqueue: Any = None, *,
                received_ms: int | None = None) -> dict[str, str]:
    """Keep a journaled event findable for the lookback window and deliver it to every run
    waiting for it. `enqueue(queue, run_id, attempt)` sends a woken run's delivery now (the
    controller dispatches it otherwise). `received_ms`: when it was received (server ms),
    for an event offered late; None: now. Returns {run id: outcome} for the waits it matched
    (woken | pending | paused: delivered; consumed: that run had it already)."""
    payload = msgspec.json.decode(record.payload)
    terms = event_terms(record.source, record.type, payload)
    reply = runs.scripts.note_event(
        spec_key=_spec_key(runs.keys), term_keys=[_term_keys(runs.keys, t) for t in terms],
        event_key=record.id, keep_ms=max_lookback_s() * 1000, received_ms=received_ms)
    values = reply.values[1:]
    outcomes: dict[str, str] = {}
    for member, raw in zip(values[0::2], values[1::2], strict=True):
        member_text = as_text(member)
        try:
            spec = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:
            spec = None
        run_id, _, wait_key = member_text.partition("|")
        if not isinstance(spec, dict):
            # An index entry without its spec: unusable; drop it under every term it may be in.
            for term in terms:
                runs.scripts.drop_event_wait(term_key=_term_keys(runs.keys, term)[1],
                                             spec_key=_spec_key(runs.keys), member=member_text)
            continue
        if not matches(spec, record.source, record.type, payload):
            continue
        status, attempt, queue = _deliver(runs, spec, record, payload, epoch=None)
        if status in ("woken", "pending", "paused", "taken", "not_open", "idle"):
            _drop(runs, run_id, wait_key, spec)
        if status in ("woken", "pending", "paused", "consumed"):
            outcomes[run_id] = status
        if status == "woken" and enqueue is not None:
            try:
                enqueue(queue, run_id, attempt)
            except redis.RedisError as exc:
                log.warning("run %s: enqueue after event %s failed (%s); the controller "
                            "dispatches it", run_id, record.id, one_line(exc))
    return outcomes
