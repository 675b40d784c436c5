"""Which runs a bulk operation acts on: a filter (status, workflow, queue, created between
two instants, tags, an open question) walked in bounded batches.

The walk is the runs list's (engine/paging.py): newest first from a cursor, so runs whose
status changes behind the cursor (a cancel of `--status queued`) never shift the walk. It is
pinned to the runs created before the operation began (`until` is at most then): the reruns
a bulk rerun makes, or runs started meanwhile, are not swept in. `question` walks the feed of
open questions instead (its per-bucket index, scanned for that key), the other criteria then
checked on each run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..store.replies import as_text
from .authoring import InputError
from .paging import Cursor, Filters, RunPager
from .runs import STATUSES, RunStore
from .tags import parse_tags

BATCH = 100  # ids acted on per pass: a pass is the unit an interrupt waits for
# The instants a filter may name: what a date can show (a NaN or an infinity compares
# false or overflows when the walk turns it into milliseconds).
_EARLIEST, _LATEST = -62135596800.0, 253402300799.0


class FilterError(InputError):
    """A filter that cannot select: an unknown status, a bad tag, no criterion at all."""

    code = "invalid_filter"


@dataclass(frozen=True)
class RunFilter:
    """Runs to act on: every given criterion must hold. `since`/`until` are epoch seconds of
    the runs' creation; `tags` pairs (key, value); `question` an open question's key."""

    status: str | None = None
    workflow: str | None = None
    queue: str | None = None
    since: float | None = None
    until: float | None = None
    tags: tuple[tuple[str, str], ...] = ()
    question: str | None = None

    @classmethod
    def build(cls, *, status: str | None = None, workflow: str | None = None,
              queue: str | None = None, since: float | None = None,
              until: float | None = None, tags: list[str] | tuple[str, ...] | dict[str, str]
              | None = None, question: str | None = None) -> RunFilter:
        """A filter checked: tags as `key=value` texts or a mapping. FilterError."""
        if status is not None and status not in STATUSES:
            raise FilterError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
        for name, text in (("workflow", workflow), ("queue", queue), ("question", question)):
            if text is not None and not isinstance(text, str):
                raise FilterError(f"{name} must be text, not {type(text).__name__}")
        for name, value in (("since", since), ("until", until)):
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, int | float)
                                      or not _EARLIEST <= value <= _LATEST):
                raise FilterError(f"{name} must be epoch seconds (years 1 to 9999), not "
                                  f"{value!r}"[:200])
        if since is not None and until is not None and since > until:
            raise FilterError("since is after until: no run can match")
        if isinstance(tags, dict):
            pairs = parse_tags(f"{k}={v}" for k, v in tags.items())
        elif isinstance(tags, str):
            pairs = parse_tags([tags])  # one `key=value`, not its characters
        else:
            pairs = parse_tags(tags or ())
        if question is not None:
            from .waits import check_key

            check_key(question, "question key")
        made = cls(status or None, workflow or None, queue or None, since, until, pairs,
                   question or None)
        if made.empty:
            raise FilterError("give at least one of --status, --workflow, --queue, --since, "
                              "--until, --tag, --question (a bulk operation never means "
                              "every run)")
        return made

    @property
    def empty(self) -> bool:
        return not (self.status or self.workflow or self.queue or self.since is not None
                    or self.until is not None or self.tags or self.question)

    def describe(self) -> str:
        parts = [f"{k} {v}" for k, v in (("status", self.status), ("workflow", self.workflow),
                                          ("queue", self.queue)) if v]
        parts += [f"created since {_iso(self.since)}"] if self.since is not None else []
        parts += [f"created until {_iso(self.until)}"] if self.until is not None else []
        parts += [f"tag {k}={v}" for k, v in self.tags]
        parts += [f"open question {self.question}"] if self.question else []
        return ", ".join(parts)

    def to_json(self) -> dict[str, object]:
        return {"status": self.status, "workflow": self.workflow, "queue": self.queue,
                "since": self.since, "until": self.until,
                "tags": [f"{k}={v}" for k, v in self.tags], "question": self.question}

    def filters(self, until_ms: int) -> Filters:
        mine = None if self.until is None else int(self.until * 1000)
        return Filters(status=self.status, workflow=self.workflow, queue=self.queue,
                       since_ms=None if self.since is None else int(self.since * 1000),
                       until_ms=until_ms if mine is None else min(mine, until_ms),
                       tags=self.tags)


def _iso(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class Selection:
    """The runs a filter selects, as of `as_of_ms` (default now), in batches."""

    def __init__(self, runs: RunStore, run_filter: RunFilter, *, batch: int = BATCH,
                 as_of_ms: int | None = None) -> None:
        self.runs, self.filter, self.batch = runs, run_filter, batch
        self.as_of_ms = int(time.time() * 1000) if as_of_ms is None else as_of_ms

    def batches(self) -> Iterator[list[str]]:
        """Ids, `batch` at a time, newest first (oldest question first with `question`).
        Each batch is read when the previous one has been handed back."""
        if self.filter.question:
            yield from self._question_batches()
            return
        pager = RunPager(self.runs)
        filters = self.filter.filters(self.as_of_ms)
        after: Cursor | None = None
        while True:
            page = pager.page(limit=self.batch, after=after, filters=filters)
            if page.rows:
                yield [r.id for r in page.rows]
            if page.next is None:
                return
            after = page.next

    def _question_batches(self) -> Iterator[list[str]]:
        keys, client = self.runs.keys, self.runs.client
        wanted = self.filter.question or ""
        suffix = "|" + wanted
        pager = RunPager(self.runs)
        filters = self.filter.filters(self.as_of_ms)
        pending: list[str] = []
        for bucket in range(keys.buckets):
            # Members are `<run id>|<key>`: the key is matched here, not by a glob, so a key
            # holding glob characters needs no escaping.
            for member in client.zscan_iter(keys.feed(bucket), count=500):
                text = as_text(member[0])
                if not text.endswith(suffix):
                    continue
                pending.append(text[:-len(suffix)])
                if len(pending) >= self.batch:
                    if found := self._matching(pager, pending, filters):
                        yield found
                    pending = []
        if pending and (found := self._matching(pager, pending, filters)):
            yield found

    def _matching(self, pager: RunPager, ids: list[str], filters: Filters) -> list[str]:
        """The ids among `ids` whose run passes the other criteria."""
        rows = pager._rows([(0, rid) for rid in dict.fromkeys(ids)], filters)
        low = -1 if filters.since_ms is None else filters.since_ms
        high = filters.until_ms if filters.until_ms is not None else 2 ** 62
        return [r.id for r in rows if r is not None and low <= r.created_ms <= high]

    def count(self, sample: int = 10, cap: int | None = None) -> tuple[int, list[str]]:
        """How many runs match, and the first `sample` ids; with `cap`, counting stops once
        it reaches `cap` (a page that shows "10000+" need not walk a million runs)."""
        n, first = 0, list[str]()
        for ids in self.batches():
            n += len(ids)
            first += ids[:max(0, sample - len(first))]
            if cap is not None and n >= cap:
                break
        return n, first
