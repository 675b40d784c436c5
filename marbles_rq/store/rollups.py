"""The dashboard's per-minute rollups: what one lane's runs did in one minute, written by
the lane's leading controller (controller/rollups.py) and read, summed over the lanes, by the
dashboard's charts (`read_minutes`)."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from .keys import Keyspace
from .records import Record

MINUTE_MS = 60_000
KEEP_MINUTES = 24 * 60  # the window kept per lane: a day of minutes


class Durations(msgspec.Struct, array_like=True, frozen=True):
    """One workflow's runs that finished in the minute: how many, and the median and 95th
    percentile of their duration (started to finished, ms)."""

    n: int
    p50_ms: int
    p95_ms: int


class MinuteRollup(Record, tag="rollup", kw_only=True, frozen=True):
    """One lane's minute: runs finished by status, durations per workflow (the busiest
    MAX_WORKFLOWS), and the last sample taken in the minute (-1: none taken, the controller
    did not lead then) of its deliveries queued in RQ, runs executing (holding a lease),
    runs waiting on a time (a timer, a timeout, a check of children: the controller's wait
    index) and open questions."""

    VERSION: ClassVar[int] = 1
    minute: int  # epoch minutes (server clock)
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    durations: dict[str, Durations] = msgspec.field(default_factory=dict)
    queued: int = -1
    running: int = -1
    waiting: int = -1
    questions: int = -1


def read_minutes(client: Any, keys: Keyspace, first: int, last: int
                 ) -> dict[int, MinuteRollup]:
    """The rollups of minutes first..last summed over every lane (one HMGET per lane, in one
    pipeline); a minute no lane wrote is absent. An unreadable entry is skipped: a chart is
    no reason to fail a page."""
    minutes = list(range(first, last + 1))
    pipe = client.pipeline(transaction=False)
    for lane in range(keys.lanes):
        pipe.hmget(keys.rollups(lane), minutes)
    decoder = msgspec.json.Decoder(MinuteRollup)
    summed: dict[int, MinuteRollup] = {}
    for found in pipe.execute(raise_on_error=False):
        if isinstance(found, Exception):
            continue
        for minute, doc in zip(minutes, found, strict=True):
            if doc is None:
                continue
            try:
                one = decoder.decode(doc)
            except msgspec.DecodeError:
                continue
            seen = summed.get(minute)
            summed[minute] = one if seen is None else _add(seen, one)
    return summed


def _add(a: MinuteRollup, b: MinuteRollup) -> MinuteRollup:
    durations = dict(a.durations)
    for name, d in b.durations.items():
        # Percentiles do not add: two lanes' runs of one workflow keep the busier lane's.
        if name not in durations or d.n > durations[name].n:
            durations[name] = d
    return MinuteRollup(
        version=a.version, minute=a.minute, succeeded=a.succeeded + b.succeeded,
        failed=a.failed + b.failed, cancelled=a.cancelled + b.cancelled, durations=durations,
        queued=_gauge(a.queued, b.queued), running=_gauge(a.running, b.running),
        waiting=_gauge(a.waiting, b.waiting), questions=_gauge(a.questions, b.questions))


def _gauge(a: int, b: int) -> int:
    if a < 0 or b < 0:
        return max(a, b)
    return a + b
