"""Controllers that share the lanes: what `marbles-rq controller` runs.

A lane is a shard of the buckets (store/keys.py, `lane_buckets`) with its own controller
lease and epoch. A controller process registers itself in `{P}:controllers` (a sorted set of
tokens scored by when they are gone unless they beat again, beaten from a thread of its own
like a worker's liveness) and leads its fair share of the lanes:

- its share is ceil(lanes / live controllers);
- below its share it takes lanes nobody holds (the acquire is atomic: of two controllers
  racing for a lane one wins, the other sees it held), starting at an offset of its own so
  that controllers arriving together do not all race for the same lanes;
- above its share (another controller arrived) it hands the excess back gracefully: the
  pass in progress finishes, the lane's duty threads stop, then the lease is released
  (compare-and-delete), so the newcomer can take the lane at its next look;
- a killed controller's registration lapses after `ttl_ms` (at most its lease) and its
  leases after the lease: the others' shares grow and they take its lanes.

N controllers converge on an even split within a few looks (every second, or every pass
while below their share). With one lane this is the single elected controller of before:
the lane's lease is the `controller` lease, one controller leads, the others wait.

Lane 0's lease is the `controller` lease of every earlier version, so an older controller
still running during an upgrade waits while lane 0 is led. If it holds that lease (its
token lacks the `:lanes` mark of new_token()), a controller leads no lane at all while it
does: an older controller acts on every bucket, and two must not both lead. (The fences
would refuse the writes of whichever is behind in each bucket; this keeps them from
trying.)
"""

from __future__ import annotations

import faulthandler
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from ..engine.runs import RunStore
from ..errors import RedisUnavailableError
from ..store import LeaseInfo, RedisStore
from ..store.redis_errors import one_line
from ..store.replies import as_text, server_ms
from ..transport.lanes import RQLike
from .duties import Duty
from .loop import Controller, backing_off, new_token

log = logging.getLogger("marbles_rq.controller")

BALANCE_EVERY_S = 1.0       # how often a controller at its share looks at the others
FORGET_GONE_AFTER_MS = 60_000  # registrations lapsed this long are removed (tidiness only)
LANE_MARK = ":lanes"        # the end of a lane-sharing controller's token (new_token)


class Sharing:
    """One controller process: registers, takes its share of the lanes, leads each of them
    with a `Controller` of that lane, hands lanes back above its share."""

    def __init__(self, runs: RunStore, rq: RQLike, *, lease_ms: int = 10_000,
                 interval_s: float = 0.5, duties: Callable[[], Sequence[Duty]] = tuple,
                 **options: Any) -> None:
        self.runs, self.rq = runs, rq
        self.keys = runs.keys
        self.lease_ms, self.interval_s = lease_ms, interval_s
        self.duties = duties  # a fresh set per lane: duties keep per-leadership state
        self.options = options
        self.token = new_token()
        # A registration outlives a few missed beats but not the lease: once a killed
        # controller's leases lapse, the others already count it gone and take its lanes.
        self.ttl_ms = max(1_000, min(lease_ms, 10_000))
        self.balance_every_s = min(BALANCE_EVERY_S, lease_ms / 3000)
        self.led: dict[int, Controller] = {}
        self.stop_event = threading.Event()
        self._floors: dict[int, int] = {}  # per lane: a fresh epoch must be above this
        self._next_balance = 0.0
        self._eager = True  # below its share or a lane unled: look every pass
        self._older: str | None = None  # the token of an older controller leading, if any
        self._beat_thread: threading.Thread | None = None

    # -- registration -------------------------------------------------------------------------

    def beat(self) -> None:
        self.runs.scripts.beat_worker(workers_key=self.keys.controllers, worker=self.token,
                                      ttl_ms=self.ttl_ms)

    def _beat_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.beat()
            except (redis.RedisError, RedisUnavailableError, OSError) as exc:
                # The main loop meets the same Redis and logs it (once, with its back-off);
                # a lapsed registration only lets the others count one controller fewer.
                log.debug("controller registration beat failed (%s)", one_line(exc))
            self.stop_event.wait(self.ttl_ms / 4000)

    def leading(self) -> list[int]:
        """The lanes this process leads now (read by the metrics' scrape thread)."""
        return [lane for lane, ctl in list(self.led.items()) if ctl.lease is not None]

    def live(self, now_ms: int) -> list[str]:
        """Tokens of the controllers registered and not lapsed, this one included."""
        found = {as_text(t) for t in self.runs.client.zrangebyscore(self.keys.controllers,
                                                                now_ms, "+inf")}
        return sorted(found | {self.token})

    def holders(self) -> list[str | None]:
        """The token holding each lane's lease, or None (one pipelined read)."""
        pipe = self.runs.client.pipeline(transaction=False)
        for lane in range(self.keys.lanes):
            pipe.get(self.keys.lease(self.keys.lane_lease(lane)))
        return [None if v is None else as_text(v).partition("|")[2] for v in pipe.execute()]

    # -- sharing ------------------------------------------------------------------------------

    def _lane(self, lane: int) -> Controller:
        ctl = Controller(self.runs, self.rq, lease_ms=self.lease_ms, interval_s=self.interval_s,
                         duties=self.duties(), lane=lane, token=self.token, **self.options)
        ctl._floor = self._floors.get(lane, 0)
        return ctl

    def balance(self) -> None:
        """Take unheld lanes up to this controller's share; hand back those above it."""
        lanes = self.keys.lanes
        now_ms = server_ms(self.runs.client)
        live = self.live(now_ms)
        share = -(-lanes // len(live))
        holders = self.holders()
        older = holders[0] if lanes > 1 and holders[0] is not None and not holders[0].endswith(
            LANE_MARK) else None
        if older is not None:
            if older != self._older:
                log.warning("a controller of an earlier version (%s) holds the controller "
                            "lease and acts on every bucket: leading no lane until it is "
                            "gone", older.rpartition(":")[0])
            self._older = older
            for lane in sorted(self.led):
                self.hand_back(lane, "an earlier controller leads")
            self._eager = False
            return
        self._older = None
        for lane in sorted(self.led, reverse=True)[:max(0, len(self.led) - share)]:
            self.hand_back(lane, f"share {share} of {lanes} lanes over {len(live)} "
                                 f"controllers")
        if len(self.led) < share:
            me = live.index(self.token)
            start = me * lanes // len(live)
            for i in range(lanes):
                lane = (start + i) % lanes
                if len(self.led) >= share:
                    break
                if holders[lane] is None and lane not in self.led:
                    ctl = self._lane(lane)
                    if ctl.lead():
                        self.led[lane] = ctl
        unled = any(h is None for lane, h in enumerate(holders) if lane not in self.led)
        self._eager = len(self.led) < share or unled
        gone = [as_text(t) for t in self.runs.client.zrangebyscore(
            self.keys.controllers, "-inf", now_ms - FORGET_GONE_AFTER_MS, start=0, num=100)]
        if gone:
            self.runs.scripts.forget_workers(workers_key=self.keys.controllers, workers=gone,
                                             cutoff_ms=now_ms - FORGET_GONE_AFTER_MS)

    def _older_leads(self) -> bool:
        """With several lanes and lane 0 led elsewhere: does a controller of an earlier
        version hold its lease now? One read per pass, so that such a controller and this
        one act together for one pass at most, not until the next look (whose epochs come
        from different counters and could be equal: the fences would let both through)."""
        if self.keys.lanes == 1 or 0 in self.led:
            return False
        value = self.runs.client.get(self.keys.lease(self.keys.lane_lease(0)))
        holder = None if value is None else as_text(value).partition("|")[2]
        return holder is not None and not holder.endswith(LANE_MARK) and holder != self._older

    def hand_back(self, lane: int, why: str) -> None:
        """Stop leading `lane` between passes: its duty threads stop first, then its lease
        is released, so its next leader starts at once and finds nothing half done here."""
        ctl = self.led.pop(lane, None)
        if ctl is None:
            return
        self._close(ctl)
        if ctl.lease is not None:
            log.info("handing lane %s back (%s)", lane, why)
        ctl.release()

    def _close(self, ctl: Controller) -> None:
        self._floors[ctl.lane] = max(self._floors.get(ctl.lane, 0), ctl._floor)
        ctl.stop_event.set()
        for duty in ctl.duties:
            close = getattr(duty, "close", None)
            if close is not None:
                close()
        ctl.watch.close()

    def _drop(self, lane: int) -> None:
        """The lane's controller no longer leads (its lease lapsed, a newer leader fenced
        it, or it gave the lease back to take a higher epoch): stop its duties; whether to
        take the lane again is the next balance's call."""
        ctl = self.led.pop(lane, None)
        if ctl is not None:
            self._close(ctl)
            self._eager = True

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        log.info("controller %s started (lease %s ms, %s lane%s)", self.token, self.lease_ms,
                 self.keys.lanes, "" if self.keys.lanes == 1 else "s")
        self._beat_thread = threading.Thread(target=self._beat_loop, name="marbles-ctl-beat",
                                             daemon=True)
        self._beat_thread.start()
        backoff = 0.0
        while not self.stop_event.is_set():
            # A pass that outlasts half a lease is about to cost this controller its lanes:
            # every thread's stack goes to the log then, to say where it hangs.
            faulthandler.dump_traceback_later(max(5.0, self.lease_ms / 2000))
            try:
                if self._eager or time.monotonic() >= self._next_balance \
                        or self._older_leads():
                    self._next_balance = time.monotonic() + self.balance_every_s
                    self.balance()
                for lane in sorted(self.led):
                    if self.stop_event.is_set():
                        break
                    if not self.led[lane].step():
                        self._drop(lane)
                if backoff:
                    log.info("Redis answers again; carrying on")
                backoff = 0.0
            except Exception as exc:
                # As Controller.run: one line, back off, carry on. Leases may lapse meanwhile;
                # the fences keep successors and this process from acting twice.
                for ctl in self.led.values():
                    ctl._in_contact_since = None
                backoff = backing_off(exc, backoff)
                faulthandler.cancel_dump_traceback_later()
                self.stop_event.wait(backoff)
            faulthandler.cancel_dump_traceback_later()
            self.stop_event.wait(self.interval_s)
        self.shutdown()

    def shutdown(self) -> None:
        """Hand every lane back and leave the registry, so the others take over at once."""
        for lane in sorted(self.led):
            self._close(self.led[lane])
        for lane in sorted(self.led):
            ctl = self.led.pop(lane)
            if ctl.lease is not None:
                ctl.release()
                log.info("released the controller lease%s",
                         f" of lane {lane}" if self.keys.lanes > 1 else "")
        try:
            self.runs.scripts.forget_workers(workers_key=self.keys.controllers,
                                             workers=[self.token], cutoff_ms=None)
        except (redis.RedisError, RedisUnavailableError) as exc:
            log.warning("could not leave the controller registry (%s); it lapses",
                        one_line(exc))


@dataclass(frozen=True)
class LaneLeader:
    """Who leads a lane, for `leader`, `doctor` and `health controller`."""

    lane: int
    buckets: range
    info: LeaseInfo | None  # None: no controller leads it

    @property
    def holder(self) -> str | None:
        """``host:pid`` of the leading controller (from its token), or None."""
        if self.info is None:
            return None
        host, _, rest = self.info.token.partition(":")
        return f"{host}:{rest.partition(':')[0]}"


def lane_leaders(store: RedisStore) -> list[LaneLeader]:
    """Each lane's leader, read without writing (one read per lane)."""
    keys = store.keys
    return [LaneLeader(lane, keys.lane_buckets(lane), store.lease_holder(keys.lane_lease(lane)))
            for lane in range(keys.lanes)]
