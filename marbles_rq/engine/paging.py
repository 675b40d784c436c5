"""Runs, newest first, a page at a time, at a cost that does not grow with the number of runs.

Runs are listed per bucket (``{P:bNNNN}:idx:run``, scored by creation time), so the newest
runs overall are a k-way merge of the buckets' newest. A page is read from a cursor, the
(created ms, run id) of the last run the previous page looked at: each bucket is asked for
at most a batch of ids at or before it (ZREVRANGEBYSCORE ... LIMIT), so a page costs one
pipelined round trip over the buckets plus one for the runs' fields, whether the deployment
holds a thousand runs or a million.

A tag filter reads the per-bucket index of its first tag (``{P:bNNNN}:idx:tag:K=V``, also
scored by creation time, written with the tag) instead of the listing of every run; further
tags, like status, workflow and queue, are checked on each candidate. Those have no index of
their own: a filtered page reads
candidates in that order until the page is full or `scan_budget` candidates were looked at,
and then says how far back it got, so one page never reads the whole keyspace. A time
window (created between two instants) is a score range, so it costs nothing extra.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..store.records import RunRecord
from ..store.replies import as_text
from .runs import RunStore, attempt_of

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
    resumptions: int = 0  # wakes after a park (attempt counts only redeliveries)
    tags: dict[str, str] = field(default_factory=dict)
    version: str = ""  # the workflow version it started on
    # A waiting run's wait: {"reason", "for"} as `status --json` has it (a retry's next
    # try, a failed step's tries); None for a run that is not waiting.
    waiting: dict[str, Any] | None = None


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
    tags: tuple[tuple[str, str], ...] = ()  # every (key, value) must be on the run

    @property
    def narrowing(self) -> bool:
        return bool(self.status or self.workflow or self.queue or len(self.tags) > 1)


_FIELDS = ("doc", "status", "attempt", "queue", "created_ms", "started_ms", "finished_ms",
           "deferred", "resumptions", "tags", "wait_reason", "wait_for")


def _waiting(status: Any, reason: Any, wait_for: Any) -> dict[str, Any] | None:
    if status != b"waiting" or not reason:
        return None
    try:
        what = msgspec.json.decode(wait_for) if wait_for else {}
    except msgspec.DecodeError:
        what = {}
    return {"reason": as_text(reason), "for": what if isinstance(what, dict) else {}}


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

    def _index(self, filters: Filters, bucket: int) -> str:
        if filters.tags:
            return self.keys.tag_index(*filters.tags[0], bucket)
        return self.keys.listing("run", bucket)

    def _candidates(self, after: Cursor | None, filters: Filters, batch: int
                    ) -> list[tuple[int, str]]:
        """Up to `batch` (ms, id) pairs strictly older than `after`, newest first, merged
        over the buckets. Each bucket is asked for a small share first; only buckets whose
        unread ids could still be among the newest `batch` are asked again (k-way merge with
        a frontier), so a page reads about `2 * batch` ids, not `buckets * batch`."""
        high: int | str = "+inf" if filters.until_ms is None else filters.until_ms
        if after is not None:
            high = after.created_ms if high == "+inf" else min(int(high), after.created_ms)
        low: int | str = "-inf" if filters.since_ms is None else filters.since_ms
        n = self.keys.buckets
        per = max(4, -(-2 * batch // n))
        found: list[tuple[int, str]] = []
        offset = dict.fromkeys(range(n), 0)
        frontier: dict[int, tuple[int, str]] = {}  # open bucket -> the last pair it gave
        ask = list(range(n))
        while ask:
            pipe = self.client.pipeline(transaction=False)
            for b in ask:
                pipe.zrevrangebyscore(self._index(filters, b), high, low, start=offset[b],
                                      num=per, withscores=True)
            for b, part in zip(ask, pipe.execute(), strict=True):
                offset[b] += len(part)
                frontier.pop(b, None)
                last: tuple[int, str] | None = None
                for member, score in part:
                    pair = (int(score), as_text(member))
                    last = pair
                    # Same millisecond as the cursor: only ids below it (the order is
                    # (ms, id) descending, as ZREVRANGEBYSCORE gives within one score).
                    if after is not None and pair >= (after.created_ms, after.run_id):
                        continue
                    found.append(pair)
                if len(part) == per and last is not None:
                    frontier[b] = last  # it may hold more, all at or below `last`
            found = heapq.nlargest(batch, found)
            if not frontier:
                break
            # Ids not read yet are at or below their bucket's frontier: a bucket is asked
            # again only if its frontier could still beat the page's last id.
            cut = found[-1] if len(found) >= batch else None
            ask = [b for b, last in frontier.items() if cut is None or last > cut]
            per *= 2
        return found

    def _rows(self, ids: list[tuple[int, str]], filters: Filters) -> list[RunRow | None]:
        """The rows of `ids`; None for a run that is gone, unreadable or filtered out. A
        status or queue filter is applied on two small fields before any document is read."""
        if filters.status or filters.queue:
            pipe = self.client.pipeline(transaction=False)
            for _, rid in ids:
                pipe.hmget(self.keys.run(rid), ["status", "queue"])
            keep = []
            for reply in pipe.execute(raise_on_error=False):
                ok = not isinstance(reply, Exception) and (
                    filters.status is None or as_text(reply[0] or b"") == filters.status) and (
                    filters.queue is None or as_text(reply[1] or b"") == filters.queue)
                keep.append(ok)
        else:
            keep = [True] * len(ids)
        wanted = [pair for pair, ok in zip(ids, keep, strict=True) if ok]
        pipe = self.client.pipeline(transaction=False)
        for _, rid in wanted:
            pipe.hmget(self.keys.run(rid), list(_FIELDS))
        rows: dict[str, RunRow | None] = {}
        for (ms, rid), reply in zip(wanted, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, Exception) or reply[0] is None:
                rows[rid] = None  # pruned between the two reads, or not a hash: skipped
                continue
            try:
                # Listing fields only: the input stays sealed (not opened for a row).
                record = msgspec.json.decode(reply[0], type=RunRecord)
            except (msgspec.DecodeError, msgspec.ValidationError):
                rows[rid] = None  # a corrupt record costs only itself
                continue
            row = RunRow(rid, record.name, as_text(reply[3] or record.queue),
                         as_text(reply[1] or b"?"),
                         attempt_of(_num(reply[2]) or 0, _num(reply[7]) or 0),
                         _num(reply[4]) or ms, _num(reply[5]), _num(reply[6]), record.parent,
                         _num(reply[8]) or 0, tags_of(reply[9]), record.wf_version,
                         _waiting(reply[1], reply[10], reply[11]))
            rows[rid] = row if _matches(row, filters) else None
        return [rows.get(rid) for _, rid in ids]

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
            for (ms, rid), row in zip(ids, self._rows(ids, filters), strict=True):
                scanned += 1
                cursor = Cursor(ms, rid)
                if row is not None:
                    rows.append(row)
                    if len(rows) >= limit:
                        return Page(rows, cursor, scanned, False)
            if len(ids) < batch:
                return Page(rows, None, scanned, False)
            if scanned >= scan_budget:
                return Page(rows, cursor, scanned, True)


def tags_of(raw: Any) -> dict[str, str]:
    """A run hash's `tags` field (a JSON object of text), {} when absent or unreadable."""
    if not raw:
        return {}
    try:
        return msgspec.json.decode(raw, type=dict[str, str])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return {}


def _matches(row: RunRow, f: Filters) -> bool:
    return ((f.status is None or row.status == f.status)
            and (f.workflow is None or row.name == f.workflow)
            and (f.queue is None or row.queue == f.queue)
            and all(row.tags.get(k) == v for k, v in f.tags))
