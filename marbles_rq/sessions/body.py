"""`mr.session(id=None)` in a run body.

* Without an id: the run's own session, whose id is the run's id (a child run's own session
  is a child of its parent run's). With an id: that session, created if it does not exist,
  as a child of the run's own session (its `parent`), or the existing one, unchanged.
* The open is a recorded call: its ledger entry (``<frame>.|session#<n>``, outside the
  frame's positions, like a rate limit's admission, so adding sessions to running code moves
  no recorded call) and the session id in the run's set of sessions (``runses:<run id>``,
  what the controller's pruning releases) are written by one script (lua/note_session.lua)
  before the session is opened (lua/open_session.lua, on the session's slot), so a session
  never has an owner its run does not know about. A replay finds the entry and opens the
  recorded session again (idempotent: a kill between the two writes is made good).
* Appends made through the handle carry an automatic idempotency key: the run id, the
  frame's path (a step's key, or the body's) and a counter of the frame's appends. A body
  re-executed after a kill -9, or a step re-executed because it had not committed, makes
  the same appends at the same places: each returns the first append's position and adds
  nothing. A retried step's appends are the same places too: a message appended by a failed
  attempt is not appended again by the next (the transcript keeps one of each).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from ..engine.context import check_branch, check_not_in_foreign_thread, current, now_ms
from ..engine.execution import stamp
from ..errors import MarblesError
from ..store.ids import check_id
from ..store.records import StepRecord, encode
from .handle import Session
from .store import SessionStore

if TYPE_CHECKING:
    from ..engine.context import Run

SESSION_MARKER = "|session"
APPEND_MARKER = "|append"


def session(session_id: str | None = None) -> Session:
    """The run's own session (no id), or the session `session_id`, a child of the run's;
    created if it does not exist. See the module's docstring."""
    run = current("mr.session")
    check_not_in_foreign_thread("mr.session")
    check_branch()
    if session_id is not None:
        check_id(session_id, "session id")
    if getattr(run.runs, "scripts", None) is None:
        raise MarblesError("mr.session needs the Redis store: sessions are not available in "
                           "a dry run or on the in-memory test kit")
    own = run.run_id
    sid = session_id or own
    parent = (run.ex.record.parent or "") if sid == own else own
    frame = run.frame
    ledger_key = f"{frame.path}.{SESSION_MARKER}#{frame.counters[SESSION_MARKER]}"
    frame.counters[SESSION_MARKER] += 1
    recorded = run.ex.ledger.get(ledger_key)
    if recorded is not None and recorded.result is not None:
        found = msgspec.json.decode(bytes(recorded.result))
        if isinstance(found, dict) and isinstance(found.get("session"), str):
            sid, parent = found["session"], found.get("parent") or ""
    else:
        record = StepRecord(version=1, key=ledger_key, name=SESSION_MARKER, status="succeeded",
                            attempts=0, result=msgspec.Raw(msgspec.json.encode(
                                {"session": sid, "parent": parent})), at_ms=now_ms())
        status = run.call_store(_note, run, record, sid)
        if status in ("ok", "cancelled", "paused"):
            run.ex.ledger[ledger_key] = record
        run.check_reply(status)
    store = SessionStore(run.runs)
    opened, _, created = run.call_store(
        lambda: store.open(sid, parent=parent, owner=own, origin=f"run:{own}"))
    return Session(store, sid, parent=opened.parent, created=created, owner=own,
                   auto_key=lambda: _append_key(run))


def _note(run: Run, record: StepRecord, session_id: str) -> str:
    runs, ex = run.runs, run.ex
    runs.flush_starts(ex)  # the steps started before it come first
    with ex.lock:
        ex.seq += 1
        return str(runs.scripts.note_session(
            keys=ex.keys, sessions=runs.keys.run_sessions(ex.run_id), epoch=ex.epoch,
            run_id=ex.run_id, seq=ex.seq, step_key=record.key,
            record=encode(stamp(record, ex)), session_id=session_id).status)


def _append_key(run: Run) -> str:
    """The automatic idempotency key of the next append made here (see the docstring)."""
    check_branch()
    frame = run.frame
    n = frame.counters[APPEND_MARKER]
    frame.counters[APPEND_MARKER] += 1
    return f"{run.run_id}|{frame.path}.{APPEND_MARKER}#{n}"


__all__ = ["Session", "session"]
