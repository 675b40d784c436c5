"""The chaos history checker can fail: a hand-made history that is correct passes, and each
kind of violation, planted alone into a copy of it, is reported (tests/chaos/checker.py).
No Redis, no processes: the checker reads only the History it is given."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from marbles_rq.triggers.events import event_key
from tests.chaos.checker import KINDS, check, summary
from tests.chaos.history import (
    AnswerTry,
    ArtifactVersion,
    Cancel,
    Claim,
    Crash,
    Ev,
    Execution,
    Fault,
    History,
    LimitSample,
    LockReceipt,
    OrderSent,
    PauseTry,
    RerunTry,
    RetryTry,
    Run,
    Sent,
    SignalTry,
    Step,
    Submitted,
)
from tests.chaos.names import (
    ARTIFACT_CAS,
    ARTIFACT_PLAIN,
    PRIORITIES,
    RATE_PER_S,
    RETRY_EXHAUST,
    RETRY_MAX_ATTEMPTS,
    RETRY_PATCH,
    SCHEDULES,
    SESSION_SHARED,
    TICK_KEY,
)
from tests.chaos.plan import (
    ARTIFACTS,
    DECOYS,
    LOCKS,
    PUBLISH_WAITS,
    RATE_BURST,
    RATE_BURSTS,
    RETRIES,
    RUN_WEIGHTS,
    SAGAS,
    SESSIONS,
    make_plan,
    order_event,
)

T0 = 1_800_000_000_000
_ids = itertools.count()


class Builder:
    """Builds one run's journal, ledger and receipts as the engine and workloads would."""

    def __init__(self, history: History, rid: str, name: str, input: Any = None, *,
                 parent: str | None = None, start_ms: int = T0) -> None:
        self.h = history
        self.run = Run(rid, name, "queued", input=input, parent=parent)
        history.runs[rid] = self.run
        self.ms = start_ms
        self.epoch = 0
        self.attempt = 1
        self.seq: dict[str, int] = {}
        self.ev("queued", name=name, queue="default")

    def ev(self, type: str, *, at: int | None = None, **data: Any) -> Ev:
        self.ms = at if at is not None else self.ms + 10
        event = Ev(self.ms, 0, type, self.attempt, data)
        self.run.events.append(event)
        return event

    def start(self, worker: str = "host.abcd.100") -> None:
        self.epoch += 1
        self.run.status = "running"
        self.ev("attempt_started", epoch=self.epoch, worker=worker)

    def _seq(self, frame: str) -> int:
        n = self.seq.get(frame, 0)
        self.seq[frame] = n + 1
        return n

    def step(self, key: str, name: str = "cx_link", *, effect: bool = True,
             origin: str = "") -> str:
        rid = self.run.id
        ikey = f"{rid}:{key}"
        self.ev("step_started", step=key, attempt=1)
        band = self.run.queue if not self.run.priority else \
            f"{self.run.queue}~{self.run.priority}"
        self.h.executions.append(Execution(f"x{next(_ids)}", rid, key, self.epoch,
                                           self.attempt, 100, self.ms,
                                           origin or f"cx.{band}"))
        if effect:
            self.h.claims.append(Claim(f"x{next(_ids)}", rid, key, ikey, self.epoch, "won"))
            self.h.applied.append(ikey)
            self.run.effects[ikey] = rid
            self.ev("output", value={"epoch": self.epoch, "step": key})
        self.ev("step_succeeded", step=key, attempt=1)
        self.run.steps[key] = Step(key, name, "succeeded", 1, ikey,
                                   self._seq(key.rsplit(".", 1)[0]))
        return ikey

    def record(self, key: str, name: str, result: Any, status: str = "succeeded") -> None:
        self.run.steps[key] = Step(key, name, status, 1, result, self._seq(key.rsplit(".", 1)[0]))

    def fire(self, key: str) -> None:
        """The execution passes timer `key`: it records it fired (ledger and output)."""
        timer = self.run.steps[key]
        due = timer.result["due_ms"]
        self.run.steps[key] = dataclasses.replace(
            timer, status="fired", result={"due_ms": due, "fired_ms": self.ms})
        self.ev("timer_fired", timer=key, due_ms=due, late_ms=self.ms - due)

    def park(self, reason: str, **data: Any) -> None:
        self.ev("parked", reason=reason, **data)
        self.run.status = "waiting"

    def wake(self, cause: str, *, at: int | None = None) -> None:
        self.attempt += 1
        self.ev("woken", at=at, cause=cause)
        self.run.status = "queued"

    def finish(self, result: Any) -> None:
        self.run.status = "succeeded"
        self.run.result = result
        self.ev("final", status="succeeded", result=result)


def valid_history() -> History:
    h = History(schedule_every_ms={k: every for k, (_, every) in SCHEDULES.items()},
                schedule_workflows={wf: k for k, (wf, _) in SCHEDULES.items()})

    chain = Builder(h, "r-chain", "cx_chain", {"n": 2, "doomed": False})
    chain.start()
    keys = [chain.step(f"cx_chain.cx_link#{i}") for i in range(2)]
    chain.finish({"steps": keys})
    h.submitted += [Submitted("r-chain", "cx_chain", "api", True),
                    Submitted("r-chain", "cx_chain", "cli", False)]

    doomed = Builder(h, "r-doomed", "cx_chain", {"n": 1, "doomed": True})
    doomed.start()
    doomed.step("cx_chain.cx_link#0")
    doomed.ev("step_failed", step="cx_chain.cx_doomed#0", attempt=2)
    doomed.record("cx_chain.cx_doomed#0", "cx_doomed", None, status="failed")
    doomed.run.status, doomed.run.error = "failed", {"type": "RuntimeError", "message": "doomed"}
    doomed.ev("final", status="failed")
    h.submitted.append(Submitted("r-doomed", "cx_chain", "batch", True))

    ask = Builder(h, "r-ask", "cx_ask", {"kind": "question"})
    ask.start()
    before = ask.step("cx_ask.cx_link#0")
    ask.run.steps["cx_ask.|patch:cx-ask-patch#0"] = Step(
        "cx_ask.|patch:cx-ask-patch#0", "|patch:cx-ask-patch", "succeeded", 0, True, -1)
    ask.park("question", questions=["q"])
    ask.ev("answered", key="q", answer="red")
    ask.wake("answer")
    ask.start()
    after = ask.step("cx_ask.cx_echo#0", "cx_echo", effect=False)
    ask.finish({"answer": "red", "steps": [before, after], "patched": True})
    ask.run.questions = {"q": {"state": "answered", "answer": "red", "rev": 2}}
    h.submitted.append(Submitted("r-ask", "cx_ask", "api", True))
    h.answers += [AnswerTry("r-ask", "q", "red", "api", "accepted"),
                  AnswerTry("r-ask", "q", "blue", "api", "refused")]

    timer = Builder(h, "r-timer", "cx_timer", {"sleep_s": 1.0})
    timer.start()
    first = timer.step("cx_timer.cx_link#0")
    due = timer.ms + 1000
    timer.record("cx_timer.|sleep#0", "|sleep", {"due_ms": due})
    timer.park("timer", until_ms=due)
    timer.wake("timer", at=due + 5)
    timer.start()
    timer.fire("cx_timer.|sleep#0")
    second = timer.step("cx_timer.cx_link#1")
    timer.finish({"steps": [first, second]})
    h.submitted.append(Submitted("r-timer", "cx_timer", "api", True))

    parent = Builder(h, "r-parent", "cx_parent", {"children": 2})
    parent.start()
    children = []
    for i in range(2):
        cid = f"r-parent.k{i}"
        parent.record(f"cx_parent.|child#{i}", "|child", {"id": cid, "workflow": "cx_child"})
        parent.ev("child_started", child=cid, workflow="cx_child")
        child = Builder(h, cid, "cx_child", {"i": i}, parent="r-parent")
        child.start("host.abcd.200")
        child.finish({"i": i, "steps": [child.step("cx_child.cx_link#0")]})
        children.append(child.run.result)
    parent.park("child", children=["r-parent.k0", "r-parent.k1"])
    parent.wake("child")
    parent.start()
    parent.finish({"children": children, "steps": [parent.step("cx_parent.cx_link#0")]})
    h.submitted.append(Submitted("r-parent", "cx_parent", "api", True))

    fan = Builder(h, "r-fan", "cx_fan", {"width": 2})
    fan.start()
    leaves = [fan.step(f"cx_fan.|parallel#0[{i}].cx_link#0") for i in range(2)]
    fan.finish({"steps": [*leaves, fan.step("cx_fan.cx_link#2")]})
    h.submitted.append(Submitted("r-fan", "cx_fan", "api", True))

    cancelled = Builder(h, "r-cancel", "cx_chain", {"n": 8})
    cancelled.start()
    cancelled.step("cx_chain.cx_link#0")
    cancelled.run.status = "cancelled"
    cancelled.ev("final", status="cancelled")
    h.submitted.append(Submitted("r-cancel", "cx_chain", "api", True))
    h.cancels.append(Cancel("r-cancel", "cli", "requested"))

    event = Builder(h, "ev-1", "cx_event", {"key": "ev-1", "id": "evt-1"})
    event.start()
    event.finish({"event": "evt-1", "steps": [event.step("cx_event.cx_link#0")]})
    h.sent += [Sent("evt-1", "ev-1", "api", True), Sent("evt-1", "ev-1", "cli", False)]
    h.event_journal.append({"key": "ev-1", "state": "started", "run": "ev-1"})

    for n in range(3):
        rid = f"sched:{TICK_KEY}:{T0 + 1000 * n}"
        tick = Builder(h, rid, "cx_tick")
        tick.start()
        tick.finish({"steps": [tick.step("cx_tick.cx_link#0")]})
    h.schedules = [{"key": key, "lastRun": None} for key in SCHEDULES]
    h.schedules[0]["lastRun"] = f"sched:{TICK_KEY}:{T0 + 2000}"

    _combinations(h)
    h.faults.append(Fault("worker_parent", T0 + 5, (100,), "w0"))
    h.crashes.append(Crash("w1", 3, excused="Redis was down"))

    sig = Builder(h, "r-sig", "cx_signals", {"n": 2})
    sig.start()
    before = sig.step("cx_signals.cx_link#0")
    sig.park("signal", signals=["nudge"])
    sig.wake("signal")
    sig.start()
    payloads = [{"run": "r-sig", "i": i} for i in range(2)]
    for i, payload in enumerate(payloads):
        sig.record(f"cx_signals.|signal#{i}", "|signal",
                   {"name": "nudge", "seq": i + 1, "payload": payload}, status="received")
    after = sig.step("cx_signals.cx_echo#0", "cx_echo", effect=False)
    sig.finish({"signals": payloads, "timed_out": False, "steps": [before, after]})
    h.submitted.append(Submitted("r-sig", "cx_signals", "signal_start", True))
    h.signals += [SignalTry("r-sig", 0, "api", "created", 1),
                  SignalTry("r-sig", 1, "cli", "error: Redis went away"),
                  SignalTry("r-sig", 1, "cli", "ok", 2)]

    _publish_wait(h)
    _saga(h)
    _retries(h)
    _rates(h)
    _sessions(h)
    _artifacts(h)
    _locks(h)
    return h


PW_WAIT = "cx_publish_wait.|event#0"


def _publish_wait(h: History) -> None:
    """A cx_publish_wait run: publishes, steps, publishes, parks on its wait, is delivered
    its matching event (a decoy and a resend of the match were sent too), publishes what it
    received and returns it."""
    pw = Builder(h, "r-pw", "cx_publish_wait", {"sleep_ms": 10})

    def publish(n: int, value: Any) -> None:
        key = f"cx_publish_wait.|publish#{n}"
        pw.record(key, "|publish", {"key": "state"}, status="published")
        pw.ev("published", key="state", step=key)
        pw.run.published["state"] = value

    pw.start()
    publish(0, {"stage": "started"})
    before = pw.step("cx_publish_wait.cx_link#0")
    publish(1, {"stage": "stepped", "step": before})
    pw.park("event", events=[{"source": "chaos-orders", "type": "paid",
                              "match": {"order": "r-pw"}}])
    type, payload = order_event("r-pw", 0)
    key = event_key("chaos-orders", "r-pw-e0")
    pw.ev("event_received", wait=PW_WAIT, event=key, source="chaos-orders")
    pw.run.events[-1].data["type"] = type
    pw.wake("event")
    pw.start()
    pw.record(PW_WAIT, "|event", {"key": key, "source": "chaos-orders", "type": type,
                                  "id": "r-pw-e0", "payload": payload,
                                  "received_at_ms": pw.ms}, status="received")
    state = {"stage": "received", "event": "r-pw-e0", "key": key, "payload": payload}
    publish(2, state)
    pw.finish({"state": state, "steps": [before]})
    h.submitted.append(Submitted("r-pw", "cx_publish_wait", "api", True))
    decoy_type, decoy = order_event("r-pw", 1)
    h.orders += [OrderSent("r-pw-e0", "r-pw", type, payload, False, "api", True),
                 OrderSent("r-pw-e1", "r-pw", decoy_type, decoy, True, "cli", True),
                 OrderSent("r-pw-e0", "r-pw", type, payload, False, "api", None),
                 OrderSent("r-pw-e0", "r-pw", type, payload, False, "api", False)]


def _saga(h: History) -> None:
    """A cx_saga run: two steps that register undos as they succeed and one registration
    by ctx.compensate between them, a doomed step, then the three undos in reverse."""
    sg = Builder(h, "r-saga", "cx_saga", {"n": 2, "sleep_ms": 10})
    sg.start()
    sg.step("cx_saga.cx_saga_do#0", "cx_saga_do")
    sg.record("cx_saga.|undo#0", "|undo", {"fn": "py:tests.chaos.workloads:cx_saga_release",
                                          "name": "cx_saga_release", "args": [0, 10]},
              status="registered")
    sg.step("cx_saga.cx_saga_do#1", "cx_saga_do")
    sg.record("cx_saga.cx_doomed#0", "cx_doomed", None, status="failed")
    for key, label in (("|compensate.cx_saga_undo#0", "do1"),
                       ("|compensate.cx_saga_release#0", "rel0"),
                       ("|compensate.cx_saga_undo#1", "do0")):
        sg.step(key, key.split(".")[1].split("#")[0])
        sg.run.steps[key] = dataclasses.replace(sg.run.steps[key], result=label)
    sg.run.status = "failed"
    sg.ev("final", status="failed")
    h.submitted.append(Submitted("r-saga", "cx_saga", "api", True))


RETRY_KEY_ = "cx_retry.cx_retry_try#0"
PATCHED_KEY = "cx_retry.cx_retry_try_p#0"


def _failed_tries(b: Builder, key: str, tries: int, *, last: str = "retry") -> None:
    """`tries` failed tries of step `key`, each its own delivery: a retry parked on a
    timer after each but the last, which parks as `last` says."""
    for attempt in range(1, tries + 1):
        b.start()
        b.ev("step_started", step=key, attempt=attempt)
        b.h.executions.append(Execution(f"x{next(_ids)}", b.run.id, key, b.epoch, b.attempt,
                                        100, b.ms, "cx.default"))
        if attempt < tries or last == "retry":
            b.park("retry", step=key, attempt=attempt, error="RuntimeError: retry")
            b.wake("timer")
        else:
            b.park("failed_step", step=key, attempts=attempt, max_attempts=attempt)


def _retries(h: History) -> None:
    """cx_retry runs: one fails twice then succeeds on its third try; one runs out of
    tries, pauses, and succeeds once the harness retried it with the patch."""
    r = Builder(h, "r-retry", "cx_retry", {"fails": 2, "pause": False, "sleep_ms": 5})
    _failed_tries(r, RETRY_KEY_, 2)
    r.start()
    ikey = r.step(RETRY_KEY_, "cx_retry_try")
    r.run.steps[RETRY_KEY_].attempts = 3
    r.finish({"try": {"key": ikey, "fails": 2, "tries": 3}, "steps": [ikey]})
    h.retry_tries[ikey] = 3
    h.submitted.append(Submitted("r-retry", "cx_retry", "api", True))

    p = Builder(h, "r-retry-p", "cx_retry", {"fails": RETRY_EXHAUST, "pause": True,
                                             "sleep_ms": 5})
    _failed_tries(p, PATCHED_KEY, RETRY_MAX_ATTEMPTS, last="pause")
    p.ev("step_retried", step=PATCHED_KEY, attempts=RETRY_MAX_ATTEMPTS, patch=RETRY_PATCH,
         args={"fails": 0, "sleep_ms": 5})
    p.wake("retry")
    p.start()
    ikey = p.step(PATCHED_KEY, "cx_retry_try_p")
    tried = {"key": ikey, "fails": 0, "tries": RETRY_MAX_ATTEMPTS + 1}
    p.run.steps[PATCHED_KEY].result = tried
    p.finish({"try": tried, "steps": [ikey]})
    h.retry_tries[ikey] = RETRY_MAX_ATTEMPTS + 1
    h.submitted.append(Submitted("r-retry-p", "cx_retry", "api", True))
    h.retries += [RetryTry("r-retry-p", RETRY_PATCH, "cli", "error: Redis went away"),
                  RetryTry("r-retry-p", RETRY_PATCH, "cli", "not_failed_step")]


def _rates(h: History) -> None:
    """cx_rate runs: lane north at exactly its limit (one start every 100 ms: the window
    [0, 1000) holds 10, the eleventh start opens the next), lane south well under it."""
    for lane, n, every in (("north", RATE_PER_S + 2, 1000 // RATE_PER_S), ("south", 3, 50)):
        for i in range(n):
            rid = f"r-rate-{lane}-{i}"
            b = Builder(h, rid, "cx_rate", {"lane": lane}, start_ms=T0 + every * i)
            b.start()
            b.finish({"steps": [b.step("cx_rate.cx_link#0")]})
            h.submitted.append(Submitted(rid, "cx_rate", "api", True))


def _sessions(h: History) -> None:
    """A cx_session run of one step that also appends to the shared session: its own
    holds messages 0 (body), 1 (step), 2 (body); the shared one 1 (step) and 3 (body)."""
    b = Builder(h, "r-ses", "cx_session", {"steps": 1, "shared": True, "sleep_ms": 5})
    b.start()
    step = b.step("cx_session.cx_say#0", "cx_say", effect=False)
    b.finish({"session": "r-ses", "said": 3, "steps": [step]})
    h.submitted.append(Submitted("r-ses", "cx_session", "api", True))
    said = [{"run": "r-ses", "i": i, "at": "step" if i % 2 else "body"} for i in range(4)]
    h.sessions = {"r-ses": said[:3], SESSION_SHARED: [said[1], said[3]]}


def _artifacts(h: History) -> None:
    """Two cx_artifact runs: a plain put and one by compare-and-set, each version 1 of
    its artifact."""
    for rid, cas, name in (("r-art", False, ARTIFACT_PLAIN), ("r-art-cas", True, ARTIFACT_CAS)):
        b = Builder(h, rid, "cx_artifact", {"cas": cas, "sleep_ms": 10})
        b.start()
        step = b.step("cx_artifact.cx_put#0", "cx_put", effect=False)
        b.finish({"artifact": name, "version": 1, "steps": [step]})
        h.submitted.append(Submitted(rid, "cx_artifact", "api", True))
        content = json.dumps({"run": rid, "step": "cx_artifact.cx_put#0"}).encode()
        h.artifacts[name] = [ArtifactVersion(1, content, rid)]


def _locks(h: History) -> None:
    """Two cx_lock runs: r-lock-a holds it from 100 to 200 ms; r-lock-b's first execution
    enters at 250 and is stopped inside; its hold lapses, its run is redelivered, takes it
    again and passes from 600 to 700 ms; the stopped execution's write at 900 is refused."""
    def pass_(x: str, run: str, epoch: int, enter: int, exit: int | None, outcome: str,
              holder: str, holder_epoch: int, read: int) -> None:
        h.lock_receipts.append(LockReceipt(x, "enter", run, epoch, epoch, T0 + enter, run,
                                           epoch, valid=True, read=read))
        if exit is not None:
            h.lock_receipts.append(LockReceipt(x, "exit", run, epoch, epoch, T0 + exit,
                                               holder, holder_epoch, outcome=outcome))

    pass_("la", "r-lock-a", 1, 100, 200, "written", "r-lock-a", 1, 0)
    pass_("lb1", "r-lock-b", 1, 250, 900, "refused", "r-lock-b", 2, 1)
    pass_("lb2", "r-lock-b", 2, 600, 700, "written", "r-lock-b", 2, 1)
    for rid in ("r-lock-a", "r-lock-b"):
        b = Builder(h, rid, "cx_lock", {"hold_ms": 20, "step": False})
        b.start()
        b.finish({"steps": [b.step("cx_lock.cx_link#0")]})
        h.submitted.append(Submitted(rid, "cx_lock", "api", True))
    h.lock_counter, h.lock_done = 2, ["r-lock-a", "r-lock-b"]


def _session_lost_message(h: History) -> None:
    del h.sessions["r-ses"][1]


def _session_message_twice(h: History) -> None:
    shared = h.sessions[SESSION_SHARED]
    assert shared is not None
    shared.insert(0, shared[0])


def _session_out_of_order(h: History) -> None:
    own = h.sessions["r-ses"]
    assert own is not None
    own[0], own[1] = own[1], own[0]


def _artifact_put_twice(h: History) -> None:
    first = h.artifacts[ARTIFACT_PLAIN][0]
    h.artifacts[ARTIFACT_PLAIN].append(dataclasses.replace(first, version=2))


def _artifact_gap(h: History) -> None:
    h.artifacts[ARTIFACT_CAS] = [dataclasses.replace(h.artifacts[ARTIFACT_CAS][0], version=2)]


def _artifact_put_lost(h: History) -> None:
    h.artifacts[ARTIFACT_CAS] = []


def _lock_holds_overlap(h: History) -> None:
    at = next(i for i, r in enumerate(h.lock_receipts) if r.x == "lb2" and r.op == "enter")
    h.lock_receipts[at] = dataclasses.replace(h.lock_receipts[at], ms=T0 + 150)


def _lock_write_not_holding(h: History) -> None:
    for i, r in enumerate(h.lock_receipts):
        if r.x == "lb1":
            h.lock_receipts[i] = dataclasses.replace(r, valid=False, holder="r-lock-a",
                                                     outcome="written" if r.op == "exit"
                                                     else "")


def _lock_update_lost(h: History) -> None:
    h.lock_counter = 1


def _lock_never_held(h: History) -> None:
    h.lock_receipts = [r for r in h.lock_receipts if r.run != "r-lock-a"]
    h.lock_done.remove("r-lock-a")
    h.lock_counter = 1


def _retry_tries_lost(h: History) -> None:
    h.runs["r-retry"].steps[RETRY_KEY_].attempts = 1  # two failures are in its journal


def _retry_paused_early(h: History) -> None:
    park = next(e for e in h.runs["r-retry-p"].events if e.type == "parked"
                and e.data.get("reason") == "failed_step")
    park.data["attempts"] = RETRY_MAX_ATTEMPTS - 2


def _retry_patch_ignored(h: History) -> None:
    run = h.runs["r-retry-p"]
    run.result = {**run.result, "try": {**run.result["try"], "fails": RETRY_EXHAUST}}


def _retry_effect_skipped(h: History) -> None:
    h.applied.remove(f"r-retry:{RETRY_KEY_}")


def _rate_exceeded(h: History) -> None:
    started = next(e for e in h.runs[f"r-rate-north-{RATE_PER_S}"].events
                   if e.type == "step_started")
    started.data["started_ms"] = T0 + 950  # the eleventh start inside the first second


def _undone_out_of_order(h: History) -> None:
    first, second = (f"r-saga:|compensate.cx_saga_undo#{i}" for i in (0, 1))
    i, j = h.applied.index(first), h.applied.index(second)
    h.applied[i], h.applied[j] = second, first


def _combinations(h: History) -> None:
    """The issue 16 workloads, as a correct history shows them."""
    # A pause storm: paused while running (parked), resumed, paused and resumed back to back
    # once it ran again (the second pause came before the boundary: "resumed").
    paused = Builder(h, "r-pause", "cx_chain", {"n": 2})
    paused.start()
    first = paused.step("cx_chain.cx_link#0")
    paused.park("paused")
    paused.wake("resume")
    paused.start()
    paused.finish({"steps": [first, paused.step("cx_chain.cx_link#1")]})
    h.submitted.append(Submitted("r-pause", "cx_chain", "api", True))
    h.pauses += [PauseTry("r-pause", "pause", "api", "requested"),
                 PauseTry("r-pause", "resume", "api", "woken"),
                 PauseTry("r-pause", "pause", "api", "requested"),
                 PauseTry("r-pause", "resume", "cli", "resumed")]

    # A late parent: its cx_brief child finished, the parent slept, gathered it, finished;
    # the child was then pruned (kept one second).
    late = Builder(h, "r-late", "cx_late_parent", {"children": 1, "wait_s": 7})
    late.start()
    late.record("cx_late_parent.|child#0", "|child", {"id": "r-late.b0", "workflow": "cx_brief"})
    late.ev("child_started", child="r-late.b0", workflow="cx_brief")
    brief = {"i": 0, "steps": ["r-late.b0:cx_brief.cx_link#0"]}
    late.record("cx_late_parent.|sleep#0", "|sleep", {"due_ms": late.ms + 7000})
    late.park("timer", until_ms=late.ms + 7000)
    late.wake("timer", at=late.ms + 7005)
    late.start()
    late.fire("cx_late_parent.|sleep#0")
    late.finish({"children": [brief], "steps": [late.step("cx_late_parent.cx_link#0")]})
    h.submitted.append(Submitted("r-late", "cx_late_parent", "api", True))

    # A spawner cancelled after its first child started: that child finished before the
    # cancel settled; nothing of it ran later.
    spawner = Builder(h, "r-spawn", "cx_spawner", {"children": 3})
    spawner.start()
    spawner.step("cx_spawner.cx_link#0")
    spawner.record("cx_spawner.|child#0", "|child", {"id": "r-spawn.s0", "workflow": "cx_child"})
    spawner.ev("child_started", child="r-spawn.s0", workflow="cx_child")
    child = Builder(h, "r-spawn.s0", "cx_child", {"i": 0}, parent="r-spawn",
                    start_ms=spawner.ms)
    child.start("host.abcd.300")
    child.finish({"i": 0, "steps": [child.step("cx_child.cx_link#0")]})
    spawner.ms = child.ms + 10
    spawner.run.status = "cancelled"
    spawner.ev("final", status="cancelled")
    # Its second child was noted, then the execution was killed before recording it, and
    # the cancel came before a redelivery could: a note, no child.
    spawner.run.steps["cx_spawner.|child#1"] = Step(
        "cx_spawner.|child#1", "|child", "running", 1,
        {"id": "r-spawn.s1", "workflow": "cx_child"}, 1)
    h.submitted.append(Submitted("r-spawn", "cx_spawner", "api", True))
    h.cancels.append(Cancel("r-spawn", "api", "requested"))

    # Limits: sampled, never above.
    h.limit_counts = {"cx_limited": (900, 2, 2), "cx_limited_key customer=acme": (900, 1, 1)}

    # A rerun of r-rr from its third step: the first two copied (their results name the
    # source), the rest executed.
    source = Builder(h, "r-rr", "cx_rr", {"n": 4})
    source.start()
    keys = [source.step(f"cx_rr.{name}#{i // 2}", name, effect=False)
            for i, name in enumerate(["cx_zz", "cx_aa", "cx_zz", "cx_aa"])]
    source.finish({"steps": keys})
    h.submitted.append(Submitted("r-rr", "cx_rr", "api", True))
    order = tuple(f"cx_rr.{name}#{i // 2}"
                  for i, name in enumerate(["cx_zz", "cx_aa", "cx_zz", "cx_aa"]))
    again = Builder(h, "r-rr-rr", "cx_rr", {"n": 4})
    again.run.rerun_of, again.run.rerun_from_step = "r-rr", order[2]
    for key, result in zip(order[:2], keys[:2], strict=True):
        again.record(key, key.rsplit(".", 1)[-1].split("#")[0], result)
    again.start()
    rest = [again.step(key, key.rsplit(".", 1)[-1].split("#")[0], effect=False)
            for key in order[2:]]
    again.finish({"steps": [*keys[:2], *rest]})
    h.reruns.append(RerunTry("r-rr", "r-rr-rr", order[2], "api", "created", order[:2], order))

    # A run in priority band 5.
    band = Builder(h, "r-band", "cx_chain", {"n": 1})
    band.run.priority = 5
    band.start()
    band.finish({"steps": [band.step("cx_chain.cx_link#0")]})
    h.submitted.append(Submitted("r-band", "cx_chain", "api", True))

    # A run asked to start later, started after that time.
    later = Builder(h, "r-later", "cx_chain", {"n": 1})
    later.run.start_at_ms = later.ms
    later.start()
    later.finish({"steps": [later.step("cx_chain.cx_link#0")]})
    h.submitted.append(Submitted("r-later", "cx_chain", "later", True))


# -- each mutation plants one kind of violation ----------------------------------------------

def _drop_final(h: History) -> None:
    run = h.runs["r-chain"]
    run.events = [e for e in run.events if e.type != "final"]
    run.status = "running"


def _final_disagrees(h: History) -> None:
    run = h.runs["r-chain"]
    run.events = [Ev(e.ms, e.seq, e.type, e.attempt, {**e.data, "status": "cancelled"})
                  if e.type == "final" else e for e in run.events]


def _fails_for_nothing(h: History) -> None:
    run = h.runs["r-fan"]
    run.status = "failed"
    run.events = [Ev(e.ms, e.seq, e.type, e.attempt, {"status": "failed"})
                  if e.type == "final" else e for e in run.events]


def _event_after_final(h: History) -> None:
    h.runs["r-chain"].events.append(Ev(T0 + 99_999, 0, "output", 1, {"text": "late"}))


def _queued_twice(h: History) -> None:
    run = h.runs["r-chain"]
    run.events.insert(1, run.events[0])


def _step_twice(h: History) -> None:
    run = h.runs["r-chain"]
    done = next(e for e in run.events if e.type == "step_succeeded")
    run.events.insert(run.events.index(done) + 1, done)


def _step_rerun(h: History) -> None:
    run = h.runs["r-timer"]  # its first step ran in epoch 1; epoch 2 must replay it
    h.executions.append(Execution("x-again", "r-timer", "cx_timer.cx_link#0", 2, 2))
    assert any(e.type == "attempt_started" and e.data["epoch"] == 2 for e in run.events)


def _step_rerun_same_epoch(h: History) -> None:
    h.executions.append(Execution("x-again", "r-chain", "cx_chain.cx_link#0", 1, 1))


def _step_lost(h: History) -> None:
    h.runs["r-chain"].steps["cx_chain.cx_link#1"].status = "running"


def _applied_twice(h: History) -> None:
    h.applied.append("r-chain:cx_chain.cx_link#0")


def _won_twice(h: History) -> None:
    h.claims.append(Claim("x-won", "r-chain", "cx_chain.cx_link#0",
                          "r-chain:cx_chain.cx_link#0", 1, "won"))


def _other_key(h: History) -> None:
    h.claims.append(Claim("x-key", "r-chain", "cx_chain.cx_link#0", "r-chain:elsewhere", 2,
                          "won"))


def _no_receipt(h: History) -> None:
    del h.runs["r-chain"].effects["r-chain:cx_chain.cx_link#1"]


def _never_applied(h: History) -> None:
    h.applied.remove("r-fan:cx_fan.cx_link#2")


def _schedule_twice(h: History) -> None:
    rid = f"sched:{TICK_KEY}:{T0 + 1500}"
    tick = Builder(h, rid, "cx_tick")
    tick.start()
    tick.finish({"steps": [tick.step("cx_tick.cx_link#0")]})


def _event_created_twice(h: History) -> None:
    h.sent.append(Sent("evt-1", "ev-1", "thread", True))


def _event_second_run(h: History) -> None:
    other = Builder(h, "ev-2", "cx_event", {"key": "ev-1", "id": "evt-1"})
    other.start()
    other.finish({"event": "evt-1", "steps": [other.step("cx_event.cx_link#0")]})
    h.sent.append(Sent("evt-1", "ev-2", "api", False))


def _answered_twice(h: History) -> None:
    h.answers.append(AnswerTry("r-ask", "q", "blue", "cli", "accepted"))


def _answer_not_seen(h: History) -> None:
    h.runs["r-ask"].result = {"answer": "green", "steps": h.runs["r-ask"].result["steps"]}


def _patch_decided_anew(h: History) -> None:
    """A replay after the question took the old branch: the decision was not kept."""
    h.runs["r-ask"].result = {**h.runs["r-ask"].result, "patched": False}


def _timer_early(h: History) -> None:
    run = h.runs["r-timer"]
    due = run.steps["cx_timer.|sleep#0"].result["due_ms"]
    run.events = [Ev(due - 300, e.seq, e.type, e.attempt, e.data)
                  if e.type == "woken" else e for e in run.events]


def _timer_twice(h: History) -> None:
    run = h.runs["r-timer"]
    woken = next(e for e in run.events if e.type == "woken")
    run.events.insert(run.events.index(woken) + 1, woken)


def _timer_passed_unrecorded(h: History) -> None:
    """The finding of cx_late_parent: a child's wake replayed the parent after the due time;
    the replay passed the timer without recording it fired."""
    run = h.runs["r-late"]
    timer = run.steps["cx_late_parent.|sleep#0"]
    run.steps[timer.key] = dataclasses.replace(timer, status="waiting",
                                               result={"due_ms": timer.result["due_ms"]})
    run.events = [dataclasses.replace(e, data={"cause": "child", "child": "r-late.b0"})
                  if e.type == "woken" else e for e in run.events if e.type != "timer_fired"]


def _timer_fired_twice(h: History) -> None:
    run = h.runs["r-timer"]
    fired = next(e for e in run.events if e.type == "timer_fired")
    run.events.insert(run.events.index(fired) + 1, fired)


def _child_twice(h: History) -> None:
    extra = Builder(h, "r-parent.c9", "cx_child", {"i": 9}, parent="r-parent")
    extra.start()
    extra.finish({"i": 9, "steps": [extra.step("cx_child.cx_link#0")]})


def _child_result(h: History) -> None:
    run = h.runs["r-parent"]
    run.result = {**run.result, "children": list(reversed(run.result["children"]))}


def _lost(h: History) -> None:
    del h.runs["r-fan"]


def _noted_child_missing(h: History) -> None:
    """A parent that went on to succeed left a child noted and never recorded: lost (only a
    stopped parent may leave a note without its child)."""
    h.runs["r-spawn"].status = "succeeded"


def _unexpected(h: History) -> None:
    stray = Builder(h, "r-stray", "cx_chain", {"n": 1})
    stray.start()
    stray.finish({"steps": [stray.step("cx_chain.cx_link#0")]})


def _write_while_parked(h: History) -> None:
    run = h.runs["r-timer"]
    parked = next(e for e in run.events if e.type == "parked")
    run.events.insert(run.events.index(parked) + 1,
                      Ev(parked.ms + 1, 0, "output", 1, {"value": {"epoch": 1}}))


def _output_of_old_epoch(h: History) -> None:
    run = h.runs["r-ask"]
    second = [e for e in run.events if e.type == "attempt_started"][1]
    run.events.insert(run.events.index(second) + 1,
                      Ev(second.ms + 1, 0, "output", 2, {"value": {"epoch": 1}}))


def _commit_without_execution(h: History) -> None:
    h.executions = [ex for ex in h.executions
                    if (ex.run, ex.step) != ("r-chain", "cx_chain.cx_link#1")]


def _resume_strands(h: History) -> None:
    """Item 1's race: the resume lands between "paused" and the park; the run parks for good."""
    run = h.runs["r-pause"]
    run.events = run.events[:run.events.index(next(e for e in run.events if e.type == "parked"))
                            + 1]
    run.status, run.result = "waiting", None
    del run.steps["cx_chain.cx_link#1"]
    del run.effects["r-pause:cx_chain.cx_link#1"]
    h.pauses[1:] = [PauseTry("r-pause", "resume", "api", "resumed")]


def _child_pruned(h: History) -> None:
    """Item 2: the child was pruned before its parent gathered it; the parent failed."""
    run = h.runs["r-late"]
    run.events = [e for e in run.events if e.type != "final"]
    run.status, run.result = "failed", None
    run.error = {"type": "ChildError", "message": "child run r-late.b0 does not exist (pruned, "
                 "or never recorded)"}
    run.events.append(Ev(run.events[-1].ms + 1, 0, "final", 2, {"status": "failed"}))
    del run.steps["cx_late_parent.cx_link#0"]
    del run.effects["r-late:cx_late_parent.cx_link#0"]


def _child_after_cancel(h: History) -> None:
    """Item 5: a child recorded while its parent's cancel walked the children starts later."""
    late = Builder(h, "r-spawn.s1", "cx_child", {"i": 1}, parent="r-spawn",
                   start_ms=h.runs["r-spawn"].events[-1].ms + 50)
    late.start("host.abcd.301")
    late.finish({"i": 1, "steps": [late.step("cx_child.cx_link#0")]})
    spawner = h.runs["r-spawn"]
    spawner.steps["cx_spawner.|child#1"] = Step("cx_spawner.|child#1", "|child", "succeeded", 1,
                                                {"id": "r-spawn.s1", "workflow": "cx_child"}, 1)


def _child_steps_after_its_cancel(h: History) -> None:
    """A child that started before its parent's cancel, was asked to cancel by the walk,
    and went on beginning steps past the one in flight."""
    kid = Builder(h, "r-spawn.s1", "cx_child", {"i": 1}, parent="r-spawn",
                  start_ms=h.runs["r-spawn"].events[-1].ms - 100)
    kid.start("host.abcd.301")
    kid.ev("cancel_requested", why="its parent r-spawn was cancelled")
    steps = [kid.step("cx_child.cx_link#0"), kid.step("cx_child.cx_link#1")]  # both after it
    kid.finish({"i": 1, "steps": steps})
    h.runs["r-spawn"].steps["cx_spawner.|child#1"] = Step(
        "cx_spawner.|child#1", "|child", "succeeded", 1,
        {"id": "r-spawn.s1", "workflow": "cx_child"}, 1)


def _limit_exceeded(h: History) -> None:
    h.limit_over.append(LimitSample(T0 + 10, "cx_limited", 2, 3, ("a", "b", "c")))


def _limit_most_exceeded(h: History) -> None:
    h.limit_counts["cx_limited_key customer=acme"] = (900, 2, 1)


def _rerun_reran(h: History) -> None:
    """Item 4: the ledger ordered by wall clock left a step before PATH uncopied."""
    h.executions.append(Execution("x-rr", "r-rr-rr", "cx_rr.cx_aa#0", 1, 1))


def _rerun_skipped(h: History) -> None:
    """Item 4 the other way: a step committed after PATH (same millisecond, name first) was
    copied and never executed."""
    h.executions = [ex for ex in h.executions
                    if (ex.run, ex.step) != ("r-rr-rr", "cx_rr.cx_aa#1")]
    run = h.runs["r-rr-rr"]
    run.steps["cx_rr.cx_aa#1"].result = "r-rr:cx_rr.cx_aa#1"
    run.result = {"steps": [*run.result["steps"][:3], "r-rr:cx_rr.cx_aa#1"]}
    run.events = [e for e in run.events if e.data.get("step") != "cx_rr.cx_aa#1"]


def _band_lost(h: History) -> None:
    ex = next(ex for ex in h.executions if ex.run == "r-band")
    h.executions[h.executions.index(ex)] = Execution(ex.x, ex.run, ex.step, ex.epoch,
                                                     ex.attempt, ex.pid, ex.t, "cx.default")


def _signal_ledger(h: History) -> list[Step]:
    run = h.runs["r-sig"]
    return sorted((st for st in run.steps.values() if st.name == "|signal"),
                  key=lambda st: st.seq)


def _signal_taken_twice(h: History) -> None:
    run = h.runs["r-sig"]
    run.steps["cx_signals.|signal#2"] = Step(
        "cx_signals.|signal#2", "|signal", "received", 1,
        {"name": "nudge", "seq": 3, "payload": {"run": "r-sig", "i": 0}}, 3)


def _signal_never_taken(h: History) -> None:
    run = h.runs["r-sig"]
    del run.steps[_signal_ledger(h)[-1].key]
    run.result = {**run.result, "signals": run.result["signals"][:1]}


def _signal_out_of_order(h: History) -> None:
    first, second = _signal_ledger(h)
    first.result["payload"], second.result["payload"] = (second.result["payload"],
                                                         first.result["payload"])


def _started_early(h: History) -> None:
    h.runs["r-later"].start_at_ms += 60_000


def _wait_took_a_decoy(h: History) -> None:
    run = h.runs["r-pw"]
    _, decoy = order_event("r-pw", 1)
    got = run.steps[PW_WAIT].result
    got["id"], got["key"], got["payload"] = "r-pw-e1", event_key("chaos-orders", "r-pw-e1"), decoy
    for state in (run.result["state"], run.published["state"]):
        state["event"], state["key"], state["payload"] = got["id"], got["key"], decoy


def _wait_delivered_twice(h: History) -> None:
    run = h.runs["r-pw"]
    at = next(i for i, e in enumerate(run.events) if e.type == "event_received")
    run.events.insert(at + 1, run.events[at])


def _wait_timed_out_with_its_event_sent(h: History) -> None:
    run = h.runs["r-pw"]
    wait = run.steps[PW_WAIT]
    wait.status, wait.result = "timed_out", {"source": "chaos-orders", "type": "paid",
                                            "match": {"order": "r-pw"}}
    run.events = [e for e in run.events if e.type != "event_received"]
    run.result["state"] = run.published["state"] = {"stage": "timed_out"}


def _published_twice(h: History) -> None:
    run = h.runs["r-pw"]
    at = next(i for i, e in enumerate(run.events) if e.type == "published")
    run.events.insert(at + 1, run.events[at])


def _published_stale(h: History) -> None:
    run = h.runs["r-pw"]
    run.published["state"] = {"stage": "stepped", "step": run.result["steps"][0]}


def _crash(h: History) -> None:
    h.crashes.append(Crash("c0 (controller, pid 42)", 1, tail="Traceback ..."))


MUTATIONS: dict[str, tuple[str, Callable[[History], None]]] = {
    "lost": ("lost", _lost),
    "lost_noted_child": ("lost", _noted_child_missing),
    "stuck": ("stuck", _drop_final),
    "terminal": ("terminal", _final_disagrees),
    "outcome": ("outcome", _fails_for_nothing),
    "after_final": ("after_final", _event_after_final),
    "unexpected_run": ("unexpected_run", _unexpected),
    "enqueued_twice": ("enqueued_twice", _queued_twice),
    "step_committed_twice": ("step_committed_twice", _step_twice),
    "step_rerun": ("step_rerun", _step_rerun),
    "step_rerun_same_epoch": ("step_rerun", _step_rerun_same_epoch),
    "step_lost": ("step_lost", _step_lost),
    "effect_applied_twice": ("effect_twice", _applied_twice),
    "effect_won_twice": ("effect_twice", _won_twice),
    "effect_key": ("effect_key", _other_key),
    "effect_no_receipt": ("effect_missing", _no_receipt),
    "effect_never_applied": ("effect_missing", _never_applied),
    "schedule_twice": ("schedule_twice", _schedule_twice),
    "event_created_twice": ("event_twice", _event_created_twice),
    "event_second_run": ("event_twice", _event_second_run),
    "answer_twice": ("answer_twice", _answered_twice),
    "answer_unseen": ("answer_unseen", _answer_not_seen),
    "patch_changed": ("patch_changed", _patch_decided_anew),
    "timer_early": ("timer_early", _timer_early),
    "timer_once": ("timer_once", _timer_twice),
    "timer_once_unrecorded": ("timer_once", _timer_passed_unrecorded),
    "timer_once_fired_twice": ("timer_once", _timer_fired_twice),
    "child_twice": ("child_twice", _child_twice),
    "child_result": ("child_result", _child_result),
    "crash": ("crash", _crash),
    "zombie_write_parked": ("zombie_write", _write_while_parked),
    "zombie_write_epoch": ("zombie_write", _output_of_old_epoch),
    "zombie_write_commit": ("zombie_write", _commit_without_execution),
    "pause_stranded": ("pause_stranded", _resume_strands),
    "child_pruned": ("child_pruned", _child_pruned),
    "child_after_cancel": ("child_after_cancel", _child_after_cancel),
    "child_steps_after_its_cancel": ("child_after_cancel", _child_steps_after_its_cancel),
    "limit_exceeded": ("limit_exceeded", _limit_exceeded),
    "limit_exceeded_most": ("limit_exceeded", _limit_most_exceeded),
    "rerun_reran": ("rerun_reran", _rerun_reran),
    "rerun_skipped": ("rerun_skipped", _rerun_skipped),
    "band": ("band", _band_lost),
    "signal_twice": ("signal_twice", _signal_taken_twice),
    "wait_event_wrong": ("wait_event_wrong", _wait_took_a_decoy),
    "wait_event_twice": ("wait_event_twice", _wait_delivered_twice),
    "wait_event_lost": ("wait_event_lost", _wait_timed_out_with_its_event_sent),
    "published_twice": ("published_twice", _published_twice),
    "published_stale": ("published_stale", _published_stale),
    "compensation": ("compensation", _undone_out_of_order),
    "retry_tries_lost": ("retry", _retry_tries_lost),
    "retry_paused_early": ("retry", _retry_paused_early),
    "retry_patch_ignored": ("retry", _retry_patch_ignored),
    "retry_effect_skipped": ("retry", _retry_effect_skipped),
    "rate_limit": ("rate_limit", _rate_exceeded),
    "session_lost_message": ("session", _session_lost_message),
    "session_message_twice": ("session", _session_message_twice),
    "session_out_of_order": ("session", _session_out_of_order),
    "artifact_put_twice": ("artifact", _artifact_put_twice),
    "artifact_gap": ("artifact", _artifact_gap),
    "artifact_put_lost": ("artifact", _artifact_put_lost),
    "lock_holds_overlap": ("lock", _lock_holds_overlap),
    "lock_write_not_holding": ("lock", _lock_write_not_holding),
    "lock_update_lost": ("lock", _lock_update_lost),
    "lock_never_held": ("lock", _lock_never_held),
    "signal_lost": ("signal_lost", _signal_never_taken),
    "signal_order": ("signal_order", _signal_out_of_order),
    "start_early": ("start_early", _started_early),
}


def test_a_correct_history_passes() -> None:
    history = valid_history()
    report = check(history)
    assert report.violations == [], "\n".join(map(str, report.violations))
    assert report.checked["effects"] >= 10 and report.checked["questions"] == 1
    assert report.checked["timers"] == 2 and report.checked["children"] == 4
    assert report.checked["paused runs"] == 1 and report.checked["reruns"] == 1
    assert report.checked["paused runs parked"] == 1
    assert report.checked["children gathered late"] == 1
    assert report.checked["children of cancelled parents"] == 1
    assert report.checked["limit samples cx_limited"] == 900
    assert report.checked["priority bands"] == 1
    assert report.checked["signals"] == 2
    assert report.checked["runs started later"] == 1
    assert report.checked["event waits"] == 1 and report.checked["published values"] == 3
    assert report.checked["event waits parked"] == 1 and report.checked["decoy events"] == 1
    assert report.checked["compensated runs"] == 1 and report.checked["undos"] == 3
    assert report.checked["retry runs"] == 2 and report.checked["retries patched"] == 1
    assert report.checked["retry failures"] == 2 + RETRY_MAX_ATTEMPTS
    assert report.checked["rate-limited starts lane=north"] == RATE_PER_S + 2
    assert report.checked["session runs"] == 1 and report.checked["session messages"] == 5
    assert report.checked["artifact puts"] == 2
    assert report.checked["artifact puts by compare-and-set"] == 1
    assert report.checked["lock runs"] == 2 and report.checked["lock passes written"] == 2
    assert report.checked["lock passes refused"] == 1
    text = summary(history, report)
    assert "violations: 0" in text


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_violation_is_reported(name: str) -> None:
    kind, plant = MUTATIONS[name]
    history = copy.deepcopy(valid_history())
    plant(history)
    report = check(history)
    assert kind in report.kinds(), (f"{name}: expected a {kind} violation, got "
                                    f"{[str(v) for v in report.violations]}")
    assert f"violations: {len(report.violations)}" in summary(history, report)


def test_every_kind_has_a_planted_violation() -> None:
    assert {kind for kind, _ in MUTATIONS.values()} == set(KINDS)


def test_kill_to_redelivery_latency() -> None:
    history = valid_history()
    run = Builder(history, "r-killed", "cx_chain", {"n": 1}, start_ms=T0)
    run.start("host.abcd.4242")
    history.faults.append(Fault("worker_group", T0 + 50, (4242,), "w1"))
    run.attempt = 2
    run.ev("redelivered", at=T0 + 2050, previous=1, attempt=2, reason="lease expired")
    run.start("host.ef01.77")
    run.finish({"steps": [run.step("cx_chain.cx_link#0")]})
    history.submitted.append(Submitted("r-killed", "cx_chain", "api", True))
    report = check(history)
    assert report.violations == []
    assert report.requeue_ms == [2000]
    assert report.latencies_ms["worker"] == [2010]
    assert "p50 2.01 s" in summary(history, report)


def test_the_plan_is_a_function_of_the_seed() -> None:
    assert make_plan(11) == make_plan(11)
    assert make_plan(11).faults != make_plan(12).faults
    counts = make_plan(11).fault_counts()
    assert sum(counts[k] for k in ("worker_parent", "horse", "worker_group",
                                   "pool_executor")) == 30
    assert counts["leader"] >= 5 and counts["redis"] >= 2
    assert counts["stop_worker"] >= 1 and counts["stop_leader"] >= 1
    runs = {r.run_id for a in make_plan(11).actions if a.op != "rerun" for r in a.runs}
    # the event waits and the sagas come on top
    assert len(runs) == (500 + 500 * PUBLISH_WAITS // 100 + 500 * SAGAS // 100
                         + 500 * RETRIES // 100 + RATE_BURSTS * RATE_BURST
                         + 500 * (SESSIONS + ARTIFACTS + LOCKS) // 100)


@pytest.mark.parametrize(("seed", "runs", "kills"), [(4242, 500, 30), (4243, 300, 18)])
def test_the_short_mode_covers_every_workload(seed: int, runs: int, kills: int) -> None:
    """CI's two short runs (tests/test_chaos.py: one lane, three lanes) each submit every
    kind of run, and make every kind of harness call the combinations need."""
    plan = make_plan(seed, runs, kills)
    kinds = Counter(spec.kind for a in plan.actions
                    if a.op in ("submit", "batch", "send", "signal_start") for spec in a.runs)
    assert set(kinds) == {*RUN_WEIGHTS, "publish_wait", "saga", "retry", "rate", "session",
                          "artifact", "lock"}, \
        set(RUN_WEIGHTS) - set(kinds)
    assert sum(a.op == "cancel_compensate" for a in plan.actions) >= 3
    retries = [a.runs[0].input for a in plan.actions if a.op == "submit"
               and a.runs[0].kind == "retry"]
    assert sum(i["fails"] < RETRY_EXHAUST for i in retries) >= 3  # fail some, then succeed
    assert sum(i["fails"] >= RETRY_EXHAUST and not i["pause"] for i in retries) >= 1
    patched = {a.runs[0].run_id for a in plan.actions if a.op == "retry_patch"}
    assert len(patched) >= 2 and {a.via for a in plan.actions if a.op == "retry_patch"} \
        == {"api", "cli"}
    # each lane gets more than its limit at once from at least one burst
    burst = Counter((a.at_s, a.runs[0].input["lane"]) for a in plan.actions
                    if a.op == "submit" and a.runs[0].kind == "rate")
    assert max(burst.values()) > RATE_PER_S
    assert all(n >= 5 for n in kinds.values()), kinds
    calls = Counter(c for a in plan.actions if a.op == "pause" for c in a.ops)
    assert calls["pause"] >= 10 and calls["resume"] >= 10
    assert any(a.ops[:2] == ("pause", "resume") for a in plan.actions if a.op == "pause")
    assert sum(a.op == "rerun" for a in plan.actions) >= 5
    assert {a.runs[0].priority for a in plan.actions
            if a.runs and a.runs[0].kind == "priority"} \
        == set(PRIORITIES)
    assert sum(a.op == "cancel_spawning" for a in plan.actions) >= 5
    assert any(a.ops[:1] == ("started",) for a in plan.actions if a.op == "pause")
    assert sum(a.op == "signal_start" for a in plan.actions) >= 3
    assert sum(a.op == "signal" for a in plan.actions) >= 20
    # Issue 23: runs on the shared session and of their own, plain and compare-and-set
    # puts (some submitted together), critical sections with and without a step inside,
    # and a worker stopped inside one.
    inputs = [(a.runs[0].kind, a.runs[0].input) for a in plan.actions if a.op == "submit"]
    shared = Counter(i.get("shared") for (k, i) in inputs if k == "session")
    assert shared[True] >= 3 and shared[False] >= 3
    cas = Counter(i.get("cas") for (k, i) in inputs if k == "artifact")
    assert cas[True] >= 3 and cas[False] >= 3
    step = Counter(i.get("step") for (k, i) in inputs if k == "lock")
    assert step[True] >= 1 and step[False] >= 1
    assert sum(a.op == "lock_stop" for a in plan.actions) >= 1
    assert sum(a.op == "put_kill" for a in plan.actions) >= 1
    # Each cx_publish_wait run is sent its matching event; some runs before they are even
    # submitted (the wait's lookback finds it), others while they wait; decoys of each kind.
    submit_at = {a.runs[0].run_id: a.at_s for a in plan.actions
                 if a.op == "submit" and a.runs[0].kind == "publish_wait"}
    matches = [a for a in plan.actions if a.op == "order" and a.pick == 0]
    assert {a.runs[0].run_id for a in matches} == set(submit_at)
    assert sum(a.at_s < submit_at[a.runs[0].run_id] for a in matches) >= 3
    assert sum(a.ops == ("parked",) for a in matches) >= 3  # sent once the run parked
    assert Counter(a.event_id for a in matches).most_common(1)[0][1] == 2  # a resend
    decoys = Counter(DECOYS[(a.pick - 1) % len(DECOYS)] for a in plan.actions
                     if a.op == "order" and a.pick)
    assert set(decoys) == set(DECOYS), decoys
