"""The dashboard's per-minute rollups (store/rollups.py), kept by each lane's leader for its
own lane: runs finished per minute by status, duration percentiles per workflow, and a
sample of the lane's queues and waiting runs.

Finished runs are counted from the store, never from a worker: the finished index of each
bucket scores a run at its finish time plus its retention, so for each retention in use (the
declared workflows' and the default; a per-run override outside those is not seen) the
window [since + retention, now + retention] holds the runs finished since `since`; each
candidate's own `finished_ms` decides its minute. A minute is recomputed whole and written
over (lua/put_rollup.lua), so a repeat, a takeover that recomputes, or two controllers that
overlap for a moment write the same counts; the write is fenced by the lane's epoch. A new
leader backfills the last BACKFILL_MINUTES (the minutes nobody led are counted then; their
queue samples stay empty); then each pass recomputes the current minute, and the previous
one until it was written once SEAL_AFTER_MS after its end.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from ..engine.catalog import Declared
from ..store.replies import as_text
from ..store.rollups import KEEP_MINUTES, MINUTE_MS, Durations, MinuteRollup
from ..transport import dispatch

if TYPE_CHECKING:
    from .context import DutyContext

log = logging.getLogger("marbles_rq.controller")

ROLLUP_EVERY_S = 10.0
# A minute is final once written this long after its end: a run's finished_ms is the server
# clock when its terminal record was written, so nothing lands in a minute later than that.
SEAL_AFTER_MS = 5_000
BACKFILL_MINUTES = 60
MAX_WORKFLOWS = 20          # per minute: the busiest; the others are counted, not timed
MAX_RETENTIONS = 32         # distinct retentions looked for (the catalog's and those seen)
DEFAULT_RETENTION_MS = 7 * 86_400_000
_STATUSES = ("succeeded", "failed", "cancelled")


class _Named(msgspec.Struct):
    """A run document read for its workflow's name only (the rest, its input too, skipped)."""

    name: str = "?"


class Finished(msgspec.Struct, frozen=True):
    minute: int
    status: str
    workflow: str
    duration_ms: int | None


class RollupsDuty:
    kind = "rollups"

    def __init__(self) -> None:
        self._next = 0.0
        self._seen_retentions: set[int] = {DEFAULT_RETENTION_MS}
        self._sealed = 0  # the newest minute written whole after its end, by this leader

    def recover(self, ctl: DutyContext) -> int:
        self._next = time.monotonic() + ROLLUP_EVERY_S
        self._sealed = 0
        return self.roll(ctl, BACKFILL_MINUTES)

    def tick(self, ctl: DutyContext) -> None:
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + ROLLUP_EVERY_S
            # The previous minute too, until it was written once after its end.
            now_minute = ctl.server_ms() // MINUTE_MS
            self.roll(ctl, 1 if self._sealed >= now_minute - 1 else 2)

    def roll(self, ctl: DutyContext, minutes: int) -> int:
        """Recompute the last `minutes` minutes (the current one included) of this lane and
        write them; returns how many runs they count."""
        lane = ctl.keys.lane_of_bucket(ctl.buckets.start)
        now_ms = ctl.server_ms()
        this_minute = now_ms // MINUTE_MS
        first = this_minute - minutes + 1
        finished = self.finished(ctl, first * MINUTE_MS, now_ms)
        sample = self.sample(ctl, lane)
        client = ctl.store.client
        kept = client.hmget(ctl.keys.rollups(lane), list(range(first, this_minute + 1)))
        docs: list[tuple[int, bytes]] = []
        for minute, old in zip(range(first, this_minute + 1), kept, strict=True):
            runs = [f for f in finished if f.minute == minute]
            # A past minute keeps the sample taken in it (none if nobody led then).
            gauges = sample if minute == this_minute else _gauges_of(old)
            if not runs and old is None and minute != this_minute:
                continue
            docs.append((minute, msgspec.json.encode(_rollup(minute, runs, gauges))))
        if ctl.lease is None:
            return 0
        reply = ctl.runs.scripts.put_rollup(
            rollups_key=ctl.keys.rollups(lane), minutes_key=ctl.keys.rollup_minutes(lane),
            fence_key=ctl.keys.controller_fence(ctl.buckets.start), ctl_epoch=ctl.epoch,
            keep_from=this_minute - KEEP_MINUTES + 1, keep_ms=(KEEP_MINUTES + 60) * MINUTE_MS,
            minutes=docs)
        if reply.status == "fenced":
            ctl.step_down(f"a newer controller (epoch {as_text(reply.values[0])}) writes the "
                          f"rollups of lane {lane}")
            return 0
        if now_ms - this_minute * MINUTE_MS >= SEAL_AFTER_MS:
            self._sealed = this_minute - 1
        return len(finished)

    def retentions(self, ctl: DutyContext) -> set[int]:
        found = set(self._seen_retentions)
        decoder = msgspec.json.Decoder(Declared)
        for doc in ctl.store.client.hvals(ctl.keys.workflows):
            try:
                found.add(int(decoder.decode(doc).retention_s * 1000))
            except msgspec.DecodeError:
                continue
        return found

    def finished(self, ctl: DutyContext, since_ms: int, now_ms: int) -> list[Finished]:
        """The runs of this lane that finished in [since_ms, now_ms], read in two pipelined
        rounds: the finished index per bucket and retention, then the candidates' fields."""
        keys, client = ctl.keys, ctl.store.client
        pipe = client.pipeline(transaction=False)
        for retention in sorted(self.retentions(ctl)):
            for bucket in ctl.buckets:
                pipe.zrangebyscore(keys.run_finished(bucket), since_ms + retention,
                                   now_ms + retention)
        candidates: set[str] = set()
        for found in pipe.execute(raise_on_error=False):
            if not isinstance(found, Exception):
                candidates.update(map(as_text, found))
        if not candidates:
            return []
        ids = sorted(candidates)
        pipe = client.pipeline(transaction=False)
        for run_id in ids:
            pipe.hmget(keys.run(run_id), "status", "finished_ms", "started_ms",
                       "retention_ms", "doc")
        decoder = msgspec.json.Decoder(_Named)
        out: list[Finished] = []
        for fields in pipe.execute(raise_on_error=False):
            if isinstance(fields, Exception) or fields[1] is None:
                continue
            status, finished_ms = as_text(fields[0]), int(fields[1])
            if status not in _STATUSES or not since_ms <= finished_ms <= now_ms:
                continue
            if fields[3] is not None and len(self._seen_retentions) < MAX_RETENTIONS:
                self._seen_retentions.add(int(fields[3]))
            try:
                name = decoder.decode(fields[4]).name if fields[4] else "?"
            except msgspec.DecodeError:
                name = "?"
            started = int(fields[2]) if fields[2] is not None else None
            out.append(Finished(finished_ms // MINUTE_MS, status, name,
                                None if started is None else max(0, finished_ms - started)))
        return out

    def sample(self, ctl: DutyContext, lane: int) -> tuple[int, int, int, int]:
        """(queued deliveries, running, waiting runs, open questions) of this lane now."""
        rq_lane = ctl.rq.lane(lane)
        depths = dispatch.queue_depths(rq_lane.conn, ctl.keys.prefix, rq_lane.rq_prefix)
        queued = sum(q for q, _ in depths.values())
        pipe = ctl.store.client.pipeline(transaction=False)
        for bucket in ctl.buckets:
            pipe.zcard(ctl.keys.run_leases(bucket))
            pipe.zcard(ctl.keys.run_waits(bucket))
            pipe.zcard(ctl.keys.feed(bucket))
        counts = [c if isinstance(c, int) else 0 for c in pipe.execute(raise_on_error=False)]
        return queued, sum(counts[0::3]), sum(counts[1::3]), sum(counts[2::3])


def _gauges_of(doc: Any) -> tuple[int, int, int, int]:
    if doc is None:
        return -1, -1, -1, -1
    try:
        old = msgspec.json.decode(doc, type=MinuteRollup)
    except msgspec.DecodeError:
        return -1, -1, -1, -1
    return old.queued, old.running, old.waiting, old.questions


def _rollup(minute: int, runs: list[Finished], gauges: tuple[int, int, int, int]
            ) -> MinuteRollup:
    by_status = {s: sum(1 for r in runs if r.status == s) for s in _STATUSES}
    timed: dict[str, list[int]] = {}
    for r in runs:
        if r.duration_ms is not None:
            timed.setdefault(r.workflow, []).append(r.duration_ms)
    busiest = sorted(timed.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:MAX_WORKFLOWS]
    durations = {name: Durations(len(ms), percentile(ms, 50), percentile(ms, 95))
                 for name, ms in busiest}
    queued, running, waiting, questions = gauges
    return MinuteRollup(version=MinuteRollup.VERSION, minute=minute, durations=durations,
                        queued=queued, running=running, waiting=waiting, questions=questions,
                        **by_status)


def percentile(values: list[int], pct: int) -> int:
    """Nearest-rank percentile (of a non-empty list)."""
    ordered = sorted(values)
    rank = max(1, -(-pct * len(ordered) // 100))
    return ordered[rank - 1]
