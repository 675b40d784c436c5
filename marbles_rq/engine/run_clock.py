"""`mr.now()`: the time as a run reads it, recorded like any call.

The first execution that reaches the call reads the run's clock (the Redis server's, as its
timers use it, or the test kit's virtual one) and records the instant at the call's ledger
position (held for the execution's next write, like a step's success); every replay returns
the recorded instant. So a body may branch on the time: a replay takes the same branch.
"""

from __future__ import annotations

import datetime as dt

import msgspec

from ..store.records import StepRecord
from .context import Run, check_branch, check_not_in_foreign_thread, now_ms


def read_clock(run: Run) -> dt.datetime:
    check_not_in_foreign_thread("mr.now")
    check_branch()
    key, seq = run.position("|now")
    recorded = run.ex.ledger.get(key)
    if recorded is not None:
        ms = int(msgspec.json.decode(bytes(recorded.result)))
    else:
        ms = run.ex.server_now_ms()
        run.hold_entry(StepRecord(version=1, key=key, name="|now", status="succeeded",
                                  attempts=0, result=msgspec.Raw(str(ms).encode()),
                                  at_ms=now_ms(), seq=seq),
                       "clock_read", {"step": key, "at_ms": ms})
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC)
