"""Rate limits in the store: taking a limit (one script on the limit's own tag), the rates
set at run time, and the listing `limits` shows. `RedisRates` is the deployment's;
`MemoryRates` the runs in memory's (the dry run and the test kit), the same decisions on
their virtual clock. flow/rate_limits.py explains the limiter.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from ..errors import MarblesError
from ..store.replies import as_text
from .rate_specs import Rate, RateError, check_name, format_interval, rate_id

if TYPE_CHECKING:
    from ..store.keys import Keyspace
    from ..store.scripts import Scripts

# A head this late for its turn is dropped from its limit's queue (its run was cancelled or
# lost), so one run cannot block the rest; it queues again at the tail if it comes back.
STALE_MS = 10_000
# An admission is remembered this long: a redelivery within it gets the same admission.
KEEP_MS = 3_600_000
# Held runs whose turn comes within this are released when a run is admitted: its worker
# wakes them (the queue's head chain), so a held run is woken about once, near its turn.
LOOKAHEAD_MS = 120
# How long a process trusts the rates it read for `limits set` (their changes take effect
# within this).
OVERRIDES_TTL_S = 1.0


class UnknownRateLimitError(MarblesError):
    code = "unknown_rate_limit"


@dataclass(frozen=True)
class Taken:
    """A limit's answer: admitted at `at_ms`, or held with its turn at about `at_ms`."""

    status: str  # admitted | held
    at_ms: int
    position: int = 0  # held: its place in the queue (0: the head)
    queued: int = 0  # held: runs the limit holds, this one included
    fresh: bool = True  # admitted: just now (False: an earlier admission of the same token)
    release: tuple[str, ...] = ()  # admitted: the held runs' tokens released now (to wake)
    near: bool = True  # held: released (its timer at its turn), else the chain wakes it


@dataclass(frozen=True)
class RateLimitInfo:
    """One rate limit as `limits` lists it."""

    name: str
    family: str  # the workflow of a workflow's limit per key, else the name itself
    rate: str  # in force: set at run time, else the source's
    burst: int
    source: str  # the rate the source declares ("" when no worker said yet)
    overridden: bool
    held: int
    last_ms: int  # the last admission (server ms; 0: none)
    admissions: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "rate": self.rate,
                "burst": self.burst, "source": self.source, "overridden": self.overridden,
                "held": self.held, "last_admission_ms": self.last_ms or None,
                "admissions": self.admissions}


class Rates(Protocol):
    def take(self, name: str, token: str, rate: Rate) -> Taken: ...

    def note(self, name: str, family: str, declared: Rate) -> None: ...

    def effective(self, name: str, family: str, declared: Rate) -> Rate: ...


def _encode_override(rate: Rate) -> str:
    return f"{rate.text}|{rate.burst}"


def _decode_override(raw: Any) -> Rate | None:
    try:
        text, burst = as_text(raw).rsplit("|", 1)
        return Rate(text, int(burst))
    except (ValueError, RateError):
        return None


def _pick(overrides: dict[str, Rate], name: str, family: str, declared: Rate) -> Rate:
    return overrides.get(name) or overrides.get(family) or declared


class RedisRates:
    """The deployment's rate limits (one per worker's RunStore: it caches the rates set at
    run time for OVERRIDES_TTL_S)."""

    def __init__(self, client: Any, keys: Keyspace, scripts: Scripts) -> None:
        self.client, self.keys, self.scripts = client, keys, scripts
        self._noted: set[tuple[str, str]] = set()
        self._overrides: dict[str, Rate] = {}
        self._read_at = -1e9
        self._lock = threading.Lock()

    def take(self, name: str, token: str, rate: Rate) -> Taken:
        ident = rate_id(name)
        reply = self.scripts.take_rate(
            state_key=self.keys.rate_state(ident), queue_key=self.keys.rate_queue(ident),
            admitted_key=self.keys.rate_admitted(ident), token=token,
            interval_us=rate.interval_us, burst=rate.burst, stale_ms=STALE_MS, keep_ms=KEEP_MS,
            lookahead_us=LOOKAHEAD_MS * 1000)
        if reply.status == "admitted":
            return Taken("admitted", int(reply.values[0]), fresh=int(reply.values[1]) == 1,
                         release=tuple(as_text(t) for t in reply.values[2:]))
        values = [int(v) for v in reply.values]
        return Taken("held", values[0], values[1], values[2], near=values[3] == 1)

    def note(self, name: str, family: str, declared: Rate) -> None:
        """Record the limit for `limits` (once per process and rate)."""
        spec = (name, declared.spec())
        if spec in self._noted:
            return
        self.client.hset(self.keys.rate_names, name, msgspec.json.encode(
            {"family": family, "rate": declared.text, "burst": declared.burst}))
        self._noted.add(spec)

    def effective(self, name: str, family: str, declared: Rate) -> Rate:
        with self._lock:
            if time.monotonic() - self._read_at > OVERRIDES_TTL_S:
                raw = self.client.hgetall(self.keys.rate_overrides)
                self._overrides = {as_text(k): r for k, v in raw.items()
                                   if (r := _decode_override(v)) is not None}
                self._read_at = time.monotonic()
            return _pick(self._overrides, name, family, declared)

    # -- what `limits` reads and changes -----------------------------------------------------

    def _known(self, catalog: dict[str, Rate]) -> dict[str, tuple[str, Rate | None]]:
        """name -> (family, the source's rate) of every limit seen or declared."""
        known: dict[str, tuple[str, Rate | None]] = {}
        for name, rate in catalog.items():
            known[name] = (name, rate)
        for raw_name, raw in self.client.hgetall(self.keys.rate_names).items():
            try:
                doc = msgspec.json.decode(raw)
                declared: Rate | None = Rate(doc["rate"], int(doc["burst"]))
                family = str(doc["family"])
            except (msgspec.DecodeError, KeyError, TypeError, ValueError, RateError):
                declared, family = None, as_text(raw_name)
            known[as_text(raw_name)] = (family, declared)
        return known

    def list(self, catalog: dict[str, Rate]) -> list[RateLimitInfo]:
        """Every rate limit seen or declared (`catalog`: the workflows' own, by name)."""
        known = self._known(catalog)
        overrides = {as_text(k): r for k, v in self.client.hgetall(
            self.keys.rate_overrides).items() if (r := _decode_override(v)) is not None}
        names = sorted(known)
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            ident = rate_id(name)
            pipe.hmget(self.keys.rate_state(ident), "last", "admissions")
            pipe.zcard(self.keys.rate_queue(ident))
        replies = iter(pipe.execute())
        out = []
        for name in names:
            state, held = next(replies), next(replies)
            family, declared = known[name]
            out.append(_info(name, family, declared, overrides, int(held),
                             int(state[0] or 0), int(state[1] or 0)))
        return out

    def set(self, name: str, rate: Rate, catalog: dict[str, Rate]) -> RateLimitInfo:
        check_name(name, "rate limit")
        self._check_known(name, catalog)
        self.client.hset(self.keys.rate_overrides, name, _encode_override(rate))
        return self.get(name, catalog)

    def reset(self, name: str, catalog: dict[str, Rate]) -> RateLimitInfo:
        check_name(name, "rate limit")
        self._check_known(name, catalog)
        self.client.hdel(self.keys.rate_overrides, name)
        return self.get(name, catalog)

    def get(self, name: str, catalog: dict[str, Rate]) -> RateLimitInfo:
        found = self.list(catalog)
        for info in found:
            if info.name == name:
                return info
        for info in found:
            if info.family == name:
                return info
        raise _unknown(name)

    def _check_known(self, name: str, catalog: dict[str, Rate]) -> None:
        known = self._known(catalog)
        if name not in known and name not in {f for f, _ in known.values()}:
            raise _unknown(name)


def catalog_rates(client: Any, keys: Keyspace) -> dict[str, Rate]:
    """The workflows' own rate limits, as their workers declared them (by workflow name)."""
    from ..engine.catalog import Declared

    out: dict[str, Rate] = {}
    for name, raw in client.hgetall(keys.workflows).items():
        try:
            entry = msgspec.json.decode(raw, type=Declared)
            if entry.rate_limit:
                out[as_text(name)] = Rate(entry.rate_limit, entry.rate_burst)
        except (msgspec.DecodeError, msgspec.ValidationError, RateError):
            continue
    return out


def _unknown(name: str) -> UnknownRateLimitError:
    return UnknownRateLimitError(
        f"unknown rate limit {name!r}: no workflow declares it and no run has taken it "
        f"(marbles-rq limits lists them)")


def _info(name: str, family: str, declared: Rate | None, overrides: dict[str, Rate],
          held: int, last_ms: int, admissions: int) -> RateLimitInfo:
    set_rate = overrides.get(name) or overrides.get(family)
    rate = set_rate or declared
    return RateLimitInfo(name=name, family=family,
                         rate=rate.text if rate is not None else "",
                         burst=rate.burst if rate is not None else 1,
                         source="" if declared is None else declared.spec(),
                         overridden=set_rate is not None, held=held, last_ms=last_ms,
                         admissions=admissions)


@dataclass
class _MemoryLimit:
    tat_us: int = 0
    queue: list[str] = field(default_factory=list)
    head: str = ""
    since_us: int = 0
    admitted: dict[str, int] = field(default_factory=dict)
    last_ms: int = 0
    admissions: int = 0


class MemoryRates:
    """Rate limits of runs in memory, on their virtual clock: take_rate.lua's decisions."""

    def __init__(self, now_ms: Callable[[], int]) -> None:
        self.now_ms = now_ms
        self.limits: dict[str, _MemoryLimit] = {}
        self.names: dict[str, tuple[str, Rate]] = {}
        self.overrides: dict[str, Rate] = {}
        self._lock = threading.Lock()

    def take(self, name: str, token: str, rate: Rate) -> Taken:
        with self._lock:
            lim = self.limits.setdefault(name, _MemoryLimit())
            now_ms = self.now_ms()
            now_us = now_ms * 1000
            if token in lim.admitted:
                return Taken("admitted", lim.admitted[token], fresh=False)
            interval = rate.interval_us
            ready = lim.tat_us - (rate.burst - 1) * interval

            def front() -> str | None:
                first = lim.queue[0] if lim.queue else None
                if (first or "") != lim.head:
                    lim.head, lim.since_us = first or "", now_us
                return first

            first = front()
            while first is not None and first != token and \
                    now_us > max(ready, lim.since_us) + STALE_MS * 1000:
                lim.queue.pop(0)
                first = front()
            if (first is None or first == token) and now_us >= ready:
                if token in lim.queue:
                    lim.queue.remove(token)
                lim.admitted[token] = now_ms
                lim.tat_us = max(lim.tat_us, now_us) + interval
                lim.last_ms, lim.admissions = now_ms, lim.admissions + 1
                front()
                return Taken("admitted", now_ms)
            if token not in lim.queue:
                lim.queue.append(token)
                front()
            position = lim.queue.index(token)
            turn_us = max(ready, now_us) + position * interval
            return Taken("held", -(-turn_us // 1000), position, len(lim.queue))

    def note(self, name: str, family: str, declared: Rate) -> None:
        self.names[name] = (family, declared)

    def effective(self, name: str, family: str, declared: Rate) -> Rate:
        return _pick(self.overrides, name, family, declared)

    def list(self, catalog: dict[str, Rate]) -> list[RateLimitInfo]:
        known: dict[str, tuple[str, Rate | None]] = {n: (n, r) for n, r in catalog.items()}
        known.update(self.names)
        out = []
        for name in sorted(known):
            family, declared = known[name]
            lim = self.limits.get(name, _MemoryLimit())
            out.append(_info(name, family, declared, self.overrides, len(lim.queue),
                             lim.last_ms, lim.admissions))
        return out

    def set(self, name: str, rate: Rate, catalog: dict[str, Rate]) -> RateLimitInfo:
        self._check_known(name, catalog)
        self.overrides[name] = rate
        return next(i for i in self.list(catalog) if i.name == name or i.family == name)

    def reset(self, name: str, catalog: dict[str, Rate]) -> RateLimitInfo:
        self._check_known(name, catalog)
        self.overrides.pop(name, None)
        return next(i for i in self.list(catalog) if i.name == name or i.family == name)

    def _check_known(self, name: str, catalog: dict[str, Rate]) -> None:
        if name not in catalog and name not in self.names and name not in {
                f for f, _ in self.names.values()}:
            raise _unknown(name)


__all__ = ["KEEP_MS", "STALE_MS", "MemoryRates", "RateLimitInfo", "Rates", "RedisRates",
           "Taken", "UnknownRateLimitError", "catalog_rates", "format_interval"]
