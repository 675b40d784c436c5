"""A model-checked store: Hypothesis drives the run transitions in random interleavings
through the real store API (RunStore, WaitStore, limits, scripts.py) against a real
redis-server, next to a small reference model in Python, and checks after every step:

* the store agrees with the model (status, delivery number, deferred deliveries,
  resumptions, epoch, pause flag and output lines of every run), and every script reply is
  the one the model predicts (a start's attempt, resumptions and kind among them);
* one terminal record per run: at most one "final" output event, present exactly when the
  status is terminal, and the terminal status, result and finish time never change;
* epochs only grow;
* a stale execution (its epoch is not the run's) writes nothing: every key of its run is
  the same after its call as before;
* a waiting run has a way out: a waits entry (a wake time), a pause flag, an open
  question, or a child it waits for that is not finished;
* a child of a succeeded, failed (or purged) parent is never recorded, one recorded for a
  cancelled (or cancel-requested) parent is cancelled at once by the execution that
  recorded it, and a child of a cancelled parent never starts its body (its start cancels
  it when the cancel's walk missed it);
* a concurrency limit is never exceeded: live slot holds, and running runs with a live
  lease, are at most the limit;
* nothing of a purged run comes back: none of its keys, no member of an index, whatever
  stale executions do afterwards.

The executions follow the engine: a body makes no call while inside start_child (between
its note_child and the child's record), a watchdog stops at its first non-ok renewal (and
settles a cancel), and an ended execution releases its slot.

Time is never slept on: a "short" start takes a 1 ms lease (an execution that was frozen
until its lease and slot expired), and the test waits on the server clock until that
expiry has passed before the next step, so every step's outcome is decided.

Two tests: one derandomized (the same examples on every run) and one from a random seed,
printed, that MARBLES_MODEL_SEED replays. The interleavings that found faults of issue 16
are replayed on their own too (test_store_model_interleaving); KNOWN_OPEN names the faults
not fixed yet, whose interleavings are skipped.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import redis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from marbles_rq.engine import fanout
from marbles_rq.engine.execution import Execution, event
from marbles_rq.engine.runs import RunStore
from marbles_rq.engine.waits import (
    AlreadyAnsweredError,
    NotPausedError,
    UnknownQuestionError,
    WaitStore,
)
from marbles_rq.errors import MarblesError
from marbles_rq.flow import limit_specs, limits
from marbles_rq.store import open_store
from marbles_rq.store.records import AskRecord, RunRecord, StepRecord

# Faults this test found that are not fixed yet. Each one skips only the interleaving that
# shows it, so the invariant stays; drop the name once its fix is merged (INTERLEAVINGS
# replays each). The faults it found earlier (issue 16 items 1, 3, 5 and 6, an answer's
# wake lost to a child's, a cancelled start that walked no children, and a child recorded
# after its parent's cancel, end or purge) are fixed, and test_store_model_interleaving
# replays each.
KNOWN_OPEN: set[str] = {
    # RunStore.renew now renews the slot (renew_slot) before the lease (renew_attempt),
    # and renew_slot is fenced by the delivery number only: a fenced execution (reaped,
    # or superseded by a start of the same delivery) takes its run's lapsed or freed slot
    # again (ZADD/HSET of the hold) before renew_attempt answers stale; the hold then
    # counts against the limit until that execution exits or the hold expires. Skipped:
    # a renewal by a stale execution whose renew_slot would answer ok.
    "stale-renew-slot",
}

PREFIX = "model"
LONG_MS = 600_000  # a lease that does not expire during an example
HOUR_MS = 3_600_000
TERMINAL = ("succeeded", "failed", "cancelled")
MAX_TOP_RUNS = 2
MAX_CHILDREN = 3
MAX_RUNS = 10
MAX_DELIVERIES = 20
CTL_EPOCH = 1

# Each test: EXAMPLES interleavings of up to STEPS steps (about 50 steps each; 150 take
# about 30-45 s on the loaded 2-core machine, more under heavier load: the file stays
# within 2 minutes of CI; 200 took 80-130 s for the file). MARBLES_MODEL_EXAMPLES /
# MARBLES_MODEL_STEPS search longer (with pytest --timeout=0: a test's default cap is 300 s).
EXAMPLES = int(os.environ.get("MARBLES_MODEL_EXAMPLES", "150"))
STEPS = int(os.environ.get("MARBLES_MODEL_STEPS", "60"))


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class MExec:
    """One execution (a started delivery) as the model knows it."""

    ex: Execution
    worker: str
    expired: bool  # its lease (and slot) expired: it was frozen past them
    saw_paused: bool = False  # a commit or step start answered "paused": the body parks
    # The questions open when it started: its body, replaying, asks them again and parks
    # on them (it reads the answers once, at its first ask).
    open_questions: list[str] = field(default_factory=list)
    # The child it noted in its parent's ledger (note_child) and has not recorded yet: the
    # body is inside start_child, so it makes no other body call meanwhile.
    pending_child: tuple[str, str] | None = None  # (its ledger key, the child's id)
    ended: bool = False  # its body never runs again (a child stopped for its parent's cancel)
    watchdog: bool = True  # its lease renewals go on (a renewal answered non-ok: stopped)
    out_index: int = 0  # its next output write's index in the body's frame (replay: from 0)


@dataclass
class MRun:
    id: str
    parent: str | None
    limited: bool
    status: str = "queued"
    attempt: int = 1  # the delivery number (the hash's field; status shows 1 + redeliveries)
    epoch: int = 0
    deferred: int = 0
    resumptions: int = 0  # wakes after a park (answer, wake, resume, a park that requeues)
    started: bool = False  # an execution started once (started_ms)
    start_seen: tuple[int, int] = (0, 0)  # (attempt, resumptions) its last start saw
    worker: str | None = None  # the hash's worker: what a lost worker's reap compares
    outputs: int = 0  # output lines in its stream
    out_written: int = 0  # positions of the body's frame written (a replay writes none again)
    pause: bool = False
    cancel: bool = False
    wake_pending: str | None = None
    wake_at: int = 0
    waits_children: bool = False  # parked waiting for children (a settled child wakes it)
    lease: str | None = None  # live | expired, while running
    questions: dict[str, str] = field(default_factory=dict)  # key -> open|answered|...
    children: list[str] = field(default_factory=list)  # recorded with this run as parent
    ledger_children: list[str] = field(default_factory=list)  # ...and in its ledger
    execs: list[MExec] = field(default_factory=list)
    effects: set[str] = field(default_factory=set)
    purged: bool = False
    final: tuple[Any, ...] | None = None  # the terminal record as first seen
    seen_epoch: int = 0
    parent_cancelled: bool = False  # its parent was cancelled (the cascade reached it)
    steps: int = 0


class StoreModel(RuleBasedStateMachine):
    """The runs' transitions in any order, each checked against the model."""

    url = ""

    def __init__(self) -> None:
        super().__init__()
        client = redis.Redis.from_url(self.url)
        client.flushall()
        client.close()
        self.runs = RunStore(open_store(self.url, prefix=PREFIX, buckets=4))
        self.waits = WaitStore(self.runs)
        self.client: Any = self.runs.client
        self.keys = self.runs.keys
        self.model: dict[str, MRun] = {}
        self.order: list[str] = []
        self.n = 0

    def teardown(self) -> None:
        self.client.close()

    # -- helpers ---------------------------------------------------------------------------

    def _next(self) -> int:
        self.n += 1
        return self.n

    def _pick(self, i: int, pred: Any = None) -> MRun | None:
        """Mostly a live run (three choices in four), else any, finished and purged ones
        included: what happens to those matters as much, but they pile up."""
        found = [self.model[r] for r in self.order if pred is None or pred(self.model[r])]
        live = [r for r in found if not r.purged and r.status not in TERMINAL]
        if live and i % 4 != 3:
            return live[(i // 4) % len(live)]
        return found[i % len(found)] if found else None

    def _server_ms(self) -> int:
        sec, usec = self.client.time()
        return int(sec) * 1000 + int(usec) // 1000

    def _await_past(self, ms: int) -> None:
        """Wait until the server clock is past `ms` (a 1 ms lease or slot has expired)."""
        deadline = time.monotonic() + 5
        while self._server_ms() <= ms:
            assert time.monotonic() < deadline, "the server clock does not move"
            time.sleep(0.001)

    def _terminal(self, m: MRun) -> bool:
        return m.status in TERMINAL

    def _limit_keys(self) -> tuple[str, str]:
        lid = limit_specs.limit_id("limited", "")
        return self.keys.limit_slots(lid), self.keys.limit_holders(lid)

    def _run_keys(self, m: MRun) -> list[str]:
        k = self.keys.run_keys(m.id)
        return [k.run, k.steps, k.output, k.asks, k.reports, k.effects,
                *(self.keys.effect(m.id, e) for e in ("e0", "e1"))]

    def _snapshot(self, m: MRun) -> Any:
        """Everything of a run in the store (its own keys and its index entries)."""
        k = self.keys.run_keys(m.id)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(k.run)
        pipe.hgetall(k.steps)
        pipe.xrange(k.output)
        pipe.hgetall(k.asks)
        pipe.hgetall(k.reports)
        pipe.smembers(k.effects)
        for e in ("e0", "e1"):
            pipe.hgetall(self.keys.effect(m.id, e))
        for z in (k.listing, k.leases, k.dispatch, k.waits, k.finished):
            pipe.zscore(z, m.id)
        slots, holders = self._limit_keys()
        pipe.zscore(slots, m.id)
        pipe.hget(holders, m.id)
        return pipe.execute()

    def _stale_call(self, m: MRun, x: MExec, call: Any) -> Any:
        """Make an execution's call; a stale one (its epoch is not the run's, or the run is
        gone) must write nothing of its run."""
        current = self.client.hget(self.keys.run(m.id), "epoch")
        stale = current is None or int(current) != x.ex.epoch
        before = self._snapshot(m) if stale else None
        result = call()
        if stale:
            after = self._snapshot(m)
            assert after == before, (
                f"stale epoch {x.ex.epoch} of run {m.id} (store epoch "
                f"{_s(current) if current else 'none: purged'}) wrote: {before!r} -> {after!r}")
        return result

    def _exec(self, m: MRun, j: int) -> MExec:
        """Mostly the run's current execution, else any of its executions (stale ones)."""
        current = [x for x in m.execs if x.ex.epoch == m.epoch and not m.purged]
        if current and j % 4 != 3:
            return current[0]
        return m.execs[j % len(m.execs)]

    def _is_current(self, m: MRun, x: MExec) -> bool:
        return not m.purged and x.ex.epoch == m.epoch

    def _body(self, x: MExec) -> bool:
        """Whether the execution's body can make a call now: not inside start_child (between
        its note and its record), and it ran at all."""
        return x.pending_child is None and not x.ended

    def _release(self, x: MExec) -> None:
        if x.ex.slot is not None:
            x.ex.slot.release()  # as the engine does whenever an execution ends

    def _settle_stopped(self, m: MRun, x: MExec) -> None:
        """engine/execute.settle_stopped for a cancel: settle cancelled (refused once the
        lease expired: the reaper settles it then), and its children with it."""
        reply = self.runs.settle(x.ex, "cancelled")
        self._release(x)
        if not self._is_current(m, x) or m.status != "running":
            assert reply in ("stale", "settled"), reply
            return
        if m.lease == "expired":
            assert reply == "stale", reply
            return
        assert reply == "ok", reply
        self._settled_now(m, "cancelled")
        self._cascade(m)

    def _settled_now(self, m: MRun, status: str) -> None:
        m.status = status
        m.epoch += 1
        m.lease = None
        m.cancel = m.cancel or status == "cancelled"
        for key, state in m.questions.items():
            if state == "open" and status == "cancelled":
                m.questions[key] = "cancelled"

    def _woken(self, m: MRun) -> None:
        m.status = "queued"
        m.attempt += 1
        m.deferred += 1
        m.resumptions += 1
        m.wake_pending = None
        m.wake_at = 0

    def _cascade(self, parent: MRun) -> None:
        """cancel_children: what the parent's ledger names, at any depth."""
        self.waits.cancel_children(parent.id)
        todo = list(parent.ledger_children)
        seen: set[str] = set()
        while todo:
            cid = todo.pop()
            if cid in seen:
                continue
            seen.add(cid)
            if cid not in self.model:
                continue  # noted, not recorded yet: cancel_run finds no run
            c = self.model[cid]
            c.parent_cancelled = True
            if not c.purged:
                if c.status == "running":
                    c.cancel = True
                elif c.status in ("queued", "waiting"):
                    self._settled_now(c, "cancelled")
            todo += c.ledger_children

    def _wake_model(self, m: MRun, cause: str, now_ms: int) -> str:
        if m.purged or m.status not in ("running", "waiting"):
            return "idle"
        if m.status == "running":
            # A child's wake never lowers an answer's ('1'): the run may park on that
            # answered question again, and only the answer's wake requeues it then.
            if cause == "child" and m.wake_pending != "1":
                m.wake_pending = "child"
            return "pending"
        if m.pause:
            return "paused"
        if cause == "child" and not m.waits_children:
            return "idle"  # a settled child wakes only a run that waits for children
        if cause == "timer":
            if m.wake_at == 0:
                return "idle"
            if m.wake_at > now_ms:
                return "not_due"
        self._woken(m)
        return "woken"

    def _after_settle(self, m: MRun, x: MExec, status: str) -> None:
        """What the engine does once an execution settled its run."""
        if status == "cancelled":
            self._cascade(m)
        self._wake_parent(m)

    def _wake_parent(self, m: MRun) -> None:
        if m.parent is not None:
            parent = self.model[m.parent]
            fanout.wake_parent(self.runs, m.parent, m.id, None)
            self._wake_model(parent, "child", self._server_ms())

    # -- rules: recording ------------------------------------------------------------------

    @initialize(first=st.booleans(), second=st.booleans())
    def two_runs(self, first: bool, second: bool) -> None:
        self.claim(first)
        self.claim(second)

    @precondition(lambda self: len(self.model) < MAX_RUNS and sum(
        1 for r in self.model.values() if r.parent is None and r.status not in TERMINAL)
        < MAX_TOP_RUNS)
    @rule(limited=st.booleans())
    def claim(self, limited: bool) -> None:
        rid = f"r{self._next()}"
        record = RunRecord(version=1, id=rid, name="limited" if limited else "plain",
                           queue="default", input=msgspec.Raw(b"{}"),
                           requested_at_ms=int(time.time() * 1000), retention_s=0.0,
                           max_deliveries=MAX_DELIVERIES, concurrency=1 if limited else 0)
        recorded = self.runs.record(record)
        assert recorded.created
        self.model[rid] = MRun(rid, None, limited)
        self.order.append(rid)

    def _children_started(self) -> int:
        pending = sum(1 for r in self.model.values() for x in r.execs if x.pending_child)
        return pending + sum(1 for r in self.model.values() if r.parent)

    @precondition(lambda self: any(r.execs for r in self.model.values())
                  and self._children_started() < MAX_CHILDREN)
    @rule(i=st.integers(0, 50), j=st.integers(0, 50), whole=st.booleans())
    def child_note(self, i: int, j: int, whole: bool) -> None:
        """fanout.start_child's first write: note_child names the child in the parent's ledger
        (fenced: a stale, finished, cancel-requested or paused parent notes none). `whole`:
        the child is recorded and its entry committed at once; else later (child_record),
        whatever happens meanwhile (a frozen parent)."""
        parent = self._pick(i, lambda r: bool(r.execs))
        assert parent is not None
        x = self._exec(parent, j)
        if not self._body(x):
            return
        cid = f"{parent.id}.c{self._next()}"
        note = StepRecord(version=1, key=f"|child#{self.n}", name="|child", status="running",
                          attempts=1, result=msgspec.Raw(msgspec.json.encode(
                              {"id": cid, "workflow": "plain"})), seq=self.n)
        status = self._stale_call(parent, x, lambda: self.runs.note_child(x.ex, note))
        if parent.purged or x.ex.epoch != parent.epoch:
            assert status == "stale", status
        elif parent.status != "running":
            assert status == "settled", status
        elif parent.cancel:
            assert status == "cancelled", status
        elif parent.pause:
            assert status == "paused", status
            x.saw_paused = True
        else:
            assert status == "ok", status
        if status != "ok":
            assert self.client.exists(self.keys.run(cid)) == 0
            return
        parent.ledger_children.append(cid)
        x.pending_child = (note.key, cid)
        if whole:
            self._child_record(parent, x)

    @precondition(lambda self: any(x.pending_child for r in self.model.values()
                                   for x in r.execs))
    @rule(i=st.integers(0, 50))
    def child_record(self, i: int) -> None:
        """The rest of start_child: record the child (parent set), commit its |child entry."""
        found = [(self.model[r], x) for r in self.order for x in self.model[r].execs
                 if x.pending_child]
        parent, x = found[i % len(found)]
        self._child_record(parent, x)

    def _child_record(self, parent: MRun, x: MExec) -> None:
        assert x.pending_child is not None
        (key, cid), x.pending_child = x.pending_child, None
        record = RunRecord(version=1, id=cid, name="plain", queue="default",
                           input=msgspec.Raw(b"{}"), requested_at_ms=int(time.time() * 1000),
                           retention_s=0.0, max_deliveries=MAX_DELIVERIES, parent=parent.id)
        created = self.runs.record(record).created
        exists = self.client.exists(self.keys.run(cid)) == 1
        assert created == exists
        assert created
        child = MRun(cid, parent.id, False)
        self.model[cid] = child
        self.order.append(cid)
        if not parent.purged:
            parent.children.append(cid)
        # engine/fanout.start_child: after the record the parent's execution reads its own run;
        # finished, cancelled or asked to be, or purged, it cancels the child at once instead
        # of delivering it (a cancel's walk may have passed before the child existed, and a
        # parent that finished or is gone would never gather it).
        stopped = parent.purged or self._terminal(parent) or parent.cancel
        assert self.runs.parent_stopped(parent.id) == stopped, (parent, stopped)
        if stopped:
            assert self.runs.cancel(cid, f"its parent {parent.id} stopped") == "cancelled"
            self._settled_now(child, "cancelled")
            child.parent_cancelled = True
        entry = StepRecord(version=1, key=key, name="|child", status="succeeded", attempts=1,
                           result=msgspec.Raw(msgspec.json.encode({"id": cid,
                                                                   "workflow": "plain"})),
                           seq=self.n)
        self._commit(parent, x, entry)

    # -- rules: executing ------------------------------------------------------------------

    @rule(i=st.integers(0, 50), short=st.booleans(), old=st.booleans())
    def start(self, i: int, short: bool, old: bool) -> None:
        """A delivery starts (limits.start: a slot first for a limited run). `old`: the
        delivery before the current one; `short`: its lease expires at once."""
        m = self._pick(i)
        if m is None:
            return
        p = self.model[m.parent] if m.parent is not None else None
        attempt = m.attempt - 1 if old and m.attempt > 1 else m.attempt
        stale_delivery = attempt != m.attempt
        worker = f"w{self._next()}"
        started = limits.start(self.runs, m.id, attempt, ttl_ms=1 if short else LONG_MS,
                                worker=worker)
        s = started.status
        if m.purged:
            assert s == "missing", s
            return
        if self._terminal(m):
            assert s == "settled", s
            return
        if m.status == "waiting":
            assert s == "waiting", s
            return
        if stale_delivery:
            assert s == "stale_attempt", s
            return
        if m.status == "running" and m.lease == "live":
            assert s == "busy", s
            return
        if m.cancel:
            assert s == "cancelled", s
            self._settled_now(m, "cancelled")
            # engine/execute: a start that settles the run cancelled walks its children, as
            # every cancelled settle does (a child recorded after the cancel's walk).
            self._cascade(m)
            return
        if m.pause:
            assert s == "paused", s
            m.status, m.epoch, m.lease, m.wake_at = "waiting", m.epoch + 1, None, 0
            m.waits_children = False
            m.worker = None
            return
        if s == "held":
            assert m.limited, s
            if m.status == "queued":
                m.attempt += 1
                m.deferred += 1
            return
        assert s == "ok", s
        x = started.execution
        assert x is not None
        m.status, m.epoch, m.worker = "running", m.epoch + 1, worker
        assert x.epoch == m.epoch
        # Item 9: attempt is 1 + redeliveries, resumptions count wakes, and the kind says
        # what made this execution.
        tries = max(1, m.attempt - m.deferred)
        kind = "first"
        if m.started:
            kind = ("redelivery" if tries > m.start_seen[0] else
                    "resumption" if m.resumptions > m.start_seen[1] else "handback")
        assert (x.tries, x.resumptions, x.kind) == (tries, m.resumptions, kind), (
            m.id, x.tries, x.resumptions, x.kind, tries, m.resumptions, kind)
        m.started, m.start_seen = True, (tries, m.resumptions)
        m.lease = "expired" if short else "live"
        mx = MExec(x, worker, short,
                   open_questions=sorted(k for k, v in m.questions.items() if v == "open"))
        m.execs.append(mx)
        if m.parent is not None:
            # engine/execute: a child whose parent is cancelled (or asked to be) cancels
            # itself before its body (its cancel's walk may have missed it).
            assert p is not None
            cancelled = not p.purged and (p.status == "cancelled" or (
                p.cancel and not self._terminal(p)))
            assert self.runs.parent_cancelled(p.id) == cancelled, (p, cancelled)
            if cancelled:
                mx.ended, mx.watchdog = True, False
                assert self.runs.cancel(m.id, "its parent was cancelled") == "requested"
                m.cancel = True
                if short:
                    self._await_past(self._expiry(m, x))
                self._settle_stopped(m, mx)
                return
            assert not (p.final is not None and p.final[0] == "cancelled"), (
                f"child {m.id} starts its body though its parent {p.id} was cancelled")
        if short:
            # Frozen past its lease: wait for the expiry, then it goes on with a normal one.
            self._await_past(self._expiry(m, x))
            if x.slot is not None:
                x.slot.ttl_ms = LONG_MS
            x.ttl_ms = LONG_MS

    def _expiry(self, m: MRun, x: Execution) -> int:
        """The later of the execution's lease and slot expiries (server ms)."""
        expiry = [self.client.zscore(self.keys.run_keys(m.id).leases, m.id)]
        if x.slot is not None:
            expiry.append(self.client.zscore(self._limit_keys()[0], m.id))
        return int(max(e or 0 for e in expiry))

    def _commit(self, m: MRun, x: MExec, record: StepRecord) -> str:
        status: str = self._stale_call(m, x, lambda: self.runs.commit_step(
            x.ex, record, "step_succeeded", event(step=record.key)))
        if m.purged or x.ex.epoch != m.epoch:
            assert status == "stale", status
        elif m.status != "running":
            assert status == "settled", status
        elif m.lease == "expired":
            assert status == "stale", status  # item 6: an expired lease commits nothing
        elif m.cancel:
            assert status == "cancelled", status
        elif m.pause:
            assert status == "paused", status
            x.saw_paused = True
        else:
            assert status == "ok", status
        return status

    def _step(self, m: MRun) -> StepRecord:
        m.steps += 1
        return StepRecord(version=1, key=f"s{m.steps}#0", name="s", status="succeeded",
                          attempts=1, result=msgspec.Raw(b"1"), seq=self._next())

    @precondition(lambda self: any(r.execs for r in self.model.values()))
    @rule(i=st.integers(0, 50), j=st.integers(0, 50))
    def commit(self, i: int, j: int) -> None:
        m = self._pick(i, lambda r: bool(r.execs))
        assert m is not None
        x = self._exec(m, j)
        if self._body(x):
            self._commit(m, x, self._step(m))

    @precondition(lambda self: any(r.execs for r in self.model.values()))
    @rule(i=st.integers(0, 50), j=st.integers(0, 50),
          what=st.sampled_from(["start_step", "output", "output_thread", "effect:e0",
                                "effect:e1"]))
    def write(self, i: int, j: int, what: str) -> None:
        """A fenced write other than a commit: a step's start, an output line (at its
        position in the body, or from a thread the body started: none), an effect."""
        m = self._pick(i, lambda r: bool(r.execs))
        assert m is not None
        x = self._exec(m, j)
        if not self._body(x):
            return
        if what == "start_step":
            self._start_step(m, x)
        elif what.startswith("output"):
            self._output(m, x, positioned=what == "output")
        else:
            self._claim_effect(m, x, what.split(":")[1])

    def _start_step(self, m: MRun, x: MExec) -> None:
        record = msgspec.structs.replace(self._step(m), status="running", attempts=0)
        status = self._stale_call(m, x, lambda: self.runs.start_step(x.ex, record))
        if m.purged or x.ex.epoch != m.epoch:
            assert status == "stale", status
        elif m.status != "running":
            assert status == "settled", status
        elif m.cancel:
            assert status == "cancelled", status
        elif m.pause:
            assert status == "paused", status
            x.saw_paused = True
        else:
            assert status == "ok", status

    def _output(self, m: MRun, x: MExec, *, positioned: bool) -> None:
        """Item 9: a write at a position the run's earlier executions wrote (a replay) is
        not written again; one with no position always is. An expired lease still writes
        output (only commits, settles and renewals check it)."""
        position = ("body", x.out_index) if positioned else None
        if positioned:
            x.out_index += 1
        status = self._stale_call(m, x, lambda: self.runs.write(x.ex, "output", b'"line"',
                                                                position=position))
        if m.purged or x.ex.epoch != m.epoch:
            assert status == "stale", status
        elif m.status != "running":
            assert status == "settled", status
        elif position is not None and position[1] < m.out_written:
            assert status == "replayed", status
        else:
            assert status == "ok", status
            m.outputs += 1
            if position is not None:
                m.out_written = position[1] + 1

    def _claim_effect(self, m: MRun, x: MExec, key: str) -> None:
        # Item 3: refused once the run hash is gone (purged). Fenced by the lease too, as a
        # commit is: an execution whose lease expired claims nothing (lua/claim_effect.lua).
        status = self._stale_call(m, x, lambda: self.runs.claim_effect(x.ex, key))
        if (m.purged or x.ex.epoch != m.epoch or self._terminal(m)
                or m.lease == "expired"):
            assert status == "stale_epoch", status
        elif key in m.effects:
            assert status == "exists", status
        else:
            assert status == "ok", status
            m.effects.add(key)

    def _slot_renewal(self, m: MRun, x: MExec) -> str | None:
        """What renew_slot will answer for the execution's slot (None: no slot, or released):
        stale (a newer delivery holds it), lost (it lapsed and every slot is held), ok."""
        slot = x.ex.slot
        if slot is None or slot._released:
            return None
        slots, holders = self._limit_keys()
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(holders, m.id)
        pipe.zscore(slots, m.id)
        pipe.zrange(slots, 0, -1, withscores=True)
        holder, score, held = pipe.execute()
        now = self._server_ms()
        if int(_s(holder or b"0|").split("|")[0]) > slot.attempt:
            return "stale"
        live = sum(1 for _, expiry in held if expiry > now)
        if (score is None or score <= now) and live >= slot.limit.limit:
            return "lost"
        return "ok"

    @precondition(lambda self: any(r.execs for r in self.model.values()))
    @rule(i=st.integers(0, 50), j=st.integers(0, 50))
    def renew(self, i: int, j: int) -> None:
        """The watchdog renews the slot, then the lease capped at the slot's expiry."""
        m = self._pick(i, lambda r: bool(r.execs))
        assert m is not None
        x = self._exec(m, j)
        if not x.watchdog:
            return  # a renewal answered non-ok: the watchdog stopped
        slot = self._slot_renewal(m, x)
        if slot == "ok" and not self._is_current(m, x) and (
                "stale-renew-slot" in KNOWN_OPEN):
            return  # see KNOWN_OPEN: a fenced execution's renewal writes its run's slot
        status = self._stale_call(m, x, lambda: self.runs.renew(x.ex))
        if slot is not None and x.ex.slot is not None:
            # Item 6: a lapsed hold is not retaken while every slot is held (lost: the
            # lease renewal is then capped at 1, which fences the execution).
            assert (x.ex.slot.until == 1) == (slot != "ok"), (slot, x.ex.slot.until)
        if status != "ok":
            x.watchdog = False
        if m.purged or x.ex.epoch != m.epoch:
            assert status == "stale", status
        elif m.status != "running":
            assert status == "settled", status
        elif m.cancel:
            assert status == "cancelled", status
            # The watchdog settles it (settle_stopped); the body stops.
            x.ended = True
            self._settle_stopped(m, x)
            if m.status == "cancelled":
                self._wake_parent(m)
        elif m.lease == "expired" or slot in ("lost", "stale"):
            # Item 6: a lease that expired (or whose slot is lost) ends the execution: the
            # renewal fences it (epoch + 1); the reaper redelivers the run.
            assert status == "expired", status
            m.epoch += 1
            m.lease = "expired"
        else:
            assert status == "ok", status
        if status != "ok":
            self._release(x)

    @precondition(lambda self: any(r.execs for r in self.model.values()))
    @rule(i=st.integers(0, 50), j=st.integers(0, 50),
          status=st.sampled_from(["succeeded", "failed", "cancelled"]))
    def settle(self, i: int, j: int, status: str) -> None:
        m = self._pick(i, lambda r: bool(r.execs))
        assert m is not None
        x = self._exec(m, j)
        if not self._body(x):
            return
        result = b'"done"' if status == "succeeded" else None
        reply = self._stale_call(m, x, lambda: self.runs.settle(x.ex, status, result=result))
        self._release(x)  # as the engine does whatever the outcome
        if self._terminal(m) and not m.purged:
            assert reply == "settled", reply
            return
        if m.purged or x.ex.epoch != m.epoch:
            assert reply == "stale", reply
            return
        if m.lease == "expired":
            assert reply == "stale", reply  # item 6: an expired lease settles nothing
            return
        assert reply == "ok", reply
        self._settled_now(m, status)
        self._after_settle(m, x, status)

    @precondition(lambda self: any(r.execs for r in self.model.values()))
    @rule(i=st.integers(0, 50), j=st.integers(0, 50),
          kind=st.sampled_from(["question", "question_again", "timer_due", "timer_later",
                                "child", "paused"]))
    def park(self, i: int, j: int, kind: str) -> None:
        m = self._pick(i, lambda r: bool(r.execs))
        assert m is not None
        x = self._exec(m, j)
        if not self._body(x):
            return
        if x.saw_paused:
            kind = "paused"  # a write answered "paused": the body parks for the pause
        elif kind == "paused":
            return  # the body parks on a pause only once a write answered "paused"
        if kind == "child" and not m.children:
            return
        if kind == "question_again" and not x.open_questions:
            return
        now = x.ex.server_now_ms()
        asks: list[AskRecord] = []
        ledger: list[StepRecord] = []
        wait_for: dict[str, Any] = {}
        wake_at = 0
        reason = kind
        if kind.startswith("question"):
            reason = "question"
            qkey = x.open_questions[0] if kind == "question_again" else f"q{self._next()}"
            asks = [AskRecord(version=1, key=qkey, ask="question", title="ok?")]
            wait_for = {"questions": [qkey]}
        elif kind.startswith("timer"):
            reason = "timer"
            wake_at = x.ex.server_ms - 1 if kind == "timer_due" else now + HOUR_MS
            ledger = [StepRecord(version=1, key=f"|sleep#{self._next()}", name="|sleep",
                                 status="waiting", attempts=0, seq=self.n,
                                 result=msgspec.Raw(msgspec.json.encode({"due_ms": wake_at})))]
            wait_for = {"until_ms": wake_at}
        elif kind == "child":
            wait_for = {"children": [m.children[-1]]}
            wake_at = now + HOUR_MS  # the controller's next check of the child
        status, _, _ = self._stale_call(m, x, lambda: self.waits.park(
            x.ex, reason=reason, wake_at_ms=wake_at, wait_for=wait_for, ledger=ledger,
            asks=asks))
        if status in ("ok", "requeued"):
            self._release(x)
        if m.purged or x.ex.epoch != m.epoch:
            assert status == "stale", status
            return
        if m.status != "running":
            assert status == "settled", status
            return
        if m.cancel:
            assert status == "cancelled", status
            # The engine settles it cancelled (settle_stopped) and cancels its children; an
            # expired lease settles nothing (the reaper does).
            x.ended = True
            self._settle_stopped(m, x)
            if m.status == "cancelled":
                self._wake_parent(m)
            return
        m.epoch += 1
        m.lease = None
        m.worker = None
        for a in asks:
            m.questions.setdefault(a.key, "open")
        # Item 1: a park for a pause that a resume lifted meanwhile requeues at once.
        lifted = kind == "paused" and not m.pause
        pending = lifted or m.wake_pending == "1" or (
            m.wake_pending == "child" and kind == "child")
        if m.wake_pending and not pending and not m.pause:
            m.wake_pending = None
        if pending and not m.pause:
            assert status == "requeued", status
            self._woken(m)
            return
        assert status == "ok", status
        m.status, m.wake_at = "waiting", wake_at
        m.waits_children = "children" in wait_for

    # -- rules: from outside ---------------------------------------------------------------

    @rule(i=st.integers(0, 50), cause=st.sampled_from(["timer", "child"]))
    def wake(self, i: int, cause: str) -> None:
        m = self._pick(i)
        if m is None:
            return
        status, _, _ = self.waits.wake(m.id, cause)
        expected = self._wake_model(m, cause, self._server_ms())
        assert status == expected, (status, expected)

    @precondition(lambda self: any(r.questions for r in self.model.values()))
    @rule(i=st.integers(0, 50), q=st.integers(0, 50))
    def answer(self, i: int, q: int) -> None:
        m = self._pick(i, lambda r: bool(r.questions))
        assert m is not None
        keys = sorted(m.questions)
        key = keys[q % len(keys)]
        try:
            answered = self.waits.answer(m.id, key, "yes", kind="question")
        except MarblesError as exc:
            if m.purged:
                assert exc.code == "run_not_found", exc
            else:
                assert isinstance(exc, AlreadyAnsweredError | UnknownQuestionError), exc
                assert m.questions[key] != "open" or self._terminal(m), exc
            return
        assert not m.purged and m.questions[key] == "open" and not self._terminal(m)
        m.questions[key] = "answered"
        if m.status == "waiting" and not m.pause:
            assert answered.woken_attempt == m.attempt + 1
            self._woken(m)
        else:
            assert answered.woken_attempt == 0
            if m.status == "running":
                m.wake_pending = "1"

    @rule(i=st.integers(0, 50))
    def pause(self, i: int) -> None:
        m = self._pick(i)
        if m is None:
            return
        try:
            status = self.waits.pause(m.id)
        except MarblesError as exc:
            assert m.purged and exc.code == "run_not_found", exc
            return
        if self._terminal(m):
            assert status == "settled", status
        elif m.pause:
            assert status == "already", status
        else:
            m.pause = True
            assert status == ("paused" if m.status == "waiting" else "requested"), status

    @rule(i=st.integers(0, 50))
    def resume(self, i: int) -> None:
        m = self._pick(i)
        if m is None:
            return
        try:
            status, attempt, _ = self.waits.resume(m.id)
        except NotPausedError:
            assert not m.purged and not self._terminal(m) and not m.pause
            return
        except MarblesError as exc:
            assert m.purged and exc.code == "run_not_found", exc
            return
        if self._terminal(m):
            assert status == "settled", status
            return
        assert m.pause, status
        m.pause = False
        if m.status == "waiting":
            assert (status, attempt) == ("woken", m.attempt + 1), status
            self._woken(m)
        else:
            assert status == "resumed", status

    @rule(i=st.integers(0, 50))
    def cancel(self, i: int) -> None:
        """The CLI's cancel: the run, then the children its ledger names."""
        m = self._pick(i)
        if m is None:
            return
        status = self.runs.cancel(m.id)
        if m.purged:
            assert status == "missing", status
            return
        if self._terminal(m):
            assert status == "settled", status
            return
        if m.status == "running":
            assert status == "requested", status
            m.cancel = True
        else:
            assert status == "cancelled", status
            # A cancel from outside wakes no parent: its wait has the controller's check.
            self._settled_now(m, "cancelled")
        self._cascade(m)

    @precondition(lambda self: any(r.execs for r in self.model.values()))
    @rule(i=st.integers(0, 50), j=st.integers(0, 50), lost=st.booleans())
    def reap(self, i: int, j: int, lost: bool) -> None:
        """The controller's reaper: an expired lease, or (lost) the worker of an execution
        stopped beating."""
        m = self._pick(i, lambda r: bool(r.execs))
        assert m is not None
        x = self._exec(m, j)
        keys = self.keys.run_keys(m.id)
        reply = self.runs.scripts.reap_run(
            keys=keys, run_id=m.id, ctl_epoch=CTL_EPOCH, grace_ms=5000,
            final_cancel=event(status="cancelled"), final_gave_up=event(status="failed"),
            worker=x.worker if lost else "")
        if reply.status == "redelivered" and reply.values[2]:
            limits.release_vanished(self.runs, m.id, int(reply.values[0]) - 1,
                                     _s(reply.values[2]))
        elif reply.status in ("gave_up", "cancelled") and reply.values[1]:
            # Item 6: a settled run's slot is freed at once, a cancelled one's too.
            limits.release_vanished(self.runs, m.id, int(reply.values[0]),
                                     _s(reply.values[1]))
        if m.purged or m.status != "running":
            assert reply.status == "gone", reply
            return
        if lost and m.worker != x.worker:
            assert reply.status == "not_expired", reply
            return
        if not lost and m.lease != "expired":
            assert reply.status == "not_expired", reply
            return
        if m.cancel:
            assert reply.status == "cancelled", reply
            self._settled_now(m, "cancelled")
            # Item 6: the controller cancels its children, as every cancelled settle does.
            self._cascade(m)
            return
        if m.attempt - m.deferred >= MAX_DELIVERIES:
            assert reply.status == "gave_up", reply
            self._settled_now(m, "failed")
            return
        assert reply.status == "redelivered", reply
        m.status, m.attempt, m.epoch, m.lease = "queued", m.attempt + 1, m.epoch + 1, None

    @rule(i=st.integers(0, 50), old=st.booleans())
    def redeliver(self, i: int, old: bool) -> None:
        """The controller found a queued run's delivery lost inside RQ."""
        m = self._pick(i)
        if m is None:
            return
        attempt = m.attempt - 1 if old else m.attempt
        reply = self.runs.scripts.redispatch_run(
            keys=self.keys.run_keys(m.id), run_id=m.id, attempt=attempt, ctl_epoch=CTL_EPOCH,
            grace_ms=5000, final_gave_up=event(status="failed"))
        if m.purged or m.status != "queued" or attempt != m.attempt:
            assert reply.status == "moved", reply
            return
        if m.attempt - m.deferred >= MAX_DELIVERIES:
            assert reply.status == "gave_up", reply
            self._settled_now(m, "failed")
            return
        assert reply.status == "redelivered", reply
        m.attempt, m.epoch = m.attempt + 1, m.epoch + 1

    @rule(i=st.integers(0, 50))
    def purge(self, i: int) -> None:
        """The controller's prune of a finished run past its retention (0 s here)."""
        m = self._pick(i)
        if m is None:
            return
        keys = self.keys.run_keys(m.id)
        members = sorted(_s(r) for r in self.client.smembers(keys.effects))
        reply = self.runs.scripts.purge_run(keys=keys, run_id=m.id, receipts=members)
        if m.purged or not self._terminal(m):
            assert reply.status == "not_due", reply
            return
        assert reply.status == "ok", reply
        m.purged = True

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def store_matches_model(self) -> None:
        if not self.order:
            return
        pipe = self.client.pipeline(transaction=False)
        for rid in self.order:
            k = self.keys.run_keys(rid)
            pipe.hgetall(k.run)
            pipe.xrange(k.output)
            pipe.hgetall(k.asks)
            pipe.zscore(k.waits, rid)
            pipe.zscore(k.leases, rid)
        replies = pipe.execute()
        now = self._server_ms()
        for n, rid in enumerate(self.order):
            m = self.model[rid]
            h = {_s(a): _s(b) for a, b in replies[5 * n].items()}
            out = replies[5 * n + 1]
            asks = {_s(a): _s(b) for a, b in replies[5 * n + 2].items()}
            waits_at = replies[5 * n + 3]
            if m.purged:
                continue  # nothing_of_a_purged_run_comes_back
            assert h, f"run {rid} vanished though not purged"
            status, epoch = h["status"], int(h["epoch"])
            # The reference model.
            assert (status, int(h["attempt"]), int(h.get("deferred", 0)),
                    int(h.get("resumptions", 0)), epoch, h.get("pause") == "1") == (
                m.status, m.attempt, m.deferred, m.resumptions, m.epoch, m.pause), (rid, h, m)
            # Item 9: a replayed position is not written again.
            lines = sum(1 for e in out if _s(e[1][b"t"]) == "output")
            assert lines == m.outputs, (rid, lines, m.outputs)
            # Epochs only grow.
            assert epoch >= m.seen_epoch, (rid, epoch, m.seen_epoch)
            m.seen_epoch = epoch
            # One terminal record.
            finals = [e for e in out if _s(e[1][b"t"]) == "final"]
            assert len(finals) == (1 if status in TERMINAL else 0), (rid, status, finals)
            if status in TERMINAL:
                record = (status, h.get("result"), h.get("error"), h.get("finished_ms"),
                          finals[0][0])
                if m.final is None:
                    m.final = record
                assert record == m.final, (rid, m.final, record)
            else:
                assert m.final is None
            # A waiting run has a way out.
            if status == "waiting":
                open_q = any(v == "open" for f, v in asks.items() if f.endswith("|state"))
                wait_for = msgspec.json.decode(h.get("wait_for") or "{}")
                live_child = any(not self.model[c].purged and self.model[c].status
                                 not in TERMINAL for c in wait_for.get("children", []))
                assert (waits_at is not None or h.get("pause") == "1" or open_q
                        or live_child), f"run {rid} waits with no way out: {h}, asks {asks}"
        self._limit_holds(now)

    def _limit_holds(self, now: int) -> None:
        slots, _ = self._limit_keys()
        live = self.client.zcount(slots, f"({now}", "+inf")
        assert live <= 1, (f"{live} live holds of a limit of 1: "
                           f"{self.client.zrange(slots, 0, -1, withscores=True)}")
        pipe = self.client.pipeline(transaction=False)
        limited = [rid for rid in self.order if self.model[rid].limited]
        for rid in limited:
            pipe.hget(self.keys.run(rid), "status")
            pipe.zscore(self.keys.run_keys(rid).leases, rid)
        replies = pipe.execute()
        running = [rid for n, rid in enumerate(limited) if replies[2 * n] == b"running"
                   and replies[2 * n + 1] is not None and replies[2 * n + 1] > now]
        assert len(running) <= 1, f"runs {running} run at once under a limit of 1"

    @invariant()
    def nothing_of_a_purged_run_comes_back(self) -> None:
        purged = [self.model[r] for r in self.order if self.model[r].purged]
        now = self._server_ms() if purged else 0
        for m in purged:
            snap = self._snapshot(m)
            if snap[-2] is None or snap[-2] <= now:
                # An expired slot hold is nobody's: the next acquire prunes it.
                snap[-2:] = [None, None]
            left = [v for v in snap if v not in (None, {}, [], set())]
            assert not left, f"purged run {m.id} has keys again: {snap}"


# Interleavings that showed a fault of issue 16, replayed step by step through the same
# machine (every invariant checked after each step, every reply predicted by the model), so
# each fault is caught on every run and not only when the random search meets it again.
# Each ends with what the fix guarantees, checked on the store itself (EXPECT).
INTERLEAVINGS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    # pause, a commit answers "paused", resume lands before the park: the park requeues.
    "item1": [("claim", dict(limited=False)), ("start", dict(i=0, short=False, old=False)),
              ("pause", dict(i=0)), ("commit", dict(i=0, j=0)), ("resume", dict(i=0)),
              ("park", dict(i=0, j=0, kind="paused"))],
    # A run settles and is purged; its execution, frozen meanwhile, claims an effect: refused.
    "item3": [("claim", dict(limited=False)), ("start", dict(i=0, short=False, old=False)),
              ("settle", dict(i=0, j=0, status="succeeded")), ("purge", dict(i=0)),
              ("write", dict(i=3, j=3, what="effect:e0"))],
    # A parent is cancelled while its execution is inside a step, and settles cancelled; the
    # execution then starts a child: note_child refuses, no child is recorded.
    "item5": [("claim", dict(limited=False)), ("start", dict(i=0, short=False, old=False)),
              ("cancel", dict(i=0)), ("settle", dict(i=0, j=0, status="cancelled")),
              ("child_note", dict(i=3, j=3, whole=True))],
    # A parent notes a child; its cancel walks its ledger before the child is recorded (no
    # such run yet); the child is recorded, and cancels itself when its delivery starts.
    "item5-start": [("claim", dict(limited=False)), ("start", dict(i=0, short=False, old=False)),
                    ("child_note", dict(i=0, j=0, whole=False)), ("cancel", dict(i=0)),
                    ("child_record", dict(i=0)), ("start", dict(i=4, short=False, old=False))],
    # Limit 1: an execution frozen past its lease and slot; another run takes the slot;
    # the frozen one thaws and renews: the slot is lost, the execution fenced.
    "item6": [("claim", dict(limited=True)), ("claim", dict(limited=True)),
              ("start", dict(i=0, short=True, old=False)),
              ("start", dict(i=4, short=False, old=False)), ("renew", dict(i=0, j=0))],
    # A cancel requested while the run executes; its worker is lost and the reaper settles
    # it cancelled and frees its slot; the run is purged with nothing left.
    "item6-reap": [("claim", dict(limited=True)), ("start", dict(i=0, short=False, old=False)),
                   ("cancel", dict(i=0)), ("reap", dict(i=0, j=0, lost=True)),
                   ("purge", dict(i=0))],
    # A run parked on a question is woken (a pause and resume: a child's wake no longer
    # wakes a run that waits for no child) and replays; while it executes the question is
    # answered, then a child settles; it parks on the question again: the answer's wake
    # requeues it.
    "answer-wake-lost": [
        ("claim", dict(limited=False)), ("start", dict(i=0, short=False, old=False)),
        ("child_note", dict(i=0, j=0, whole=True)), ("park", dict(i=0, j=0, kind="question")),
        ("pause", dict(i=0)), ("resume", dict(i=0)),
        ("start", dict(i=0, short=False, old=False)),
        ("answer", dict(i=0, q=0)), ("wake", dict(i=0, cause="child")),
        ("park", dict(i=0, j=0, kind="question_again"))],
    # A parent notes a child; a cancel is requested (its walk finds no child yet); the
    # watchdog's renewal answers cancelled and settles the parent (its walk finds none
    # either); the body, still inside start_child, records the child: it reads its run
    # after the record and cancels the child at once.
    "note-record-cancel": [
        ("claim", dict(limited=False)), ("start", dict(i=0, short=False, old=False)),
        ("child_note", dict(i=0, j=0, whole=False)), ("cancel", dict(i=0)),
        ("renew", dict(i=0, j=0)), ("child_record", dict(i=0))],
    # (Was open as note-record-gap.) A parent's execution, frozen past its lease, notes a
    # child; the reaper redelivers the parent, a new execution succeeds; the frozen one
    # thaws and records the child of a finished parent: it reads its run after the record
    # and cancels the child at once, never delivered.
    "note-record-gap": [
        ("claim", dict(limited=False)), ("start", dict(i=0, short=True, old=False)),
        ("child_note", dict(i=0, j=0, whole=False)), ("reap", dict(i=0, j=0, lost=False)),
        ("start", dict(i=0, short=False, old=False)),
        ("settle", dict(i=0, j=0, status="succeeded")), ("child_record", dict(i=0))],
    # An execution frozen past its lease thaws and claims an effect: refused (stale_epoch),
    # no receipt written.
    "claim-expired": [
        ("claim", dict(limited=False)), ("start", dict(i=0, short=True, old=False)),
        ("write", dict(i=0, j=0, what="effect:e0"))],
    # KNOWN_OPEN stale-renew-slot: limit 1; an execution frozen past its lease and slot is
    # reaped (redelivered, its slot freed); it thaws and its watchdog renews: renew_slot,
    # now before renew_attempt, takes the run's slot again for the fenced execution.
    "stale-renew-slot": [
        ("claim", dict(limited=True)), ("start", dict(i=0, short=True, old=False)),
        ("reap", dict(i=0, j=0, lost=False)), ("renew", dict(i=0, j=3))],
    # A parent, frozen past its lease, notes a child; a cancel is requested (its walk finds
    # no child yet); the child is recorded (its recorder reads the cancel request and
    # cancels it); a new start of the parent's delivery settles it cancelled and walks its
    # children; the parent is purged; the child's start finds it settled. (Found as
    # start-cancel-no-walk, before either fix.)
    "start-cancel-no-walk": [
        ("claim", dict(limited=False)), ("claim", dict(limited=False)),
        ("start", dict(i=0, short=True, old=False)),
        ("child_note", dict(i=0, j=0, whole=False)), ("cancel", dict(i=0)),
        ("child_record", dict(i=0)), ("start", dict(i=0, short=False, old=False)),
        ("purge", dict(i=3)), ("start", dict(i=4, short=False, old=False))],
}


def _expect(machine: StoreModel, item: str) -> None:
    """What the fix of each replayed fault guarantees, read from the store."""
    c, keys = machine.client, machine.keys
    r1 = machine.model["r1"]
    run = {_s(a): _s(b) for a, b in c.hgetall(keys.run("r1")).items()}
    slots, _ = machine._limit_keys()
    if item == "item1":
        assert run["status"] == "queued" and run["resumptions"] == "1", run
        assert c.zscore(keys.run_keys("r1").dispatch, "r1") is not None
    elif item == "item3":
        assert c.exists(keys.effect("r1", "e0"), keys.run_keys("r1").effects) == 0
    elif item == "item5":
        assert not r1.ledger_children and not r1.children
        assert not [k for k in c.hkeys(keys.steps("r1")) if b"|child" in k]
    elif item == "item5-start":
        child = r1.children[0]
        assert _s(c.hget(keys.run(child), "status")) == "cancelled"
        assert not [e for e in c.xrange(keys.run_keys(child).output)
                    if _s(e[1][b"t"]) not in ("queued", "attempt_started", "cancel_requested",
                                                 "final")]
    elif item == "item6":
        x = r1.execs[0]
        assert x.ex.slot is not None and x.ex.slot.until == 1  # renew_slot answered lost
        assert int(run["epoch"]) == x.ex.epoch + 1  # fenced by renew_attempt
    elif item == "item6-reap":
        assert c.zscore(slots, "r1") is None
    elif item == "note-record-cancel":
        child = r1.children[0]
        assert _s(c.hget(keys.run(child), "status")) == "cancelled"
        assert c.zscore(keys.run_keys(child).dispatch, child) is None
    elif item == "claim-expired":
        assert c.exists(keys.effect("r1", "e0"), keys.run_keys("r1").effects) == 0
    elif item == "answer-wake-lost":
        assert run["status"] == "queued" and run["resumptions"] == "2", run


@pytest.mark.parametrize("item", sorted(INTERLEAVINGS))
def test_store_model_interleaving(redis_url: str, item: str) -> None:
    if item in KNOWN_OPEN:
        pytest.skip(f"{item} is open (KNOWN_OPEN)")
    StoreModel.url = redis_url
    machine = StoreModel()
    try:
        for name, args in INTERLEAVINGS[item]:
            getattr(machine, name)(**args)
            machine.store_matches_model()
            machine.nothing_of_a_purged_run_comes_back()
        _expect(machine, item)
    finally:
        machine.teardown()


def _run(url: str, *, derandomize: bool, seed: int | None = None) -> None:
    def factory() -> StoreModel:
        StoreModel.url = url
        return StoreModel()

    if seed is not None:
        factory = hseed(seed)(factory)
    run_state_machine_as_test(factory, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, derandomize=derandomize,
        deadline=None, database=None, print_blob=True,
        # Not Phase.explain: its line tracer makes each replay many times slower.
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def test_store_model_fixed(redis_url: str) -> None:
    """The same interleavings on every run (derandomized)."""
    _run(redis_url, derandomize=True)


def test_store_model_random(redis_url: str) -> None:
    """New interleavings each run; the seed is printed, MARBLES_MODEL_SEED replays it."""
    given = os.environ.get("MARBLES_MODEL_SEED")
    seed = int(given) if given else random.randrange(2**32)
    print(f"store model seed: {seed} (replay: MARBLES_MODEL_SEED={seed})")
    try:
        _run(redis_url, derandomize=False, seed=seed)
    except BaseException as exc:
        exc.add_note(f"store model seed: {seed} (replay: MARBLES_MODEL_SEED={seed})")
        raise

