"""Runs that no live worker can execute: not finished, of a workflow version that no live
worker serves (a rolling deploy that stopped the old workers too early, or a version dropped
from the source while its runs wait). They are not lost, only handed back until a worker
that serves their version starts; `marbles-rq doctor` warns about them.

Not finished runs have no index of their own (a queued run's delivery may sit in RQ), so
this reads the runs listings, newest first and up to a budget: the status of each (a small
field), then the record of each not finished one.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ..store.records import RunRecord
from ..store.replies import as_text
from .runs import TERMINAL, RunStore

SCAN_BUDGET = 200_000  # run ids read, over every bucket
CHUNK = 1000


@dataclass(frozen=True)
class OpenRuns:
    """Not finished runs per (workflow, version): how many and one run id (for the message).
    `complete` is False when the budget stopped the scan before the oldest runs."""

    runs: dict[tuple[str, str], tuple[int, str]]
    scanned: int
    complete: bool


def open_runs(runs: RunStore, *, budget: int = SCAN_BUDGET) -> OpenRuns:
    keys, client = runs.keys, runs.client
    per = max(1, budget // keys.buckets)
    pipe = client.pipeline(transaction=False)
    for b in range(keys.buckets):
        pipe.zrevrange(keys.listing("run", b), 0, per - 1)
    parts = pipe.execute()
    ids = [as_text(rid) for part in parts for rid in part]
    complete = all(len(part) < per for part in parts)
    found: dict[tuple[str, str], tuple[int, str]] = {}
    for i in range(0, len(ids), CHUNK):
        chunk = ids[i:i + CHUNK]
        pipe = client.pipeline(transaction=False)
        for rid in chunk:
            pipe.hget(keys.run(rid), "status")
        open_ids = [rid for rid, st in zip(chunk, pipe.execute(raise_on_error=False),
                                           strict=True)
                    if isinstance(st, bytes | str) and as_text(st) not in TERMINAL]
        if not open_ids:
            continue
        pipe = client.pipeline(transaction=False)
        for rid in open_ids:
            pipe.hget(keys.run(rid), "doc")
        for rid, doc in zip(open_ids, pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(doc, bytes | str):
                continue  # pruned between the reads
            try:
                record = msgspec.json.decode(doc, type=RunRecord)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # a corrupt record is for other checks
            key = (record.name, record.wf_version)
            count, example = found.get(key, (0, rid))
            found[key] = (count + 1, example)
    return OpenRuns(found, len(ids), complete)
