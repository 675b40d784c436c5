"""The seeded plan of a chaos run: what is submitted when, and which fault strikes when.

Everything here is a pure function of (seed, runs, kills, lease): the same arguments give
the same plan, so ``ops/chaos --seed N`` replays the same schedule of faults. Times are
seconds from the start of the chaos phase. Which process a fault hits is chosen at that
moment from what runs then (a horse exists only while a run executes), using the fault's
own seeded draw (`pick`); only that choice depends on timing.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

from marbles_rq.triggers.events import event_key
from tests.chaos.names import (
    CUSTOMERS,
    EVENT_SOURCE,
    ORDER_TYPE,
    PRIORITIES,
    RATE_KEYS,
    RETRY_EXHAUST,
)

# Worker kills are spread evenly over these kinds (then shuffled).
ASYNC_CHAINS = 0.3  # the share of chains that are async workflows (cx_async_chain)
WORKER_KILLS = ("worker_parent", "horse", "worker_group", "pool_executor")
FAULT_KINDS = (*WORKER_KILLS, "leader", "redis", "stop_worker", "stop_leader")

# Run kinds and their weights (per hundred submitted runs).
RUN_WEIGHTS: dict[str, int] = {
    "chain": 24, "batch": 10, "dup": 5, "ask": 8, "timer": 8, "parent": 6, "fan": 7,
    "event": 7, "cancel": 2,
    # The combinations (issue 16): pause/resume storms, short-lived children gathered late,
    # parents cancelled while they start children, concurrency limits (global and per key),
    # reruns from a step, priorities.
    "pause": 5, "late_child": 3, "spawn_cancel": 3, "limited": 4, "limited_key": 4,
    "rerun": 3, "priority": 4,
    # Signals: runs that wait for signals the harness sends while it kills; some started by
    # signal-with-start.
    "signal": 4,
}
# Published state and event waits: cx_publish_wait runs per hundred, on top of RUN_WEIGHTS
# (drawn apart, so adding them changed no other draw of the plan).
PUBLISH_WAITS = 4
# The events sent to a cx_publish_wait run (by the `pick` of its "order" action): its
# matching event, then decoys on the same source that must never reach it.
DECOYS = ("other_order", "other_field", "other_type")
# Compensating runs (cx_saga) per hundred, drawn apart as the publish waits are.
SAGAS = 3
# Runs of a step under a retry policy (cx_retry) per hundred, drawn apart too: most fail
# 1 to 3 tries and succeed; some run out of tries and pause until the harness retries them
# with a patched input; a few run out of tries and fail.
RETRIES = 3
# Rate-limited runs (cx_rate, 10/s per lane): bursts of RATE_BURST runs submitted at once,
# per 500 runs, so each lane's limit holds some.
RATE_BURSTS = 2
RATE_BURST = 24
# Runs of issue 23's records per hundred, drawn apart too: sessions (cx_session, about half
# of them also appending to one shared session), artifacts (cx_artifact, half of them by
# compare-and-set on one artifact) and the durable mutex (cx_lock, every run on one lock).
SESSIONS = 3
ARTIFACTS = 3
LOCKS = 3
# Per 250 runs: the harness SIGSTOPs the worker of an execution inside cx_lock's critical
# section (whichever is inside then) for LOCK_STOP_MS, past its hold's lapse (LOCK_LEASE_S):
# the run goes on elsewhere, and the stopped execution's write must be refused once it wakes.
LOCK_STOPS = 1
LOCK_STOP_MS = (6500, 8000)
# Per 250 runs: the harness SIGKILLs the process executing a cx_put step that has put its
# version and not returned (preferring one whose compare-and-set met a conflict first): its
# redelivery runs the step again, which must not put a second version.
PUT_KILLS = 2
BATCH_SIZE = 25
BATCH_DUPLICATES = 3  # ids submitted before, sent again inside each batch


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    pick: int  # the seeded draw that chooses the target among the candidates of the moment
    hold_s: float = 0.0  # stop_*: how long the process stays stopped; redis: down time


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    kind: str  # a RUN_WEIGHTS key
    workflow: str
    input: dict[str, Any]
    via: str = "api"  # api | cli | batch | event | client (mr.Client) | later (start_at)
    priority: int | None = None  # enqueue with this priority (None: the workflow's)
    start_in_ms: int = 0  # via later: start_at this long after the submission


@dataclass(frozen=True)
class Action:
    """One thing the submitter does at `at_s`."""

    at_s: float
    op: str  # submit | resend | batch | send | cancel | cancel_spawning | pause | rerun |
    #          signal (pick: the signal's index) | signal_start (signal-with-start, index 0) |
    #          order (an event for a cx_publish_wait run; pick: 0 its match, else a decoy) |
    #          cancel_compensate (cancel --compensate of a cx_saga run) |
    #          retry_patch (once a cx_retry run paused on its step: retry --input-patch) |
    #          lock_stop (SIGSTOP the worker of an execution inside cx_lock's critical
    #          section, for pick_ms; runs: none) | put_kill (SIGKILL the process
    #          executing a cx_put step between its put and its return; runs: none)
    runs: tuple[RunSpec, ...]
    via: str = "api"  # api | cli | cli-kill (a CLI SIGKILLed while it works) | thread (at
    #                   once, from another thread)
    event_id: str = ""
    # pause: "pause" / "resume" calls made back to back, in order ("started": first wait
    # for the run to start; "hold": wait HOLD_S between two calls); order: ("parked",)
    # sends only once the run has parked (then after `pick_ms`)
    ops: tuple[str, ...] = ()
    pick: int = 0  # rerun: the seeded draw that chooses the step to rerun from;
    #                cancel_spawning: ms to wait after the first child started
    pick_ms: int = 0  # order with ops ("parked",): ms to wait after the park


@dataclass(frozen=True)
class Plan:
    seed: int
    runs: int
    kills: int
    duration_s: float
    faults: tuple[Fault, ...]
    actions: tuple[Action, ...]
    minimums: dict[str, int] = field(default_factory=dict)

    def fault_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(FAULT_KINDS, 0)
        for fault in self.faults:
            counts[fault.kind] += 1
        return counts


def duration_for(runs: int, kills: int) -> float:
    """The chaos phase: long enough to submit the runs and to space the faults."""
    return max(60.0, runs * 0.2, kills * 2.0)


def make_plan(seed: int, runs: int = 500, kills: int = 30, *, lease_ms: int = 2000) -> Plan:
    rng = random.Random(seed)
    duration = duration_for(runs, kills)
    faults = _faults(random.Random(rng.getrandbits(64)), kills, duration, lease_ms)
    actions = _actions(random.Random(rng.getrandbits(64)), seed, runs, duration)
    minimums = {"worker": kills, "leader": _leader_kills(kills), "redis": _redis_kills(kills),
                "stop": _stops(kills, "stop_worker") + _stops(kills, "stop_leader")}
    return Plan(seed, runs, kills, duration, tuple(faults), tuple(actions), minimums)


def _leader_kills(kills: int) -> int:
    return max(5, kills // 6)


def _redis_kills(kills: int) -> int:
    return max(2, kills // 15)


def _stops(kills: int, kind: str) -> int:
    return max(2, kills // 10) if kind == "stop_worker" else max(1, kills // 15)


def _spread(rng: random.Random, n: int, start: float, end: float) -> list[float]:
    """n times in [start, end], one uniformly inside each of n equal slots (well spread)."""
    if n <= 0:
        return []
    width = (end - start) / n
    return [round(start + width * i + rng.uniform(0.1, 0.9) * width, 3) for i in range(n)]


def _faults(rng: random.Random, kills: int, duration: float, lease_ms: int) -> list[Fault]:
    start, end = 3.0, duration - 2.0
    lease_s = lease_ms / 1000
    kinds = [WORKER_KILLS[i % len(WORKER_KILLS)] for i in range(kills)]
    rng.shuffle(kinds)
    out = [Fault(t, kind, rng.getrandbits(16))
           for t, kind in zip(_spread(rng, kills, start, end), kinds, strict=True)]
    out += [Fault(t, "leader", rng.getrandbits(16))
            for t in _spread(rng, _leader_kills(kills), start, end)]
    out += [Fault(t, "redis", rng.getrandbits(16), round(rng.uniform(0.0, 1.0), 3))
            for t in _spread(rng, _redis_kills(kills), start + 2, end - 2)]
    for kind in ("stop_worker", "stop_leader"):
        out += [Fault(t, kind, rng.getrandbits(16), round(lease_s + rng.uniform(0.5, 2.0), 3))
                for t in _spread(rng, _stops(kills, kind), start, end)]
    return sorted(out, key=lambda f: (f.at_s, f.kind))


def _kinds(rng: random.Random, runs: int) -> list[str]:
    """`runs` run kinds in the plan's proportions; batches come in whole batches."""
    total = sum(RUN_WEIGHTS.values())
    counts = {k: runs * w // total for k, w in RUN_WEIGHTS.items()}
    counts["batch"] = counts["batch"] // BATCH_SIZE * BATCH_SIZE
    counts["chain"] += runs - sum(counts.values())
    kinds = [k for k, n in counts.items() for _ in range(n) if k != "batch"]
    kinds += ["batch"] * (counts["batch"] // BATCH_SIZE)  # one entry per batch
    rng.shuffle(kinds)
    return kinds


def _actions(rng: random.Random, seed: int, runs: int, duration: float) -> list[Action]:
    kinds = _kinds(rng, runs)
    times = sorted(round(rng.uniform(0.2, duration * 0.85), 3) for _ in kinds)
    actions: list[Action] = []
    submitted: list[RunSpec] = []
    n = 0

    def rid(kind: str) -> str:
        nonlocal n
        n += 1
        return f"cx-{seed}-{n:05d}-{kind}"

    # Its own draws: which chains are async workflows leaves every other draw as it was.
    async_rng = random.Random(seed * 7_919 + 3)

    def chain(kind: str, via: str = "api") -> RunSpec:
        flaky = rng.random() < 0.12
        doomed = rng.random() < 0.04
        name = "cx_async_chain" if async_rng.random() < ASYNC_CHAINS else "cx_chain"
        return RunSpec(rid(kind), kind, name,
                       {"n": rng.randint(2, 5), "sleep_ms": rng.choice([2, 10, 30, 80]),
                        "flaky": flaky, "doomed": doomed}, via)

    # Its own draws: which chains go through the public client, some with a start_at,
    # leave every other draw of the plan as it was.
    via_rng = random.Random(seed * 1_000_003 + 17)
    for at, kind in zip(times, kinds, strict=True):
        if kind == "chain":
            spec = chain(kind, "cli" if rng.random() < 0.04 else "api")
            draw = via_rng.random()
            if spec.via == "api" and draw < 0.06:
                spec = dataclasses.replace(spec, via="later",
                                           start_in_ms=via_rng.randint(300, 3000))
            elif spec.via == "api" and draw < 0.16:
                spec = dataclasses.replace(spec, via="client")
            actions.append(Action(at, "submit", (spec,), spec.via))
            submitted.append(spec)
        elif kind == "batch":
            fresh = [chain("batch", "batch") for _ in range(BATCH_SIZE)]
            again = rng.sample(submitted, min(BATCH_DUPLICATES, len(submitted)))
            actions.append(Action(at, "batch", (*fresh, *again), "api"))
            submitted += fresh
        elif kind == "dup":
            spec = chain(kind)
            # A quarter of the first enqueues are a CLI killed while it works (SIGKILL at a
            # seeded moment): the run may be recorded or not; the second enqueue settles it.
            first = "cli-kill" if rng.random() < 0.25 else "api"
            actions.append(Action(at, "submit", (spec,), first))
            how = rng.choice(["api", "cli", "thread"])
            actions.append(Action(at if how == "thread" else round(at + rng.uniform(0.1, 3), 3),
                                  "resend", (spec,), how))
            submitted.append(spec)
        elif kind == "ask":
            spec = RunSpec(rid(kind), kind, "cx_ask",
                           {"kind": rng.choice(["question", "question", "approval"]),
                            "sleep_ms": 10})
            actions.append(Action(at, "submit", (spec,)))
            submitted.append(spec)
        elif kind == "timer":
            spec = RunSpec(rid(kind), kind, "cx_timer",
                           {"sleep_s": round(rng.uniform(0.3, 3.0), 2), "sleep_ms": 10})
            actions.append(Action(at, "submit", (spec,)))
            submitted.append(spec)
        elif kind == "parent":
            spec = RunSpec(rid(kind), kind, "cx_parent",
                           {"children": rng.randint(1, 3), "sleep_ms": 10})
            actions.append(Action(at, "submit", (spec,)))
            submitted.append(spec)
        elif kind == "fan":
            spec = RunSpec(rid(kind), kind, "cx_fan",
                           {"width": rng.randint(2, 4), "sleep_ms": rng.choice([5, 20, 50])})
            actions.append(Action(at, "submit", (spec,)))
            submitted.append(spec)
        elif kind == "event":
            event_id = rid(kind)  # the provider's id; the run's id is derived from it
            spec = RunSpec(event_key(EVENT_SOURCE, event_id), kind, "cx_event",
                           {"n": n}, "event")
            # The same for events: a sender killed midway may leave a pending event, which
            # the controller must turn into its one run.
            first = "cli-kill" if rng.random() < 0.25 else "api"
            actions.append(Action(at, "send", (spec,), first, event_id))
            how = rng.choice(["api", "cli", "thread"])
            actions.append(Action(at if how == "thread" else round(at + rng.uniform(0.1, 3), 3),
                                  "send", (spec,), how, event_id))
        elif kind == "cancel":
            spec = RunSpec(rid(kind), kind, "cx_chain",
                           {"n": 8, "sleep_ms": 250, "flaky": False, "doomed": False})
            actions.append(Action(at, "submit", (spec,)))
            actions.append(Action(round(at + rng.uniform(0.3, 3.0), 3), "cancel", (spec,),
                                  rng.choice(["api", "cli"])))
        elif kind == "pause" and not any(a.op == "pause" for a in actions):
            # The plan's first pause is a sure park, whatever the timing: paused once
            # running, in a step of 200 ms (so the next commit answers "paused"), and
            # resumed only after a hold of several seconds (the park has landed by then,
            # on this execution or, after a kill, on the redelivered one).
            spec = RunSpec(rid(kind), kind, "cx_chain",
                           {"n": 12, "sleep_ms": 200, "flaky": False, "doomed": False})
            actions.append(Action(at, "submit", (spec,)))
            actions.append(Action(at, "pause", (spec,), ops=("started", "pause", "hold",
                                                             "resume")))
        elif kind == "pause":
            # Slow steps (a pause lands inside one) or many quick ones (a commit, and so a
            # park, every few ms: a resume right after a pause can land between them).
            fast = rng.random() < 0.5
            spec = RunSpec(rid(kind), kind, "cx_chain",
                           {"n": 24 if fast else 6,
                            "sleep_ms": rng.choice([2, 10] if fast else [100, 200]),
                            "flaky": False, "doomed": False})
            actions.append(Action(at, "submit", (spec,)))
            actions += _storms(rng, at, spec)
        elif kind == "late_child":
            spec = RunSpec(rid(kind), kind, "cx_late_parent",
                           {"children": rng.randint(1, 3),
                            "wait_s": round(rng.uniform(6.0, 9.0), 2), "sleep_ms": 10})
            actions.append(Action(at, "submit", (spec,)))
        elif kind == "spawn_cancel":
            spec = RunSpec(rid(kind), kind, "cx_spawner",
                           {"children": rng.randint(2, 4), "sleep_ms": rng.choice([100, 200])})
            actions.append(Action(at, "submit", (spec,)))
            # Cancelled once it has started its first child (whenever a worker took it up),
            # after a seeded delay: while the next children start.
            actions.append(Action(at, "cancel_spawning", (spec,),
                                  "cli" if rng.random() < 0.2 else "api",
                                  pick=rng.randrange(0, 400)))
        elif kind in ("limited", "limited_key"):
            inp: dict[str, Any] = {"n": rng.randint(1, 3), "sleep_ms": rng.choice([50, 150, 300])}
            if kind == "limited_key":
                inp["customer"] = rng.choice(CUSTOMERS)
            spec = RunSpec(rid(kind), kind, "cx_" + kind, inp,
                           "cli" if rng.random() < 0.05 else "api")
            actions.append(Action(at, "submit", (spec,), spec.via))
        elif kind == "rerun":
            spec = RunSpec(rid(kind), kind, "cx_rr", {"n": rng.randint(4, 8)})
            actions.append(Action(at, "submit", (spec,)))
            rerun = RunSpec(f"{spec.run_id}-rr", kind, "cx_rr", spec.input)
            actions.append(Action(round(at + rng.uniform(3.0, 8.0), 3), "rerun",
                                  (spec, rerun), "cli" if rng.random() < 0.25 else "api",
                                  pick=rng.getrandbits(16)))
        elif kind == "signal":
            n_signals = rng.randint(2, 4)
            spec = RunSpec(rid(kind), kind, "cx_signals",
                           {"n": n_signals, "sleep_ms": rng.choice([10, 50])})
            first = 0
            if rng.random() < 0.4:  # created by its first signal (signal-with-start)
                actions.append(Action(at, "signal_start", (spec,),
                                      "cli" if rng.random() < 0.2 else "api", pick=0))
                first = 1
            else:
                actions.append(Action(at, "submit", (spec,)))
            moment = at
            for index in range(first, n_signals):
                moment = round(moment + rng.uniform(0.1, 3.0), 3)
                actions.append(Action(moment, "signal", (spec,),
                                      "cli" if rng.random() < 0.15 else "api", pick=index))
        elif kind == "priority":
            spec = RunSpec(rid(kind), kind, "cx_chain",
                           {"n": rng.randint(2, 4), "sleep_ms": rng.choice([10, 30]),
                            "flaky": False, "doomed": False},
                           "cli" if rng.random() < 0.1 else "api", rng.choice(PRIORITIES))
            actions.append(Action(at, "submit", (spec,), spec.via))
            submitted.append(spec)
    # Their own draws too: the runs that publish and wait for events leave every other draw
    # (and so the other workloads' coverage) as it was.
    actions += _publish_waits(random.Random(seed * 1_000_003 + 29), seed, runs, duration)
    actions += _sagas(random.Random(seed * 1_000_003 + 31), seed, runs, duration)
    actions += _retries(random.Random(seed * 1_000_003 + 37), seed, runs, duration)
    actions += _rates(random.Random(seed * 1_000_003 + 41), seed, runs, duration)
    actions += _sessions(random.Random(seed * 1_000_003 + 43), seed, runs, duration)
    actions += _artifacts(random.Random(seed * 1_000_003 + 47), seed, runs, duration)
    actions += _locks(random.Random(seed * 1_000_003 + 53), seed, runs, duration)
    return sorted(actions, key=lambda a: a.at_s)


def order_event(run_id: str, pick: int) -> tuple[str, dict[str, Any]]:
    """The type and payload of a cx_publish_wait run's `pick`-th event: 0 matches its wait
    (type paid, order = its run id); each decoy misses by one thing."""
    if pick == 0:
        return ORDER_TYPE, {"order": run_id, "amount": len(run_id)}
    decoy = DECOYS[(pick - 1) % len(DECOYS)]
    if decoy == "other_order":
        return ORDER_TYPE, {"order": f"{run_id}-x", "decoy": pick}
    if decoy == "other_field":
        return ORDER_TYPE, {"ref": run_id, "decoy": pick}
    return "refunded", {"order": run_id, "decoy": pick}


def _publish_waits(rng: random.Random, seed: int, runs: int, duration: float
                   ) -> list[Action]:
    """cx_publish_wait runs, each sent its matching event at a seeded moment -- before its
    submission (found by the wait's lookback), around the moment it opens the wait, or
    while it is parked -- some twice under the same id, and decoys around it."""
    out = []
    for k in range(max(5, runs * PUBLISH_WAITS // 100)):
        at = round(rng.uniform(0.5, duration * 0.85), 3)
        spec = RunSpec(f"cx-{seed}-pw{k:03d}-publish_wait", "publish_wait", "cx_publish_wait",
                       {"sleep_ms": rng.choice([10, 50, 200])})
        out.append(Action(at, "submit", (spec,), "cli" if rng.random() < 0.1 else "api"))
        # A third each (so every short mode has some): before the run exists; while it
        # starts (racing the wait's opening); while it waits, parked -- sent only once its
        # journal says so, whatever the box's speed (CI's slower runners queued every run
        # past a send timed from its submission, and parked none).
        parked = k % 3 == 2
        if k % 3 == 0:
            sent = at - rng.uniform(0.05, 2.0)
        elif k % 3 == 1:
            sent = at + rng.uniform(0.0, 0.5)
        else:
            sent = at
        times = [sent]
        if k % 4 == 3:  # the same event again (a sender's retry): taken once
            times.append(sent + rng.uniform(0.0, 2.0))
        for moment in times:
            out.append(Action(round(max(0.05, moment), 3), "order", (spec,),
                              "cli" if rng.random() < 0.15 else "api", f"{spec.run_id}-e0",
                              ops=("parked",) if parked else (),
                              pick_ms=rng.randint(0, 2000) if parked else 0))
        for pick in range(1, rng.randint(1, 4) + 1):
            moment = max(0.05, at + rng.uniform(-2.0, 8.0))
            out.append(Action(round(moment, 3), "order", (spec,),
                              "cli" if rng.random() < 0.15 else "api",
                              f"{spec.run_id}-e{pick}", pick=pick))
    return out


def _sagas(rng: random.Random, seed: int, runs: int, duration: float) -> list[Action]:
    """cx_saga runs: half fail at their doomed step, half wait and are cancelled with
    compensation at a seeded moment (running, waiting, or before they start)."""
    out = []
    for k in range(max(4, runs * SAGAS // 100)):
        at = round(rng.uniform(0.5, duration * 0.85), 3)
        wait = k % 2 == 1
        spec = RunSpec(f"cx-{seed}-sg{k:03d}-saga", "saga", "cx_saga",
                       {"n": rng.randint(2, 4), "sleep_ms": rng.choice([10, 50, 150]),
                        "wait": wait})
        out.append(Action(at, "submit", (spec,), "cli" if rng.random() < 0.1 else "api"))
        if wait:
            out.append(Action(round(at + rng.uniform(0.0, 4.0), 3), "cancel_compensate",
                              (spec,), rng.choice(["api", "cli"])))
    return out


def _retries(rng: random.Random, seed: int, runs: int, duration: float) -> list[Action]:
    """cx_retry runs: of each six, three fail 1 to 3 tries then succeed, two run out of
    tries and pause (the harness retries them with a patch once they have), one runs out
    and fails."""
    out = []
    for k in range(max(6, runs * RETRIES // 100)):
        at = round(rng.uniform(0.5, duration * 0.8), 3)
        role = k % 6
        fails = rng.randint(1, 3) if role < 3 else RETRY_EXHAUST
        spec = RunSpec(f"cx-{seed}-rt{k:03d}-retry", "retry", "cx_retry",
                       {"fails": fails, "pause": role in (3, 4),
                        "sleep_ms": rng.choice([5, 20, 60])})
        out.append(Action(at, "submit", (spec,), "cli" if rng.random() < 0.1 else "api"))
        if role in (3, 4):
            out.append(Action(at, "retry_patch", (spec,), "cli" if role == 3 else "api"))
    return out


def _rates(rng: random.Random, seed: int, runs: int, duration: float) -> list[Action]:
    """cx_rate runs in bursts (all submitted at one moment, across the lanes)."""
    out = []
    bursts = max(1, round(runs * RATE_BURSTS / 500))
    for b, at in enumerate(_spread(rng, bursts, 2.0, duration * 0.8)):
        for i in range(RATE_BURST):
            spec = RunSpec(f"cx-{seed}-rl{b:02d}{i:02d}-rate", "rate", "cx_rate",
                           {"lane": rng.choice(RATE_KEYS), "sleep_ms": rng.choice([2, 10])})
            out.append(Action(at, "submit", (spec,), "api"))
    return out


def _sessions(rng: random.Random, seed: int, runs: int, duration: float) -> list[Action]:
    """cx_session runs, half of them appending to the shared session too; some in bursts of
    three (several runs appending to the shared session at once)."""
    out = []
    k, total = 0, max(6, runs * SESSIONS // 100)
    while k < total:
        at = round(rng.uniform(0.5, duration * 0.8), 3)
        for _ in range(min(3 if rng.random() < 0.3 else 1, total - k)):
            spec = RunSpec(f"cx-{seed}-ss{k:03d}-session", "session", "cx_session",
                           {"steps": rng.randint(1, 3), "shared": k % 2 == 0,
                            "sleep_ms": rng.choice([5, 20, 60])})
            out.append(Action(at, "submit", (spec,)))
            k += 1
    return out


def _artifacts(rng: random.Random, seed: int, runs: int, duration: float) -> list[Action]:
    """cx_artifact runs: plain puts and compare-and-set puts, the latter some in bursts of
    four (conflicts)."""
    out = []
    k, total, burst = 0, max(6, runs * ARTIFACTS // 100), 0
    while k < total:
        at = round(rng.uniform(0.5, duration * 0.8), 3)
        cas = burst % 2 == 1
        burst += 1
        for _ in range(min(4 if cas and rng.random() < 0.5 else 1, total - k)):
            spec = RunSpec(f"cx-{seed}-ar{k:03d}-artifact", "artifact", "cx_artifact",
                           {"cas": cas, "sleep_ms": rng.choice([10, 40, 120])})
            out.append(Action(at, "submit", (spec,)))
            k += 1
    for n in range(max(1, runs * PUT_KILLS // 250)):
        at = round(rng.uniform(duration * 0.1, duration * 0.6), 3)
        out.append(Action(at, "put_kill", (), pick=n))
    return out


def _locks(rng: random.Random, seed: int, runs: int, duration: float) -> list[Action]:
    """cx_lock runs, some in bursts of three (waiters queued behind a holder)."""
    out = []
    k, total = 0, max(4, runs * LOCKS // 100)
    while k < total:
        at = round(rng.uniform(0.5, duration * 0.8), 3)
        for _ in range(min(3 if rng.random() < 0.3 else 1, total - k)):
            spec = RunSpec(f"cx-{seed}-lk{k:03d}-lock", "lock", "cx_lock",
                           {"hold_ms": rng.choice([20, 100, 300]), "step": rng.random() < 0.5,
                            "sleep_ms": rng.choice([10, 60])})
            out.append(Action(at, "submit", (spec,)))
            k += 1
    for n in range(max(1, runs * LOCK_STOPS // 250)):
        at = round(rng.uniform(duration * 0.1, duration * 0.6), 3)
        out.append(Action(at, "lock_stop", (), pick_ms=rng.randint(*LOCK_STOP_MS), pick=n))
    return out


def _storms(rng: random.Random, at: float, spec: RunSpec) -> list[Action]:
    """Pause/resume storms on one run: each pauses it at a random moment (queued, running,
    waiting or finished) and resumes it, later or back to back; every storm ends with a
    resume, so the run's last pause is always resumed."""
    out = []
    moment = at
    for n in range(rng.randint(1, 3)):
        moment = round(moment + rng.uniform(0.0, 2.0), 3)
        shape = rng.choice(["apart", "apart", "back", "back twice", "resume first"])
        # Half the first storms wait for the run to have started (a queue may hold it for
        # long on a loaded machine): they pause a running run.
        started = ("started",) if n == 0 and rng.random() < 0.5 else ()
        if shape == "apart":
            out.append(Action(moment, "pause", (spec,), ops=(*started, "pause")))
            moment = round(moment + rng.uniform(0.05, 2.5), 3)
            out.append(Action(moment, "pause", (spec,), ops=("resume",)))
        elif shape == "back":
            out.append(Action(moment, "pause", (spec,), ops=(*started, "pause", "resume")))
        elif shape == "back twice":
            out.append(Action(moment, "pause", (spec,),
                              ops=(*started, "pause", "resume", "pause", "resume")))
        else:
            out.append(Action(moment, "pause", (spec,),
                              ops=(*started, "resume", "pause", "resume")))
    return out
