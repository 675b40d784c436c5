"""The workflows of the chaos test (loaded with ``--source tests.chaos.workloads``).

Every step body leaves receipts in the same Redis (append-only, fsync always: as durable as
the runs themselves), so the checker can tell what executed, not only what was recorded:

* ``cx:exec`` -- one JSON entry per start of a step body: ``{x, run, step, epoch, attempt,
  pid, t}`` (``x`` is unique per execution: a resend after a Redis restart is told apart;
  ``epoch`` is the execution's fence, which orders executions of one run).
* ``cx:claims`` -- one entry per effect claim answered: ``{x, run, step, key, epoch,
  outcome}`` with outcome ``won``, ``exists`` or ``refused:<why>``.
* ``cx:applied`` (set) and ``cx:effects`` (list) -- the effect's target: a script applies a
  key at most once (the idempotent-target pattern of examples/chain.py), so ``cx:effects``
  holds each applied key exactly once if the engine kept its key stable.

A step claims its effect with ``claim_effect(idempotency_key)`` (the store's at-most-once
receipt) and then applies it to the target under the same key (exactly once end to end).
It also writes an output line ``{"epoch", "step"}``: the checker sees in the journal whether
a line was accepted from an execution that no longer owned the run.

Workflows (all return ``{"steps": [idempotency keys of their steps], ...}``):

* ``cx_async_chain`` -- ``cx_chain`` as an async workflow (gathered async steps), part of
  the chains.
* ``cx_chain`` -- N linked steps; optionally a flaky step (fails its first try, retried) and
  a doomed step (always fails: the run must end ``failed``).
* ``cx_ask`` -- a step, a patch marker (``mr.patched``), a question or an approval (key
  ``q``) the harness answers, a step.
* ``cx_timer`` -- a step, ``mr.sleep``, a step.
* ``cx_parent`` / ``cx_child`` -- children started with stable keys, gathered.
* ``cx_fan`` -- ``mr.parallel`` over N steps, then one more.
* ``cx_tick`` (every 1 s, overlap allow) and ``cx_tock`` (every 2 s, from completion) --
  schedules.
* ``cx_event`` -- triggered by inbound events of source ``chaos``.
* ``cx_signals`` -- a step, ``n`` waits for signal ``nudge`` (sent by the harness while it
  kills; some runs started by signal-with-start), a step; returns the payloads in the order
  it took them.
* ``cx_publish_wait`` -- publishes its state before and after a step, waits for the event of
  source ``chaos-orders`` whose payload's ``order`` is its own run id (the harness sends it
  before or after the run reaches the wait, among decoys), publishes what it received and
  returns that same value.
* ``cx_saga`` -- steps that register undos as they succeed (``@mr.step(compensate=...)``
  and ``ctx.compensate`` of a module-level function), then a doomed step, or a wait the
  harness ends with ``cancel --compensate``: the undos (effects of their own, each
  returning which registration it undoes) run in reverse, once each.
* ``cx_retry`` -- a step under a retry policy (parked between tries) that fails its first
  ``fails`` tries (counted per idempotency key in ``cx:retry_tries``), then applies its
  effect and succeeds; with ``fails`` beyond its tries it fails the run, or (``pause``)
  pauses it on the step until the harness retries it with the input patch ``{"fails": 0}``.
* ``cx_rate`` -- ``rate_limit="10/s"`` per ``lane``: one quick step, whose start the
  checker measures (no window of one second holds more than 10 per lane).
* ``cx_session`` -- appends numbered messages to its own session (``mr.session()``) in its
  body and in its steps (``cx_say``), and some runs to the session ``chaos-shared`` they all
  share: every append is replayed by every later execution of the body (and again by a step
  run again after a kill), and must be kept once, in order.
* ``cx_artifact`` -- a step (``cx_put``) puts a version of ``chaos-art`` naming its run and
  step, or of ``chaos-art-cas`` by compare-and-set (``expect_version``: the latest version
  it read, read again on each ``ArtifactConflict``); the step leaves a receipt in ``cx:puts``
  and naps after its put (longer after a compare-and-set), so a kill -- the harness aims
  some at it -- lands between the put and the commit.
* ``cx_lock`` -- ``with mr.lock("chaos-lock")``: inside, the body reads a counter (entering)
  and writes it plus one (leaving) with scripts that check the lock's holder in the store
  (run and epoch: a fenced write, refused to an execution that no longer holds it); each
  entry and exit leaves a receipt in ``cx:lock_holds`` with the server's time; some runs
  run a step inside the section (a kill there redelivers the run inside it).

The combinations (issue 16), each under the same faults:

* pause/resume storms hit ``cx_chain`` runs (the harness pauses and resumes them at random
  moments, some back to back);
* ``cx_late_parent`` / ``cx_brief`` -- children kept only ``retention_s=1`` after they
  finish, gathered by a parent that first sleeps past that;
* ``cx_spawner`` -- a parent that starts children between steps, cancelled by the harness
  while it does;
* ``cx_limited`` (``concurrency=2``) and ``cx_limited_key`` (``concurrency=1`` per
  ``customer``) -- the harness samples their slots in the store;
* ``cx_rr`` -- quick steps of two names (so results recorded in one millisecond are common),
  rerun ``--from-step`` by the harness once finished;
* priorities: ``cx_chain`` runs enqueued with ``priority`` N; every execution receipt names
  the RQ queue its delivery came from (``origin``), which must be the run's band.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import redis
import rq
from redis.backoff import NoBackoff
from redis.retry import Retry

import marbles_rq as mr
from marbles_rq.engine.event_waits import EventWaitTimeoutError
from tests.chaos.names import (
    APPLIED_KEY,
    ARTIFACT_CAS,
    ARTIFACT_PLAIN,
    CAS_THINK_MS,
    CLAIMS_KEY,
    COLOURS,
    EFFECTS_KEY,
    EVENT_SOURCE,
    EXEC_KEY,
    FLAKY_KEY,
    LIMIT_GLOBAL,
    LIMIT_PER_KEY,
    LOCK_COUNTER_KEY,
    LOCK_DONE_KEY,
    LOCK_HOLDS_KEY,
    LOCK_LEASE_S,
    LOCK_NAME,
    ORDER_SOURCE,
    ORDER_TIMEOUT_S,
    ORDER_TYPE,
    PUT_LINGER_MS,
    PUTS_KEY,
    QUESTION_KEY,
    RATE_PER_S,
    RETRY_INITIAL,
    RETRY_KEY,
    RETRY_MAX_ATTEMPTS,
    SAGA_SIGNAL,
    SAGA_WAIT_S,
    SESSION_SHARED,
    SIGNAL_NAME,
    SIGNAL_TIMEOUT_S,
    SOURCE,
    STATE_KEY,
    TICK_KEY,
    TOCK_KEY,
)

# The target's own idempotency: remember the key and do the effect in one atomic step.
_APPLY_ONCE = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

T = TypeVar("T")
__all__ = ["SOURCE"]
_clients: dict[int, redis.Redis] = {}


def _target() -> redis.Redis:
    """A client per process (a forked horse must not share its parent's sockets)."""
    pid = os.getpid()
    client = _clients.get(pid)
    if client is None:
        _clients.clear()
        client = redis.Redis.from_url(
            os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"),
            socket_timeout=3, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))
        _clients[pid] = client
    return client


def _call(fn: Callable[[redis.Redis], T], deadline_s: float = 30.0) -> T:
    """The target is the chaos's own Redis, which it kills and restarts: retry a write
    until it is back (each receipt carries a unique id, so a resend is told apart)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return fn(_target())
        except (redis.ConnectionError, redis.TimeoutError):  # LOADING is a ConnectionError
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _executing() -> mr.RunContext:
    """Record that a step body starts executing (before it does anything else)."""
    run = mr.current()
    job = rq.get_current_job()  # the delivery's RQ job: which queue (band) it came from
    entry = json.dumps({"x": uuid.uuid4().hex, "run": run.run_id, "step": run.step_path,
                        "epoch": run.ex.epoch, "attempt": run.attempt, "pid": os.getpid(),
                        "t": _now_ms(), "origin": getattr(job, "origin", "") or ""})
    _call(lambda c: c.rpush(EXEC_KEY, entry))
    return run


def _effect(run: mr.RunContext) -> None:
    """Claim the step's effect under its idempotency key, then apply it once."""
    key = run.idempotency_key
    outcome = "error"
    try:
        outcome = "won" if run.claim_effect(key) else "exists"
    except BaseException as exc:  # StopExecution (fenced, store unavailable) included
        outcome = f"refused:{getattr(exc, 'reason', type(exc).__name__)}"
        raise
    finally:
        entry = json.dumps({"x": uuid.uuid4().hex, "run": run.run_id, "step": run.step_path,
                            "key": key, "epoch": run.ex.epoch, "outcome": outcome})
        # A lost log line only weakens the check; it must not change the outcome.
        with contextlib.suppress(redis.RedisError):
            _call(lambda c: c.rpush(CLAIMS_KEY, entry), deadline_s=5.0)
    _call(lambda c: c.eval(_APPLY_ONCE, 2, APPLIED_KEY, EFFECTS_KEY, key))


def _nap(ms: int) -> None:
    if ms > 0:
        time.sleep(ms / 1000)


# -- steps ------------------------------------------------------------------------------------

@mr.step
def cx_link(index: int, sleep_ms: int) -> str:
    """A step with an effect: executes, naps, claims and applies its effect, writes an
    output line naming the execution (its epoch) that wrote it, and naps again before it
    returns: a kill or a stop in that nap lands after the effect and before the commit (the
    step must run again with the same key; a stopped one's late commit must be refused)."""
    run = _executing()
    _nap(sleep_ms // 2)
    _effect(run)
    run.stream.write({"epoch": run.ex.epoch, "step": run.step_path})
    _nap(sleep_ms - sleep_ms // 2)
    return run.idempotency_key


@mr.step(retries=2, delay_s=0.05)
def cx_flaky(sleep_ms: int) -> str:
    """Fails its first try (counted in the target), succeeds when retried."""
    run = _executing()
    _nap(sleep_ms)
    tries = _call(lambda c: c.hincrby(FLAKY_KEY, run.idempotency_key, 1))
    if tries == 1:
        raise RuntimeError("flaky: the first try fails")
    return run.idempotency_key


@mr.step(retries=1, delay_s=0.05)
def cx_doomed() -> str:
    """Always fails: its run must end failed, once."""
    _executing()
    raise RuntimeError("doomed: this step always fails")


@mr.step
def cx_echo(answer: Any) -> str:
    """Records the answer its run got (the checker compares it with the recorded one)."""
    run = _executing()
    return run.idempotency_key


# -- workflows ---------------------------------------------------------------------------------

class ChainIn(msgspec.Struct):
    n: int = 3
    sleep_ms: int = 20
    flaky: bool = False
    doomed: bool = False


@mr.workflow
def cx_chain(ctx: mr.RunContext, inp: ChainIn) -> dict[str, Any]:
    steps = [cx_link(i, inp.sleep_ms) for i in range(inp.n)]
    if inp.flaky:
        steps.append(cx_flaky(inp.sleep_ms))
    if inp.doomed:
        cx_doomed()
    return {"steps": steps}


@mr.step
async def cx_alink(index: int, sleep_ms: int) -> str:
    """cx_link as an async step: its naps are awaits, so its worker's event loop runs the
    other steps of its run (and a `--concurrency` worker the other runs) meanwhile."""
    run = _executing()
    await asyncio.sleep(sleep_ms / 2000)
    _effect(run)
    run.stream.write({"epoch": run.ex.epoch, "step": run.step_path})
    await asyncio.sleep((sleep_ms - sleep_ms // 2) / 1000)
    return run.idempotency_key


@mr.workflow
async def cx_async_chain(ctx: mr.AsyncRunContext, inp: ChainIn) -> dict[str, Any]:
    """cx_chain as an async workflow: one step, then the others gathered (their ledger
    positions are those of their calls), then the sync flaky step awaited (it runs in a
    thread) and the doomed one."""
    first = await cx_alink(0, inp.sleep_ms)
    rest = await asyncio.gather(*(cx_alink(i, inp.sleep_ms) for i in range(1, inp.n)))
    steps = [first, *rest]
    if inp.flaky:
        steps.append(await cx_flaky(inp.sleep_ms))
    if inp.doomed:
        await cx_doomed()
    return {"steps": steps}


class AskIn(msgspec.Struct):
    kind: str = "question"  # question | approval
    sleep_ms: int = 10


@mr.workflow
def cx_ask(ctx: mr.RunContext, inp: AskIn) -> dict[str, Any]:
    before = cx_link(0, inp.sleep_ms)
    # Every run starts on this code: the new branch, on every replay after every kill (a
    # decision lost to a kill would be taken again after the question: the old branch).
    patched = mr.patched("cx-ask-patch")
    answer: Any
    if inp.kind == "approval":
        answer = ctx.ask.approval("Ship it?", key=QUESTION_KEY)
    else:
        answer = ctx.ask.question("Which colour?", choices=COLOURS, key=QUESTION_KEY)
    after = cx_echo(answer)
    return {"answer": answer, "steps": [before, after], "patched": patched}


class TimerIn(msgspec.Struct):
    sleep_s: float = 1.0
    sleep_ms: int = 10


@mr.workflow
def cx_timer(ctx: mr.RunContext, inp: TimerIn) -> dict[str, Any]:
    before = cx_link(0, inp.sleep_ms)
    mr.sleep(inp.sleep_s)
    after = cx_link(1, inp.sleep_ms)
    return {"steps": [before, after]}


class SignalsIn(msgspec.Struct):
    n: int
    sleep_ms: int = 10


@mr.workflow
def cx_signals(ctx: mr.RunContext, inp: SignalsIn) -> dict[str, Any]:
    before = cx_link(0, inp.sleep_ms)
    got: list[Any] = []
    timed_out = False
    for _ in range(inp.n):
        try:
            got.append(ctx.wait_for_signal(SIGNAL_NAME, timeout_s=SIGNAL_TIMEOUT_S))
        except mr.SignalTimeoutError:
            timed_out = True
            break
    after = cx_echo(got)
    return {"signals": got, "timed_out": timed_out, "steps": [before, after]}


class PublishWaitIn(msgspec.Struct):
    sleep_ms: int = 10


@mr.workflow
def cx_publish_wait(ctx: mr.RunContext, inp: PublishWaitIn) -> dict[str, Any]:
    ctx.publish(STATE_KEY, {"stage": "started"})
    before = cx_link(0, inp.sleep_ms)
    ctx.publish(STATE_KEY, {"stage": "stepped", "step": before})
    state: dict[str, Any]
    try:
        got = ctx.wait_for_event(ORDER_SOURCE, type=ORDER_TYPE, match={"order": ctx.run_id},
                                 timeout_s=ORDER_TIMEOUT_S)
        state = {"stage": "received", "event": got.id, "key": got.key,
                 "payload": got.payload}
    except EventWaitTimeoutError:
        state = {"stage": "timed_out"}
    ctx.publish(STATE_KEY, state)
    return {"state": state, "steps": [before]}


@mr.step(retries=3, delay_s=0.05)
def cx_saga_undo(index: int, sleep_ms: int, result: Any = None) -> str:
    """The undo of cx_saga_do #index (it receives that step's result): an effect under its
    own idempotency key; returns which registration it undid."""
    run = _executing()
    _nap(sleep_ms // 2)
    _effect(run)
    _nap(sleep_ms - sleep_ms // 2)
    return f"do{index}"


def cx_saga_release(index: int, sleep_ms: int) -> str:
    """A plain function registered with ctx.compensate: the same, for the registration
    made after step #index."""
    run = _executing()
    _nap(sleep_ms // 2)
    _effect(run)
    return f"rel{index}"


@mr.step(compensate=cx_saga_undo)
def cx_saga_do(index: int, sleep_ms: int) -> str:
    run = _executing()
    _nap(sleep_ms // 2)
    _effect(run)
    _nap(sleep_ms - sleep_ms // 2)
    return run.idempotency_key


class SagaIn(msgspec.Struct):
    n: int = 3
    sleep_ms: int = 20
    wait: bool = False  # wait for a signal nobody sends (the harness cancels it)


@mr.workflow
def cx_saga(ctx: mr.RunContext, inp: SagaIn) -> dict[str, Any]:
    steps = [cx_saga_do(0, inp.sleep_ms)]
    ctx.compensate(cx_saga_release, 0, inp.sleep_ms)
    steps += [cx_saga_do(i, inp.sleep_ms) for i in range(1, inp.n)]
    if inp.wait:
        with contextlib.suppress(mr.SignalTimeoutError):
            ctx.wait_for_signal(SAGA_SIGNAL, timeout_s=SAGA_WAIT_S)
    cx_doomed()
    return {"steps": steps}


def _retry_try(fails: int, sleep_ms: int) -> dict[str, Any]:
    run = _executing()
    _nap(sleep_ms)
    # Counted per execution: a try killed before it committed counts as one that failed.
    tries = _call(lambda c: c.hincrby(RETRY_KEY, run.idempotency_key, 1))
    if tries <= fails:
        raise RuntimeError(f"retry: try {tries} fails ({fails} planned)")
    _effect(run)
    return {"key": run.idempotency_key, "fails": fails, "tries": tries}


_RETRY = mr.Retry(initial=RETRY_INITIAL, max_attempts=RETRY_MAX_ATTEMPTS, jitter=False)


@mr.step(retry=_RETRY)
def cx_retry_try(fails: int, sleep_ms: int) -> dict[str, Any]:
    """Fails while its tries so far number `fails` or fewer, then applies its effect."""
    return _retry_try(fails, sleep_ms)


@mr.step(retry=_RETRY, on_exhausted="pause")
def cx_retry_try_p(fails: int, sleep_ms: int) -> dict[str, Any]:
    """The same, pausing its run when its tries run out."""
    return _retry_try(fails, sleep_ms)


class RetryIn(msgspec.Struct):
    fails: int = 1
    pause: bool = False
    sleep_ms: int = 10


@mr.workflow
def cx_retry(ctx: mr.RunContext, inp: RetryIn) -> dict[str, Any]:
    step = cx_retry_try_p if inp.pause else cx_retry_try
    done = step(inp.fails, inp.sleep_ms)
    return {"try": done, "steps": [done["key"]]}


class RateIn(msgspec.Struct):
    lane: str
    sleep_ms: int = 5


@mr.workflow(rate_limit=f"{RATE_PER_S}/s", rate_key="lane")
def cx_rate(ctx: mr.RunContext, inp: RateIn) -> dict[str, Any]:
    return {"steps": [cx_link(0, inp.sleep_ms)]}


# -- sessions, artifacts and the mutex (issue 23) -------------------------------------------

def _said(run_id: str, index: int, where: str) -> dict[str, Any]:
    """A message a cx_session run appends: which run, its number in the run, where from."""
    return {"run": run_id, "i": index, "at": where}


@mr.step
def cx_say(index: int, shared: bool, sleep_ms: int) -> str:
    """Appends message #index to its run's session (and to the shared one), naps: a kill in
    the nap lands after the appends and before the commit (the step runs again with the
    same appends, which must be kept once)."""
    run = _executing()
    _nap(sleep_ms // 2)
    message = _said(run.run_id, index, "step")
    mr.session().append(message)
    if shared:
        mr.session(SESSION_SHARED).append(message)
    _nap(sleep_ms - sleep_ms // 2)
    return run.idempotency_key


class SessionIn(msgspec.Struct):
    steps: int = 2
    shared: bool = False
    sleep_ms: int = 10


@mr.workflow
def cx_session(ctx: mr.RunContext, inp: SessionIn) -> dict[str, Any]:
    """Messages 0, 2, 4 ... from the body, 1, 3 ... from steps, in that order; the shared
    session gets the steps' messages and a last one from the body."""
    own = mr.session()
    own.append(_said(ctx.run_id, 0, "body"))
    steps = []
    for k in range(inp.steps):
        steps.append(cx_say(2 * k + 1, inp.shared, inp.sleep_ms))
        own.append(_said(ctx.run_id, 2 * k + 2, "body"))
    if inp.shared:
        mr.session(SESSION_SHARED).append(_said(ctx.run_id, 2 * inp.steps + 1, "body"))
    return {"session": own.id, "said": 2 * inp.steps + 1, "steps": steps}


# Declared in the source (known to the deployment from the workers' start: a CAS reads the
# latest version, 0 before the first put).
_ART_PLAIN = mr.artifact(ARTIFACT_PLAIN, "application/json")
_ART_CAS = mr.artifact(ARTIFACT_CAS, "application/json")


@mr.step
def cx_put(cas: bool, sleep_ms: int) -> dict[str, Any]:
    """Puts one version naming its run and step, then naps (a kill there redelivers the
    run after the put, before the commit: the put must not be made twice)."""
    run = _executing()
    _nap(sleep_ms // 2)
    content = json.dumps({"run": run.run_id, "step": run.step_path},
                         sort_keys=True).encode()
    conflicts = 0
    if cas:
        while True:
            read = _ART_CAS.latest()
            _nap(CAS_THINK_MS)  # read, think, write: runs put at once conflict
            try:
                version = _ART_CAS.put(content, expect_version=read)
                break
            except mr.ArtifactConflict:
                conflicts += 1
    else:
        version = _ART_PLAIN.put(content)
    entry = json.dumps({"x": uuid.uuid4().hex, "run": run.run_id, "step": run.step_path,
                        "epoch": run.ex.epoch, "version": version, "conflicts": conflicts,
                        "cas": cas, "pid": os.getpid(), "t": _now_ms()})
    _call(lambda c: c.rpush(PUTS_KEY, entry))
    # A window for the harness's put_kill: killed now, the step runs again and puts again.
    _nap(sleep_ms - sleep_ms // 2 + (PUT_LINGER_MS if cas else 0))
    return {"version": version, "conflicts": conflicts, "key": run.idempotency_key}


class ArtifactIn(msgspec.Struct):
    cas: bool = False
    sleep_ms: int = 20


@mr.workflow
def cx_artifact(ctx: mr.RunContext, inp: ArtifactIn) -> dict[str, Any]:
    put = cx_put(inp.cas, inp.sleep_ms)
    return {"artifact": ARTIFACT_CAS if inp.cas else ARTIFACT_PLAIN,
            "version": put["version"], "steps": [put["key"]]}


# Entering the critical section: the server's time, whether the lock's holder in the store is
# this execution (run and epoch), whether this run's increment was accepted already (a body
# replayed past the section), and the counter (read now, written plus one on leaving).
_LOCK_ENTER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h = redis.call('HMGET', KEYS[1], 'run', 'epoch', 'until')
local valid = (h[1] == ARGV[1] and tonumber(h[2]) == tonumber(ARGV[2])) and 1 or 0
local done = redis.call('SISMEMBER', KEYS[3], ARGV[1])
local read = tonumber(redis.call('GET', KEYS[2]) or '0')
redis.call('RPUSH', KEYS[4], cjson.encode({x = ARGV[3], op = 'enter', run = ARGV[1],
  epoch = tonumber(ARGV[2]), attempt = tonumber(ARGV[4]), pid = tonumber(ARGV[5]),
  ms = now, valid = valid,
  done = done, read = read, holder = h[1] or '', holder_epoch = tonumber(h[2] or '0'),
  ['until'] = tonumber(h[3] or '0')}))
return read
"""
# Leaving it: the write of read + 1, accepted only from the lock's holder (this execution:
# refused otherwise) and once per run (a redelivery inside the section after the write
# leaves it as it is: already).
_LOCK_EXIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h = redis.call('HMGET', KEYS[1], 'run', 'epoch', 'until')
local valid = h[1] == ARGV[1] and tonumber(h[2]) == tonumber(ARGV[2])
local outcome = 'refused'
if valid and redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then
  outcome = 'already'
elseif valid then
  redis.call('SET', KEYS[2], tonumber(ARGV[6]) + 1)
  redis.call('SADD', KEYS[3], ARGV[1])
  outcome = 'written'
end
redis.call('RPUSH', KEYS[4], cjson.encode({x = ARGV[3], op = 'exit', run = ARGV[1],
  epoch = tonumber(ARGV[2]), attempt = tonumber(ARGV[4]), pid = tonumber(ARGV[5]),
  ms = now, outcome = outcome,
  holder = h[1] or '', holder_epoch = tonumber(h[2] or '0'),
  ['until'] = tonumber(h[3] or '0')}))
return outcome
"""


def _lock_script(ctx: mr.RunContext, script: str, x: str, *extra: Any) -> Any:
    from marbles_rq.flow.lock_store import lock_id  # the mutex's own naming of its keys

    state = ctx.runs.keys.lock_state(lock_id(LOCK_NAME))
    return _call(lambda c: c.eval(script, 4, state, LOCK_COUNTER_KEY, LOCK_DONE_KEY,
                                  LOCK_HOLDS_KEY, ctx.run_id, ctx.ex.epoch, x,
                                  ctx.ex.attempt, os.getpid(), *extra))


class LockIn(msgspec.Struct):
    hold_ms: int = 50
    step: bool = False
    sleep_ms: int = 10


@mr.workflow
def cx_lock(ctx: mr.RunContext, inp: LockIn) -> dict[str, Any]:
    """A read-then-write of a counter inside the lock, from the body (every execution of
    the body that passes the section does both, fenced), with an optional step inside."""
    steps = []
    with mr.lock(LOCK_NAME, lease_s=LOCK_LEASE_S):
        x = uuid.uuid4().hex
        read = int(_lock_script(ctx, _LOCK_ENTER, x))
        _nap(inp.hold_ms)
        if inp.step:
            steps.append(cx_link(0, inp.sleep_ms))
        _lock_script(ctx, _LOCK_EXIT, x, read)
    steps.append(cx_link(1, inp.sleep_ms))
    return {"steps": steps}


class ChildIn(msgspec.Struct):
    i: int
    sleep_ms: int = 10


@mr.workflow
def cx_child(ctx: mr.RunContext, inp: ChildIn) -> dict[str, Any]:
    return {"i": inp.i, "steps": [cx_link(0, inp.sleep_ms)]}


class ParentIn(msgspec.Struct):
    children: int = 2
    sleep_ms: int = 10


@mr.workflow
def cx_parent(ctx: mr.RunContext, inp: ParentIn) -> dict[str, Any]:
    handles = [mr.start_child("cx_child", {"i": i, "sleep_ms": inp.sleep_ms}, key=f"k{i}")
               for i in range(inp.children)]
    results = mr.gather(*handles)
    after = cx_link(0, inp.sleep_ms)
    return {"children": results, "steps": [after]}


class FanIn(msgspec.Struct):
    width: int = 3
    sleep_ms: int = 20


@mr.workflow
def cx_fan(ctx: mr.RunContext, inp: FanIn) -> dict[str, Any]:
    leaves = mr.parallel(*[functools.partial(cx_link, i, inp.sleep_ms)
                           for i in range(inp.width)])
    after = cx_link(inp.width, inp.sleep_ms)
    return {"steps": [*leaves, after]}


@mr.schedule(every="1s", overlap="allow", key=TICK_KEY)
@mr.workflow
def cx_tick(ctx: mr.RunContext) -> dict[str, Any]:
    return {"steps": [cx_link(0, 5)]}


@mr.schedule(every="2s", key=TOCK_KEY)
@mr.workflow
def cx_tock(ctx: mr.RunContext) -> dict[str, Any]:
    return {"steps": [cx_link(0, 30)]}


@mr.on_event(EVENT_SOURCE)
@mr.workflow
def cx_event(ctx: mr.RunContext, event: mr.Event) -> dict[str, Any]:
    return {"event": event.id, "steps": [cx_link(0, 10)]}


# -- the combinations (issue 16) -----------------------------------------------------------------

@mr.workflow(retention_s=1)
def cx_brief(ctx: mr.RunContext, inp: ChildIn) -> dict[str, Any]:
    """A child kept one second after it finishes (its parent gathers it later)."""
    return {"i": inp.i, "steps": [cx_link(0, inp.sleep_ms)]}


class LateParentIn(msgspec.Struct):
    children: int = 2
    wait_s: float = 7.0
    sleep_ms: int = 10


@mr.workflow
def cx_late_parent(ctx: mr.RunContext, inp: LateParentIn) -> dict[str, Any]:
    """Starts short-lived children, sleeps past their retention (and a prune pass: every
    5 s), then gathers them: their outcomes must still be there."""
    handles = [mr.start_child("cx_brief", {"i": i, "sleep_ms": inp.sleep_ms}, key=f"b{i}")
               for i in range(inp.children)]
    mr.sleep(inp.wait_s)
    results = mr.gather(*handles)
    after = cx_link(0, inp.sleep_ms)
    return {"children": results, "steps": [after]}


class SpawnerIn(msgspec.Struct):
    children: int = 4
    sleep_ms: int = 150


@mr.workflow
def cx_spawner(ctx: mr.RunContext, inp: SpawnerIn) -> dict[str, Any]:
    """Starts a child after each step: a cancel of this parent lands while children start."""
    handles = []
    steps = []
    for i in range(inp.children):
        steps.append(cx_link(i, inp.sleep_ms))
        handles.append(mr.start_child("cx_child", {"i": i, "sleep_ms": inp.sleep_ms},
                                      key=f"s{i}"))
    results = mr.gather(*handles)
    return {"children": results, "steps": steps}


class LimitedIn(msgspec.Struct):
    n: int = 2
    sleep_ms: int = 150


@mr.workflow(concurrency=LIMIT_GLOBAL)
def cx_limited(ctx: mr.RunContext, inp: LimitedIn) -> dict[str, Any]:
    return {"steps": [cx_link(i, inp.sleep_ms) for i in range(inp.n)]}


class LimitedKeyIn(msgspec.Struct):
    customer: str
    n: int = 2
    sleep_ms: int = 150


@mr.workflow(concurrency=LIMIT_PER_KEY, concurrency_key="customer")
def cx_limited_key(ctx: mr.RunContext, inp: LimitedKeyIn) -> dict[str, Any]:
    return {"steps": [cx_link(i, inp.sleep_ms) for i in range(inp.n)]}


@mr.step
def cx_zz(index: int) -> str:
    """A quick step with no effect: its results land within a millisecond of each other."""
    return _executing().idempotency_key


@mr.step
def cx_aa(index: int) -> str:
    """As cx_zz; its name sorts first, so a ledger ordered by (time, name) misorders ties."""
    return _executing().idempotency_key


class RerunSourceIn(msgspec.Struct):
    n: int = 6


@mr.workflow
def cx_rr(ctx: mr.RunContext, inp: RerunSourceIn) -> dict[str, Any]:
    """Alternating quick steps (the harness reruns it from one of them), then a step with an
    effect."""
    steps = [(cx_zz if i % 2 == 0 else cx_aa)(i) for i in range(inp.n)]
    steps.append(cx_link(inp.n, 5))
    return {"steps": steps}
