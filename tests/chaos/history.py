"""The history of a chaos run, as plain data the checker reads.

Two sources only:

* what the system recorded -- every run's hash, ledger, output journal, questions and
  effect receipts (through RunStore and the store's keys), the schedules' history
  (``marbles-rq schedules --json``) and the event journal (``marbles-rq events --json``);
* what the workloads and the harness wrote -- the receipts of step executions and effect
  claims (Redis lists, see workloads.py), and the harness's own log of what it submitted,
  sent, answered, cancelled and killed.

`collect` reads them from a live Redis after the run; the checker's tests build a History by
hand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis

from marbles_rq.engine.runs import RunStore
from marbles_rq.payloads.codec import decode_payload
from marbles_rq.payloads.fields import open_value
from marbles_rq.store.records import EffectReceipt, decode
from tests.chaos.names import (
    CLAIMS_KEY,
    EFFECTS_KEY,
    EXEC_KEY,
    LOCK_COUNTER_KEY,
    LOCK_DONE_KEY,
    LOCK_HOLDS_KEY,
    RETRY_KEY,
)


@dataclass(frozen=True)
class Ev:
    """One entry of a run's output journal. `ms` is the server's clock when written."""

    ms: int
    seq: int
    type: str
    attempt: int
    data: dict[str, Any]


@dataclass
class Step:
    key: str
    name: str
    status: str
    attempts: int
    result: Any = None
    seq: int = -1  # its position in its frame


@dataclass
class Run:
    id: str
    name: str
    status: str
    input: Any = None
    result: Any = None
    error: dict[str, Any] | None = None
    parent: str | None = None
    attempt: int = 1
    queue: str = "default"
    priority: int = 0
    rerun_of: str = ""  # a rerun: the run it reruns, and the step it reruns from
    rerun_from_step: str = ""
    start_at_ms: int = 0  # asked to start no earlier (epoch ms; 0: at once)
    events: list[Ev] = field(default_factory=list)
    steps: dict[str, Step] = field(default_factory=dict)
    questions: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> state, answer
    effects: dict[str, str] = field(default_factory=dict)  # receipt's key -> its scope
    published: dict[str, Any] = field(default_factory=dict)  # its published state, by key


@dataclass(frozen=True)
class Execution:
    """A step body started (a workload receipt)."""

    x: str
    run: str
    step: str
    epoch: int
    attempt: int
    pid: int = 0
    t: int = 0
    origin: str = ""  # the RQ queue its delivery was popped from ("" if unknown)


@dataclass(frozen=True)
class Claim:
    """An effect claim answered inside a step (a workload receipt)."""

    x: str
    run: str
    step: str
    key: str
    epoch: int
    outcome: str


@dataclass(frozen=True)
class Submitted:
    """One enqueue the harness made: created True/False, or None when it failed (Redis was
    down) and was tried again."""

    run: str
    workflow: str
    via: str
    created: bool | None
    t: int = 0


@dataclass(frozen=True)
class Sent:
    """One send of an inbound event by the harness (created None: the send failed)."""

    event_id: str
    key: str
    via: str
    created: bool | None
    t: int = 0


@dataclass(frozen=True)
class AnswerTry:
    """One answer the harness gave: accepted, refused (already answered), or error
    (unknown outcome: Redis went away)."""

    run: str
    key: str
    value: Any
    via: str
    outcome: str
    t: int = 0


@dataclass(frozen=True)
class Cancel:
    run: str
    via: str
    outcome: str
    t: int = 0


@dataclass(frozen=True)
class PauseTry:
    """One `pause` or `resume` the harness made, in the order it made them for that run:
    outcome is the engine's answer (paused, requested, already, settled; woken, resumed,
    not_paused; missing), the CLI's exit and line, or "error: ..." (unknown outcome)."""

    run: str
    op: str  # pause | resume
    via: str
    outcome: str
    t: int = 0


@dataclass(frozen=True)
class RerunTry:
    """One `rerun --from-step` the harness made once `source` had finished. `order`: the
    source's steps in the order the server committed them (its journal), when the rerun was
    asked; `copied`: the steps the engine said it copied."""

    source: str
    run: str
    from_step: str
    via: str
    outcome: str  # created | exists | error: ...
    copied: tuple[str, ...] = ()
    order: tuple[str, ...] = ()
    t: int = 0


@dataclass(frozen=True)
class SignalTry:
    """One signal the harness sent (or signal-with-start it made): the `index`-th of its
    run, payload {"run", "i"}; outcome ok | created | exists (the seq the store gave it) |
    refused: ... | error: ... (unknown: retried with the same request id)."""

    run: str
    index: int
    via: str
    outcome: str
    seq: int = 0
    t: int = 0


@dataclass(frozen=True)
class OrderSent:
    """One send of an event for a cx_publish_wait run: its match (decoy False) or a decoy
    that must never reach it; created as events.send answered (None: the send failed, or
    a SIGKILLed CLI: unknown)."""

    event_id: str
    run: str
    type: str
    payload: Any
    decoy: bool
    via: str
    created: bool | None
    t: int = 0


@dataclass(frozen=True)
class RetryTry:
    """One `retry --input-patch` the harness made of a cx_retry run once it paused on its
    step: outcome retried | not_failed_step (the run was not paused on it: a retry whose
    reply a Redis outage lost had done it) | gave_up: ... (it never paused) | error: ..."""

    run: str
    patch: Any
    via: str
    outcome: str
    t: int = 0


@dataclass(frozen=True)
class ArtifactVersion:
    """One version of an artifact, as the client reads it back: its number and content."""

    version: int
    content: bytes
    run: str = ""  # the run that wrote it, as its record says ("" if it does not)


@dataclass(frozen=True)
class LockReceipt:
    """One entry into (op enter) or exit from (op exit) cx_lock's critical section, written
    by a script that read the lock's holder in the store at that moment (server ms):
    enter: valid (this execution held it), done (its run's increment was accepted before),
    read (the counter); exit: outcome written | already | refused (not the holder)."""

    x: str  # one per pass through the section: its enter and exit share it
    op: str
    run: str
    epoch: int
    attempt: int
    ms: int
    holder: str = ""
    holder_epoch: int = 0
    valid: bool = False
    done: bool = False
    read: int = 0
    outcome: str = ""
    pid: int = 0  # the process that executed the pass


@dataclass(frozen=True)
class LimitSample:
    """A sample of a concurrency limit's live holds in the store (server ms) that found
    more than `limit` (the sampler logs only those, and counts the rest)."""

    at_ms: int
    label: str
    limit: int
    held: int
    holders: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fault:
    """A fault the harness caused. `pids`: the processes whose executions it interrupted
    (a run's worker name ends in the pid of the process that executes it)."""

    kind: str
    at_ms: int
    pids: tuple[int, ...] = ()
    target: str = ""


@dataclass(frozen=True)
class Crash:
    """A chaos process that exited without being killed."""

    name: str
    code: int
    excused: str = ""  # why it is not a finding (e.g. refused to start while Redis was down)
    tail: str = ""


@dataclass
class History:
    runs: dict[str, Run] = field(default_factory=dict)
    executions: list[Execution] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)  # the effect target, in order
    submitted: list[Submitted] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)
    answers: list[AnswerTry] = field(default_factory=list)
    cancels: list[Cancel] = field(default_factory=list)
    pauses: list[PauseTry] = field(default_factory=list)
    reruns: list[RerunTry] = field(default_factory=list)
    signals: list[SignalTry] = field(default_factory=list)
    orders: list[OrderSent] = field(default_factory=list)
    retries: list[RetryTry] = field(default_factory=list)
    # cx_retry: each step's tries as the workload counted them (idempotency key -> count)
    retry_tries: dict[str, int] = field(default_factory=dict)
    # sessions read back after the chaos: id -> its messages in order (None: unreadable)
    sessions: dict[str, list[Any] | None] = field(default_factory=dict)
    artifacts: dict[str, list[ArtifactVersion]] = field(default_factory=dict)
    lock_receipts: list[LockReceipt] = field(default_factory=list)
    lock_counter: int = 0  # cx_lock's counter at the end
    lock_done: list[str] = field(default_factory=list)  # runs whose increment was accepted
    # label -> (samples taken, most live holds seen, the limit)
    limit_counts: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    limit_over: list[LimitSample] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    crashes: list[Crash] = field(default_factory=list)
    event_journal: list[dict[str, Any]] = field(default_factory=list)  # events --json
    schedules: list[dict[str, Any]] = field(default_factory=list)  # schedules --json
    schedule_every_ms: dict[str, int] = field(default_factory=dict)  # key -> interval
    schedule_workflows: dict[str, str] = field(default_factory=dict)  # workflow -> key
    stuck_after_s: float = 0.0  # how long the harness waited for quiescence


# -- reading it from Redis --------------------------------------------------------------------

def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _events(rows: list[Any], store: Any = None) -> list[Ev]:
    """A run's output journal; with `store`, the user values its entries carry (an input
    patch, a signal's payload ...) opened when MARBLES_KEYS sealed them."""
    out = []
    for eid, f in rows:
        ms, seq = _s(eid).split("-")
        try:
            data = msgspec.json.decode(f[b"d"])
        except msgspec.DecodeError:
            data = {"unreadable": _s(f.get(b"d", b""))}
        if store is not None and isinstance(data, dict):
            data = {k: open_value(store, v) for k, v in data.items()}
        out.append(Ev(int(ms), int(seq), _s(f.get(b"t", b"?")), int(f.get(b"a", 0) or 0),
                      data if isinstance(data, dict) else {"value": data}))
    return out


def _questions(fields: dict[bytes, bytes], store: Any = None) -> dict[str, dict[str, Any]]:
    """A run's questions; their answers opened (sealed when MARBLES_KEYS is set)."""
    f = {_s(k): v for k, v in fields.items()}
    out: dict[str, dict[str, Any]] = {}
    for name in f:
        if "|" in name:
            continue
        answer = f.get(f"{name}|answer")
        out[name] = {"state": _s(f.get(f"{name}|state", b"open")),
                     "answer": None if answer is None else msgspec.json.decode(
                         answer if store is None else decode_payload(store, bytes(answer))),
                     "rev": int(f.get(f"{name}|rev", b"1"))}
    return out


def all_run_ids(runs: RunStore) -> list[str]:
    pipe = runs.client.pipeline(transaction=False)
    for bucket in range(runs.keys.buckets):
        pipe.zrange(runs.keys.listing("run", bucket), 0, -1)
    return sorted({_s(rid) for part in pipe.execute() for rid in part})


def read_runs(runs: RunStore, ids: list[str]) -> dict[str, Run]:
    """Every run's record, ledger, output journal, questions and effect receipts."""
    out: dict[str, Run] = {}
    for start in range(0, len(ids), 200):
        chunk = ids[start:start + 200]
        pipe = runs.client.pipeline(transaction=False)
        for rid in chunk:
            keys = runs.keys.run_keys(rid)
            pipe.xrange(keys.output, "-", "+")
            pipe.hgetall(keys.asks)
            pipe.smembers(keys.effects)
            pipe.hgetall(runs.keys.published(rid))
        replies = pipe.execute()
        for i, rid in enumerate(chunk):
            view = runs.get(rid)
            if view is None:
                continue
            rows, asks, effect_keys, published = replies[4 * i:4 * i + 4]
            run = Run(
                id=rid, name=view.record.name, status=view.status,
                input=msgspec.json.decode(view.record.input),
                result=None if view.result is None else msgspec.json.decode(view.result),
                error=None if view.error is None else msgspec.structs.asdict(view.error),
                parent=view.record.parent or None, attempt=view.attempt,
                queue=view.record.queue, priority=view.record.priority,
                rerun_of=view.record.rerun_of, rerun_from_step=view.record.rerun_from_step,
                start_at_ms=view.record.not_before_ms,
                events=_events(rows, runs.store), questions=_questions(asks, runs.store),
                steps={s.key: Step(s.key, s.name, s.status, s.attempts,
                                   None if s.result is None else msgspec.json.decode(s.result),
                                   s.seq)
                       for s in view.steps})
            run.effects = _effects(runs, rid, [_s(k) for k in effect_keys])
            run.published = {_s(k): msgspec.json.decode(decode_payload(runs.store, v))
                             for k, v in published.items()}
            out[rid] = run
    return out


def _effects(runs: RunStore, rid: str, receipt_keys: list[str]) -> dict[str, str]:
    """The run's effect receipts in the store: the key each was claimed under -> scope."""
    if not receipt_keys:
        return {}
    pipe = runs.client.pipeline(transaction=False)
    for key in receipt_keys:
        pipe.hget(key, "doc")
    found = {}
    for rkey, doc in zip(receipt_keys, pipe.execute(), strict=True):
        if doc is None:
            continue
        receipt = decode(EffectReceipt, doc, rkey)
        found[receipt.key] = receipt.scope
    return found


def _json_list(client: redis.Redis, key: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in client.lrange(key, 0, -1)]  # type: ignore[union-attr]


def read_receipts(client: redis.Redis) -> tuple[list[Execution], list[Claim], list[str]]:
    seen: set[str] = set()
    executions = []
    for e in _json_list(client, EXEC_KEY):
        if e["x"] not in seen:  # a receipt resent after a Redis restart counts once
            seen.add(e["x"])
            executions.append(Execution(e["x"], e["run"], e["step"], int(e["epoch"]),
                                        int(e["attempt"]), int(e.get("pid", 0)),
                                        int(e.get("t", 0)), str(e.get("origin", ""))))
    claims = []
    for c in _json_list(client, CLAIMS_KEY):
        if c["x"] not in seen:
            seen.add(c["x"])
            claims.append(Claim(c["x"], c["run"], c["step"], c["key"], int(c["epoch"]),
                                c["outcome"]))
    applied = [_s(k) for k in client.lrange(EFFECTS_KEY, 0, -1)]  # type: ignore[union-attr]
    return executions, claims, applied



def read_retry_tries(client: Any) -> dict[str, int]:
    return {_s(k): int(v) for k, v in client.hgetall(RETRY_KEY).items()}


def read_locks(client: Any) -> tuple[list[LockReceipt], int, list[str]]:
    """cx_lock's receipts (a receipt resent after a Redis restart counts once: its first),
    its counter and the runs whose increment was accepted."""
    seen: set[tuple[str, str]] = set()
    receipts = []
    for r in _json_list(client, LOCK_HOLDS_KEY):
        if (r["x"], r["op"]) in seen:
            continue
        seen.add((r["x"], r["op"]))
        receipts.append(LockReceipt(
            r["x"], r["op"], r["run"], int(r["epoch"]), int(r.get("attempt") or 0),
            int(r["ms"]), str(r.get("holder") or ""), int(r.get("holder_epoch") or 0),
            bool(r.get("valid")), bool(r.get("done")), int(r.get("read") or 0),
            str(r.get("outcome") or ""), int(r.get("pid") or 0)))
    counter = int(client.get(LOCK_COUNTER_KEY) or 0)
    done = sorted(_s(m) for m in client.smembers(LOCK_DONE_KEY))
    return receipts, counter, done
