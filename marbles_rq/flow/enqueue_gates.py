"""Debounce, throttle and singleton: what an enqueue of a gated workflow does first.

    @mr.workflow(debounce="5s", debounce_key="customer", debounce_max="1m")
    @mr.workflow(throttle="10/min", throttle_key="customer")
    @mr.workflow(singleton="skip", singleton_key="customer")

Each enqueue gets a Decision (flow/gate_specs.py): started, merged (into a debounce
window's run), dropped (throttled: retry after when), skipped (a singleton's run is
unfinished) or cancelled_running (that run was cancelled and this one started). Each
decision is one script on the bucket tag of the key's digest (`Keyspace.debounce_window`,
`throttle_log`, `singleton_pointer`): exact on one server and on a cluster.

* **Debounce** (flow/debounce.py): the window's run id is fixed when it opens; later
  enqueues merge into it; the controller records and starts it when the window closes.
* **Throttle**: a sliding log of the runs let through; a run past the rate is dropped, not
  held, and nothing is recorded. The decision comes before the run's record: an enqueuer
  killed in between has used a place in the period without a run.
* **Singleton**: a pointer to the key's unfinished run, changed by compare-and-set. The
  runs get ids of the pointer's bucket, so the script reads the pointed run's status
  itself: a pointer to a finished or pruned run is taken over by whoever finds it, and a
  run's settle or cancel clears its own pointer (flow/singleton.py). A pointer to a run not yet
  recorded counts as unfinished for SINGLETON_GRACE_MS (its enqueuer records it right
  after the decision; killed in between, the key is free again after that).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import msgspec

from ..engine.authoring import InputError
from ..store.records import RunRecord
from ..store.replies import as_text
from .gate_specs import Decision, Gate, GateInputError, digest, key_value
from .singleton import pointed as _pointed

if TYPE_CHECKING:
    from ..engine.authoring import WorkflowDef
    from ..engine.ops import Enqueued
    from ..engine.runs import RunStore
    from ..transport.lanes import RQLike

SINGLETON_GRACE_MS = 30_000
MAX_RETRIES = 1000


class GateRefusedError(InputError):
    """A gated workflow cannot be enqueued this way (one line)."""


def gate_of(definition: WorkflowDef | None) -> Gate | None:
    return None if definition is None else getattr(definition, "gate", None)


def check_request(gate: Gate, *, given_id: bool, start_at: bool) -> None:
    """Refuse what a gate cannot honour: an id of the caller's (a debounce window's or a
    singleton's run id is chosen in the key's bucket), a later start of a debounce."""
    if given_id and gate.kind in ("debounce", "singleton"):
        raise GateRefusedError(f"a {gate.kind} workflow's run ids are chosen by marbles-rq "
                               f"(in its key's bucket): enqueue it without an id")
    if start_at and gate.kind == "debounce":
        raise GateRefusedError("a debounced run starts when its window closes: no start_at")


def enqueue(runs: RunStore, rq: RQLike, record: RunRecord, definition: WorkflowDef
            ) -> tuple[Enqueued | None, Decision]:
    """Apply the definition's gate to a prepared `record` and, where it says so, record and
    enqueue the run: (the run enqueued, or None when none was; the decision)."""
    from ..engine.ops import enqueue_record

    gate = gate_of(definition)
    if gate is None:
        done = enqueue_record(runs, rq, record)
        return done, Decision("started", done.run_id)
    if not hasattr(runs, "scripts") or not hasattr(runs.keys, "debounce_window"):
        raise GateRefusedError(f"workflow {definition.name!r} has a {gate.kind}, which this "
                               f"in-memory store does not apply: test it against Redis")
    raw = msgspec.json.decode(record.input)
    try:
        value = key_value(gate, definition.name, raw,
                          lambda: definition.decode_input(bytes(record.input)))
    except GateInputError as exc:
        raise InputError(str(exc)) from None
    except Exception as exc:  # the key function's own error, in one line
        raise InputError(f"the {gate.kind} key function of workflow {definition.name!r} "
                         f"raised {type(exc).__name__}: {exc}") from None
    ident = digest(gate, definition.name, value)
    if gate.kind == "throttle":
        reply = runs.scripts.throttle_enqueue(log=runs.keys.throttle_log(ident),
                                              run_id=record.id, limit=gate.runs,
                                              period_ms=gate.period_ms)
        if reply.status == "dropped":
            return None, Decision("dropped", "", retry_at_ms=int(reply.values[0]), key=value)
        done = enqueue_record(runs, rq, record)
        return done, Decision("started", done.run_id, key=value)
    if gate.kind == "singleton":
        return _singleton(runs, rq, record, gate, ident, value)
    from . import debounce

    reduce = None
    if gate.reduce is not None:
        reducer = gate.reduce

        def reduce(previous: bytes, new: bytes) -> bytes:
            try:
                out = reducer(definition.decode_input(previous), definition.decode_input(new))
                merged = msgspec.json.encode(out)
            except GateInputError as exc:
                raise InputError(str(exc)) from None
            except (TypeError, msgspec.EncodeError) as exc:
                raise InputError(f"debounce_reduce of workflow {definition.name!r} returned "
                                 f"no JSON value: {exc}") from None
            except Exception as exc:  # the reducer's own error, in one line
                raise InputError(f"debounce_reduce of workflow {definition.name!r} raised "
                                 f"{type(exc).__name__}: {exc}") from None
            return definition.parse_input(merged)[1]

    return None, debounce.enqueue(runs, record, gate, ident, value, reduce)


def _singleton(runs: RunStore, rq: RQLike, record: RunRecord, gate: Gate, ident: str,
               value: str) -> tuple[Enqueued | None, Decision]:
    from ..engine.ops import enqueue_record
    from . import debounce

    keys = runs.keys
    pointer = keys.singleton_pointer(ident)
    record = msgspec.structs.replace(
        record, id=debounce.id_in_bucket(keys, keys.bucket_of(ident)), singleton=ident)
    expect = _pointed(runs.client.get(pointer))
    for _ in range(MAX_RETRIES):
        reply = runs.scripts.singleton_enqueue(
            pointer=pointer, run=keys.run(expect) if expect else pointer, expect=expect,
            run_id=record.id, mode=gate.mode, grace_ms=SINGLETON_GRACE_MS)
        if reply.status == "retry":
            expect = as_text(reply.values[0])
            continue
        other = as_text(reply.values[0])
        if reply.status == "skipped":
            return None, Decision("skipped", other, key=value)
        done = enqueue_record(runs, rq, record)
        if _pointed(runs.client.get(pointer)) != record.id:
            # A newer enqueue cancelled this run between the decision and the record (it
            # found no run to cancel yet): it cancels itself, so one run survives.
            with contextlib.suppress(Exception):
                runs.cancel(record.id, "cancelled by a newer run of its singleton")
        if reply.status == "cancelled_running":
            with contextlib.suppress(Exception):  # flagged already: it stops regardless
                runs.cancel(other, f"cancelled by run {record.id} of its singleton")
            return done, Decision("cancelled_running", done.run_id, cancelled=other, key=value)
        return done, Decision("started", done.run_id, key=value)
    raise RuntimeError(f"singleton: the pointer changed {MAX_RETRIES} times in a row")
