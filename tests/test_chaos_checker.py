"""The chaos history checker can fail: a hand-made history that is correct passes, and each
kind of violation, planted alone into a copy of it, is reported (tests/chaos/checker.py).
No Redis, no processes: the checker reads only the History it is given."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import pytest

from tests.chaos.checker import KINDS, check, summary
from tests.chaos.history import (
    AnswerTry,
    Cancel,
    Claim,
    Crash,
    Ev,
    Execution,
    Fault,
    History,
    Run,
    Sent,
    Step,
    Submitted,
)
from tests.chaos.names import SCHEDULES, TICK_KEY
from tests.chaos.plan import make_plan

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

    def step(self, key: str, name: str = "cx_link", *, effect: bool = True) -> str:
        rid = self.run.id
        ikey = f"{rid}:{key}"
        self.ev("step_started", step=key, attempt=1)
        self.h.executions.append(Execution(f"x{next(_ids)}", rid, key, self.epoch,
                                           self.attempt))
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
    ask.park("question", questions=["q"])
    ask.ev("answered", key="q", answer="red")
    ask.wake("answer")
    ask.start()
    after = ask.step("cx_ask.cx_echo#0", "cx_echo", effect=False)
    ask.finish({"answer": "red", "steps": [before, after]})
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

    h.faults.append(Fault("worker_parent", T0 + 5, (100,), "w0"))
    h.crashes.append(Crash("w1", 3, excused="Redis was down"))
    return h


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


def _timer_early(h: History) -> None:
    run = h.runs["r-timer"]
    due = run.steps["cx_timer.|sleep#0"].result["due_ms"]
    run.events = [Ev(due - 300, e.seq, e.type, e.attempt, e.data)
                  if e.type == "woken" else e for e in run.events]


def _timer_twice(h: History) -> None:
    run = h.runs["r-timer"]
    woken = next(e for e in run.events if e.type == "woken")
    run.events.insert(run.events.index(woken) + 1, woken)


def _child_twice(h: History) -> None:
    extra = Builder(h, "r-parent.c9", "cx_child", {"i": 9}, parent="r-parent")
    extra.start()
    extra.finish({"i": 9, "steps": [extra.step("cx_child.cx_link#0")]})


def _child_result(h: History) -> None:
    run = h.runs["r-parent"]
    run.result = {**run.result, "children": list(reversed(run.result["children"]))}


def _lost(h: History) -> None:
    del h.runs["r-fan"]


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


def _crash(h: History) -> None:
    h.crashes.append(Crash("c0 (controller, pid 42)", 1, tail="Traceback ..."))


MUTATIONS: dict[str, tuple[str, Callable[[History], None]]] = {
    "lost": ("lost", _lost),
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
    "timer_early": ("timer_early", _timer_early),
    "timer_once": ("timer_once", _timer_twice),
    "child_twice": ("child_twice", _child_twice),
    "child_result": ("child_result", _child_result),
    "crash": ("crash", _crash),
    "zombie_write_parked": ("zombie_write", _write_while_parked),
    "zombie_write_epoch": ("zombie_write", _output_of_old_epoch),
    "zombie_write_commit": ("zombie_write", _commit_without_execution),
}


def test_a_correct_history_passes() -> None:
    history = valid_history()
    report = check(history)
    assert report.violations == [], "\n".join(map(str, report.violations))
    assert report.checked["effects"] >= 10 and report.checked["questions"] == 1
    assert report.checked["timers"] == 1 and report.checked["children"] == 2
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
    runs = {r.run_id for a in make_plan(11).actions for r in a.runs}
    assert len(runs) == 500
