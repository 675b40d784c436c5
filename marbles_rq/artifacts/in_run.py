"""A put made by a run's body or step: recorded, so it is made once.

Its ledger entry is ``<frame>.|art:<name>#<n>`` (the n-th put of that name in the frame,
outside the frame's positions, like a rate limit's admission: adding a put to a workflow
under running runs moves no recorded call). The put's idempotency token is
``<run id>|<ledger key>`` and lua/put_artifact.lua keeps it in the artifact's hash with the
version it wrote. So:

* a replay finds the ledger entry and returns its version without a Redis call;
* a step killed after the put and redelivered (its ledger entry, held for the execution's
  next write, may be lost with the process) puts again under the same token, and the
  script answers with the version it wrote the first time: nothing is written twice.

The put is also a report of kind ``artifact`` on the run (engine/waiting.py's reports):
the run's status and the feed list the versions it wrote.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from ..engine.context import Run, check_branch, check_not_in_foreign_thread, now_ms
from ..engine.waiting import _local
from ..store.records import ReportRecord, StepRecord
from .errors import ArtifactConflict
from .memory import artifacts_for
from .store import Data, Put

MARKER = "|art:"


def put(run: Run, name: str, data: Data, *, expect_version: int | None, media_type: str | None,
        meta: Any, declared_type: str | None, keep: int) -> int:
    check_not_in_foreign_thread("artifact.put")
    check_branch()
    frame = run.frame
    marker = MARKER + name
    key = f"{frame.path}.{marker}#{frame.counters[marker]}"
    frame.counters[marker] += 1
    recorded = run.ex.ledger.get(key)
    if recorded is not None:
        return int(msgspec.json.decode(recorded.result)["version"])
    store = artifacts_for(run.runs)  # a run in memory (dry run, test kit): kept in memory
    try:
        done: Put = run.call_store(functools.partial(
            store.put, name, data, expect_version=expect_version, media_type=media_type,
            meta=meta, declared_type=declared_type, token=f"{run.run_id}|{key}",
            run=run.run_id, step=frame.path, keep=keep))
    except ArtifactConflict:
        # A conflict wrote nothing: the retry that follows takes this place (and token) again.
        # Counted, a step killed after its retry's put would, run again, put under the first
        # token without meeting the conflict: a second version (the chaos test's cx_artifact).
        frame.counters[marker] -= 1
        raise
    version = done.version
    entry = {"name": name, "version": version, "size": done.record.size,
             "media_type": done.record.media_type}
    report = ReportRecord(version=1, key=_local(run, f"artifact:{name}#{version}"),
                          report="artifact", entry=msgspec.Raw(msgspec.json.encode(entry)),
                          step=frame.path, at_ms=now_ms())
    reply = run.call_store(run.runs.waits().add_report, run.ex, report)
    run.check_reply("ok" if reply == "exists" else reply)
    record = StepRecord(version=1, key=key, name="|artifact", status="succeeded", attempts=0,
                        result=msgspec.Raw(msgspec.json.encode({"artifact": name,
                                                                "version": version})),
                        at_ms=now_ms())
    run.hold_entry(record, "artifact_put", {"step": key, "artifact": name,
                                            "version": version})
    return version

