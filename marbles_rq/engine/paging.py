"""Runs, newest first, a page at a time, at a cost that does not grow with the number of runs.

Runs are listed per bucket (``{P:bNNNN}:idx:run``, scored by creation time), so the newest
runs overall are a k-way merge of the buckets' newest. A page is read from a cursor, the
(created ms, run id) of the last run the previous page looked at: each bucket is asked for
at most a batch of ids at or before it (ZREVRANGEBYSCORE ... LIMIT), so a page costs one
pipelined round trip over the buckets plus one for the runs' fields, whether the deployment
holds a thousand runs or a million.

Filters (status, workflow, queue) have no index of their own: a filtered page reads
candidates in that order until the page is full or `scan_budget` candidates were looked at,
and then says how far back it got, so one page never reads the whole keyspace. A time
window (created between two instants) is a score range, so it costs nothing extra.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import msgspec

from ..store.records import RunRecord
from .runs import RunStore

DEFAULT_SCAN_BUDGET = 5_000


@dataclass(frozen=True)
class Cursor:
    """Where a page stopped: the next page lists runs strictly older, in (ms, id) order."""

    created_ms: int
    run_id: str

    def encode(self) -> str:
        return f"{self.created_ms}:{self.run_id}"

    @staticmethod
    def decode(text: str | None) -> Cursor | None:
        if not text:
            return None
        ms, sep, rid = text.partition(":")
        if not sep or not ms.isdigit() or not rid:
            raise ValueError(f"invalid cursor {text!r}")
        return Cursor(int(ms), rid)


@dataclass(frozen=True)
class RunRow:
    """What a row of the runs list shows (read with one HMGET per run, no ledger)."""

    id: str
    name: str
    queue: str
    status: str
    attempt: int
    created_ms: int
    started_ms: int | None
    finished_ms: int | None
    parent: str


@dataclass(frozen=True)
class Page:
    rows: list[RunRow]
    next: Cursor | None      # None: nothing older (within the window)
    scanned: int             # candidates looked at for this page
    exhausted_budget: bool   # a filtered page stopped at its scan budget, not at a full page


@dataclass(frozen=True)
class Filters:
    status: str | None = None
    workflow: str | None = None
    queue: str | None = None
    since_ms: int | None = None   # created at or after
    until_ms: int | None = None   # created at or before

    @property
    def narrowing(self) -> bool:
        return bool(self.status or self.workflow or self.queue)


_FIELDS = ("doc", "status", "attempt", "queue", "created_ms", "started_ms", "finished_ms")


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _num(value: Any) -> int | None:
    try:
        return None if value in (None, b"") else int(value)
    except (TypeError, ValueError):
        return None


class RunPager:
    def __init__(self, runs: RunStore) -> None:
        self.runs = runs
        self.keys = runs.keys
        self.client = runs.client

    def _candidates(self, after: Cursor | None, filters: Filters, batch: int
                    ) -> list[tuple[int, str]]:
        """Up to `batch` (ms, id) pairs strictly older than `after`, newest first, merged
        over the buckets. Each bucket gives at most `batch` (plus the ties at the cursor's
        millisecond, which the cursor's id orders)."""
        high: int | str = "+inf" if filters.until_ms is None else filters.until_ms
        if after is not None:
            high = after.created_ms if high == "+inf" else min(int(high), after.created_ms)
        low: int | str = "-inf" if filters.since_ms is None else filters.since_ms
        buckets = range(self.keys.buckets)
        fetch = {b: batch for b in buckets}
        found: dict[int, list[tuple[int, str]]] = {b: [] for b in buckets}
        offset = {b: 0 for b in buckets}
        while fetch:
            pipe = self.client.pipeline(transaction=False)
            order = list(fetch)
            for b in order:
                pipe.zrevrangebyscore(self.keys.listing("run", b), high, low, start=offset[b],
                                      num=fetch[b], withscores=True)
            again: dict[int, int] = {}
            for b, part in zip(order, pipe.execute(), strict=True):
                kept = 0
                last_ms: int | None = None
                for member, score in part:
                    ms, rid = int(score), _s(member)
                    last_ms = ms
                    # Same millisecond as the cursor: only ids below it (the order is
                    # (ms, id) descending, as ZREVRANGEBYSCORE gives within one score).
                    if after is not None and ms == after.created_ms and rid >= after.run_id:
                        continue
                    found[b].append((ms, rid))
                    kept += 1
                offset[b] += len(part)
                # A full reply that was all ties skipped at the cursor: read further.
                if len(part) == fetch[b] and kept < fetch[b] and last_ms == (
                        after.created_ms if after else None) and len(found[b]) < batch:
                    again[b] = fetch[b]
            fetch = again
        return heapq.nlargest(batch, (row for rows in found.values() for row in rows))

    def _rows(self, ids: list[tuple[int, str]]) -> list[RunRow | None]:
        pipe = self.client.pipeline(transaction=False)
        for _, rid in ids:
            pipe.hmget(self.keys.run(rid), list(_FIELDS))
        out: list[RunRow | None] = []
        for (ms, rid), reply in zip(ids, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, Exception) or reply[0] is None:
                out.append(None)  # pruned between the two reads, or not a hash: skipped
                continue
            try:
                record = msgspec.json.decode(reply[0], type=RunRecord)
            except (msgspec.DecodeError, msgspec.ValidationError):
                out.append(None)  # a corrupt record costs only itself
                continue
            out.append(RunRow(rid, record.name, _s(reply[3] or record.queue),
                              _s(reply[1] or b"?"), _num(reply[2]) or 0,
                              _num(reply[4]) or ms, _num(reply[5]), _num(reply[6]),
                              record.parent))
        return out

    def page(self, *, limit: int = 50, after: Cursor | None = None,
             filters: Filters | None = None,
             scan_budget: int = DEFAULT_SCAN_BUDGET) -> Page:
        filters = filters or Filters()
        rows: list[RunRow] = []
        scanned = 0
        cursor = after
        while True:
            batch = limit if not filters.narrowing else min(max(limit * 4, 200), 1000,
                                                             max(scan_budget - scanned, 1))
            ids = self._candidates(cursor, filters, batch)
            if not ids:
                return Page(rows, None, scanned, False)
            for (ms, rid), row in zip(ids, self._rows(ids), strict=True):
                scanned += 1
                cursor = Cursor(ms, rid)
                if row is not None and _matches(row, filters):
                    rows.append(row)
                    if len(rows) >= limit:
                        return Page(rows, cursor, scanned, False)
            if len(ids) < batch:
                return Page(rows, None, scanned, False)
            if scanned >= scan_budget:
                return Page(rows, cursor, scanned, True)


def _matches(row: RunRow, f: Filters) -> bool:
    return ((f.status is None or row.status == f.status)
            and (f.workflow is None or row.name == f.workflow)
            and (f.queue is None or row.queue == f.queue))
