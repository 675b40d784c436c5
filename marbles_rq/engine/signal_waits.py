"""What a run body uses to receive signals: wait for the next one, or drain those buffered.

    approval = ctx.wait_for_signal("approved")              # parks until one arrives
    try:
        more = ctx.wait_for_signal("more", timeout_s=3600)
    except SignalTimeoutError:
        ...
    for item in ctx.signals("items"):                       # what is buffered now; never parks
        ...

Each call has a position in the body, as a step has. What it received is recorded in the
ledger there, in the script that takes the signals out of the run's buffer
(engine/signals.py), so a replay (a redelivery after kill -9, a wake) returns the same
payloads from the ledger and never takes a signal again. A wait that finds nothing parks
the run (engine/waiting.py: no worker is held); the signal's sender wakes it.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from ..store.records import StepRecord
from .authoring import InputError
from .context import Run, check_branch, check_not_in_foreign_thread, now_ms
from .runs import RunStore
from .signals import Buffered, SignalTimeoutError, check_name, read_buffered, take
from .waiting import NonDeterminismError, ParkRun, Wait

MAX_TIMEOUT_S = 366 * 86400


def _recorded_name(record: StepRecord) -> str:
    return str(msgspec.json.decode(record.result).get("name", ""))


def _check_same(run: Run, record: StepRecord, name: str, call: str) -> None:
    recorded = _recorded_name(record)
    if recorded != name:
        # The same call, for another name: the code changed under a waiting run.
        raise NonDeterminismError(run.frame.path, record.seq, f"{call}({recorded!r})",
                                  f"{call}({name!r})")


def _read(run: Run, name: str, limit: int | None) -> Buffered:
    """The run's untaken signals of `name` (runs in memory, engine/memory_store.py, keep
    their signals themselves)."""
    if isinstance(run.runs, RunStore):
        found: Buffered = run.call_store(read_buffered, run.runs, run.run_id, name, limit)
        return found
    memory: Any = run.runs
    found = run.call_store(memory.read_buffered, run.run_id, name, limit)
    return found


def _take(run: Run, name: str, taken: int, count: int, record: StepRecord,
          event: dict[str, Any]) -> str:
    if isinstance(run.runs, RunStore):
        status: str = run.call_store(take, run.runs, run.ex, name, taken, count, record, event)
        return status
    memory: Any = run.runs
    status = run.call_store(memory.take_signal, run.ex, name, taken, count, record, event)
    return status


def wait_for_signal(run: Run, name: str, timeout_s: float | None = None) -> Any:
    """The payload of the next signal `name` the run has not taken, parking the run until
    one arrives; SignalTimeoutError when none was sent within `timeout_s` seconds of the
    first time this call asked (a durable timer on the server clock)."""
    check_not_in_foreign_thread("wait_for_signal")
    check_branch()
    check_name(name)
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(
            timeout_s, int | float) or not 0 < timeout_s <= MAX_TIMEOUT_S):
        raise InputError("timeout_s must be between 0 and a year")
    key, seq = run.position("|signal")
    recorded = run.ex.ledger.get(key)
    due = 0
    if recorded is not None:
        _check_same(run, recorded, name, "wait_for_signal")
        data = msgspec.json.decode(recorded.result)
        if recorded.status == "received":
            return data["payload"]
        if recorded.status == "timed_out":
            raise SignalTimeoutError(f"no signal {name!r} within {data.get('timeout_s')} s")
        due = int(data["due_ms"])  # waiting: its timeout's due time, written when it parked
    while True:
        found = _read(run, name, 1)
        # A signal sent after the timeout was due stays for a later wait: the timeout won.
        if found.payloads and (not due or found.at_ms[0] <= due):
            payload = msgspec.Raw(found.payloads[0])
            record = StepRecord(
                version=1, key=key, name="|signal", status="received", attempts=0,
                result=msgspec.Raw(msgspec.json.encode(
                    {"name": name, "seq": found.taken + 1, "payload": payload})),
                at_ms=now_ms(), seq=seq)
            status = _take(run, name, found.taken, 1, record,
                           {"name": name, "seqs": [found.taken + 1], "call": key})
            if status == "conflict":
                continue  # another branch took it first: look again
            run.check_reply(status)
            run.ex.ledger[key] = record
            return msgspec.json.decode(payload)
        if due and due <= run.ex.server_ms:
            timeout = (msgspec.json.decode(recorded.result).get("timeout_s")
                       if recorded is not None else None)
            record = StepRecord(
                version=1, key=key, name="|signal", status="timed_out", attempts=0,
                result=msgspec.Raw(msgspec.json.encode(
                    {"name": name, "due_ms": due, "timeout_s": timeout})),
                at_ms=now_ms(), seq=seq)
            status = _take(run, name, found.taken, 0, record,
                           {"name": name, "seqs": [], "call": key, "timed_out": True})
            if status == "conflict":
                continue
            run.check_reply(status)
            run.ex.ledger[key] = record
            raise SignalTimeoutError(f"no signal {name!r} within {timeout} s")
        break
    new: list[StepRecord] = []
    if timeout_s is not None and recorded is None:
        # Rounded up: a timeout never ends the wait early.
        due = run.ex.server_now_ms() + math.ceil(timeout_s * 1000)
        new = [StepRecord(version=1, key=key, name="|signal", status="waiting", attempts=0,
                          result=msgspec.Raw(msgspec.json.encode(
                              {"name": name, "due_ms": due, "timeout_s": timeout_s})),
                          at_ms=now_ms(), seq=seq)]
    raise ParkRun([Wait("signal", wake_at_ms=due, signals=[name], ledger=new)])


def drain_signals(run: Run, name: str) -> list[Any]:
    """The payloads of every signal `name` buffered now that the run has not taken, in the
    order they were sent (perhaps none); never parks. A replay returns the same list."""
    check_not_in_foreign_thread("signals")
    check_branch()
    check_name(name)
    key, seq = run.position("|signals")
    recorded = run.ex.ledger.get(key)
    if recorded is not None:
        _check_same(run, recorded, name, "signals")
        return list(msgspec.json.decode(recorded.result)["payloads"])
    while True:
        found = _read(run, name, None)
        count = len(found.payloads)
        record = StepRecord(
            version=1, key=key, name="|signals", status="received", attempts=0,
            result=msgspec.Raw(msgspec.json.encode(
                {"name": name, "first_seq": found.taken + 1,
                 "payloads": [msgspec.Raw(p) for p in found.payloads]})),
            at_ms=now_ms(), seq=seq)
        status = _take(run, name, found.taken, count, record,
                       {"name": name, "call": key,
                        "seqs": list(range(found.taken + 1, found.taken + 1 + count))})
        if status == "conflict":
            continue
        run.check_reply(status)
        run.ex.ledger[key] = record
        return list(msgspec.json.decode(record.result)["payloads"])
