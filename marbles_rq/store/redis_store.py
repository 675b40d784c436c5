"""The durable store: typed operations over Redis (this module) or memory (`memory.py`).

Writes go through `scripts.py` (one Lua script per atomic operation); reads are plain
commands, pipelined across buckets. Both backends implement `Store` and pass the same
contract suite (tests/test_store_contract.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol

import redis

from ..errors import (
    AgentIdTakenError,
    BucketMismatchError,
    ConfigError,
    CorruptRecordError,
    GrowInProgressError,
    MarblesError,
)
from ..errors import UnsupportedRecordVersionError as _Unsupported
from .connection import Client, connect, unavailable
from .ids import check_id, check_kind
from .keys import DEFAULT_BUCKETS, DEFAULT_PREFIX, MAX_LANES, Keyspace
from .records import (
    IR,
    AgentRecord,
    EffectReceipt,
    IdRecord,
    JournalEntry,
    R,
    Record,
    WorkspaceEntry,
    decode,
    encode,
    kind_of,
)
from .replies import as_text
from .scripts import MetaReply, Scripts

log = logging.getLogger("marbles_rq.store")


class _RequestIds:
    """Unique request ids without a random syscall per call: a random prefix per process
    (drawn again in a forked child) and a counter."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self.prefix = uuid.uuid4().hex[:16]
        self.counter = itertools.count()

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter):x}"


_request_ids = _RequestIds()


def new_request_id() -> str:
    return _request_ids.next()


@dataclass(frozen=True)
class ClaimResult(Generic[R]):
    won: bool
    record: R  # ours when won, else the one that was there first


@dataclass(frozen=True)
class Provision:
    created: bool
    agent: AgentRecord


@dataclass(frozen=True)
class CasOutcome:
    ok: bool
    current: str | None  # updated_at now stored (None = absent)


@dataclass(frozen=True)
class EffectOutcome:
    won: bool
    stale: bool = False  # refused: a newer epoch owns the scope
    receipt: EffectReceipt | None = None  # the first receipt when not won


@dataclass(frozen=True)
class Lease:
    """A held lease. `valid_until` is on this process's monotonic clock, measured from
    *before* the acquire was sent, so local time never overstates what we hold."""

    name: str
    token: str
    epoch: int
    ttl_ms: int
    valid_until: float


@dataclass(frozen=True)
class LeaseInfo:
    """A lease as a reader sees it."""

    epoch: int
    token: str
    ttl_ms: int
    since_ms: int | None  # server time the epoch began; None if not recorded


@dataclass(frozen=True)
class LeaseHolder:
    epoch: int
    token: str
    ttl_ms: int


class Store(Protocol):
    """The durable store on its own (README, "The store API"). The engine uses records,
    effects, leases and purge; agents (`provision`), workspace entries (`compare_and_set`)
    and journals (`append`) have no caller in the engine yet: they are the storage the
    seed's sessions and artifacts will be built on, kept working by the contract suite
    (tests/test_store_contract.py) until then."""

    keys: Keyspace

    def claim(self, record: IdRecord, *, owner: str = "") -> ClaimResult[Any]: ...
    def get(self, cls: type[R], record_id: str) -> R | None: ...
    def get_raw(self, cls: type[Record], record_id: str) -> bytes | None: ...
    def list_records(self, cls: type[R]) -> list[R]: ...
    def provision(self, agent: AgentRecord) -> Provision: ...
    def get_agent(self, agent_id: str) -> AgentRecord | None: ...
    def list_agents(self) -> list[AgentRecord]: ...
    def compare_and_set(self, entry: WorkspaceEntry, expected: str | None, *,
                        owner: str = "") -> CasOutcome: ...
    def get_entry(self, workspace_id: str, key: str) -> WorkspaceEntry | None: ...
    def list_entries(self, workspace_id: str) -> list[WorkspaceEntry]: ...
    def append(self, journal: str, entry: JournalEntry, *,
               owner: str = "") -> ClaimResult[JournalEntry]: ...
    def read_journal(self, journal: str) -> list[JournalEntry]: ...
    def claim_effect(self, receipt: EffectReceipt, *,
                     epoch: int | None = None) -> EffectOutcome: ...
    def purge(self, owner: str, *, batch_size: int = 100,
              max_batches: int | None = None) -> int: ...
    def acquire_lease(self, name: str, token: str, ttl_ms: int, *,
                      floor: int = 0) -> Lease | LeaseHolder: ...
    def renew_lease(self, lease: Lease) -> Lease | None: ...
    def release_lease(self, lease: Lease) -> bool: ...


def journal_kind(journal: str) -> str:
    return "journal." + check_kind(journal)


_KINDS: dict[type[Record], str] = {}


def _kind(cls: type[Record]) -> str:
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS[cls] = check_kind(kind_of(cls))
    return kind


def adopt_meta(keys: Keyspace, meta: MetaReply, adopt: frozenset[str]) -> Keyspace:
    """`keys` with the recorded values; a value not in `adopt` that contradicts the recorded
    one, or a bucket growth under way, is refused with one line."""
    if meta.grow_to:
        raise GrowInProgressError(
            f"the buckets of this deployment (prefix {keys.prefix!r}) are being grown from "
            f"{meta.buckets} to {meta.grow_to}: finish it with `marbles-rq buckets grow "
            f"--to {meta.grow_to}` before starting anything else")
    try:
        recorded = Keyspace(keys.prefix, int(meta.buckets), lanes=int(meta.lanes or "1"),
                            layout=int(meta.layout))
    except (ValueError, ConfigError) as exc:
        raise BucketMismatchError(
            f"the metadata of this deployment ({keys.meta}) is not understood by this "
            f"marbles-rq: {exc}") from None
    for name, flag in (("buckets", "--buckets or MARBLES_BUCKETS"),
                       ("lanes", "--lane-count or MARBLES_LANE_COUNT"), ("layout", "")):
        mine, theirs = getattr(keys, name), getattr(recorded, name)
        if name not in adopt and mine != theirs:
            how = f" ({flag}: leave it unset to adopt the recorded value)" if flag else ""
            grow = "; `marbles-rq buckets grow` changes the bucket count" \
                if name == "buckets" else ""
            raise BucketMismatchError(
                f"this deployment (prefix {keys.prefix!r}) was created with {recorded.buckets} "
                f"buckets, {recorded.lanes} lane{'s' if recorded.lanes != 1 else ''} and layout "
                f"{recorded.layout}; this process was configured with {name} {mine}{how}{grow}")
    return recorded if recorded != keys else keys


def _master_count(client: Client) -> int:
    primaries = getattr(client, "get_primaries", None)
    return len(primaries()) if primaries is not None else 1


class RedisStore:
    """`Store` on one Redis server or a Redis Cluster (same keys, same scripts)."""

    def __init__(self, client: Client, keys: Keyspace | None = None, *, url: str = "",
                 read_only: bool = False, adopt: Iterable[str] = ()) -> None:
        """`keys` gives the bucket count, lane count and layout to create a deployment with.
        Once a deployment recorded its own (in `{P}:meta`, at first use by a writer), the
        recorded values are what this store uses for the names in `adopt` ("buckets",
        "lanes", "layout": values nobody chose explicitly); a value not in `adopt` that
        differs from the recorded one is refused (BucketMismatchError), never silently
        re-bucketed: it would look for records in the wrong keys.

        `read_only`: only read the metadata, never record it, so a reading command writes
        nothing (a mistyped --buckets on a fresh prefix must not fix the deployment's count)
        and still works when Redis refuses writes (OOM)."""
        self.client = client
        self.keys = keys or Keyspace()
        self.url = url
        self.scripts = Scripts(client)
        adopted = frozenset(adopt)
        if "lanes" in adopted and self.keys.lanes == 1:
            # A new deployment on a Redis Cluster gets one lane per master.
            masters = _master_count(client)
            if masters > 1:
                self.keys = replace(self.keys, lanes=min(masters, self.keys.buckets, MAX_LANES))
        if read_only:
            recorded = self._read_meta()
        else:
            recorded = self.scripts.ensure_meta(
                meta_key=self.keys.meta, buckets=self.keys.buckets, layout=self.keys.layout,
                lanes=self.keys.lanes)
        if recorded is not None:
            self.keys = adopt_meta(self.keys, recorded, adopted)

    def _read_meta(self) -> MetaReply | None:
        """What ensure_meta would return, without its write; None when nothing is recorded."""
        raw = self.client.hmget(self.keys.meta, ["buckets", "layout", "lanes", "grow_to"])
        buckets, layout, lanes, grow_to = (as_text(v) if v is not None else "" for v in raw)
        if not buckets:
            return None
        return MetaReply(buckets, layout or "1", lanes, grow_to)

    # -- claims --------------------------------------------------------------------------

    def claim(self, record: IdRecord, *, owner: str = "") -> ClaimResult[Any]:
        return self._claim(type(record), record, _kind(type(record)), owner)

    def _claim(self, cls: type[IR], record: IR, kind: str, owner: str) -> ClaimResult[IR]:
        rid = check_id(record.id)
        if owner:
            check_id(owner, "owner")
        record_key, listing_key, owned_key = self.keys.claim_keys(kind, rid, owner)
        request_id = new_request_id()
        reply = self.scripts.claim_record(
            record_key=record_key, listing_key=listing_key, owned_key=owned_key,
            marker_key=self.keys.request_marker(rid, request_id), record_id=rid,
            doc=encode(record), request_id=request_id, owner=owner)
        if reply.won:
            return ClaimResult(True, record)
        assert reply.doc is not None
        return ClaimResult(False, decode(cls, reply.doc, record_key))

    def get_raw(self, cls: type[Record], record_id: str) -> bytes | None:
        key = self.keys.record(kind_of(cls), check_id(record_id))
        return self._read(lambda: self.client.hget(key, "doc"))  # type: ignore[no-any-return]

    def get(self, cls: type[R], record_id: str) -> R | None:
        raw = self.get_raw(cls, record_id)
        if raw is None:
            return None
        return decode(cls, raw, self.keys.record(kind_of(cls), record_id))

    def list_records(self, cls: type[R]) -> list[R]:
        kind = kind_of(cls)
        return self._list(cls, lambda b: self.keys.listing(kind, b),
                          lambda rid: self.keys.record(kind, rid))

    # -- journal ---------------------------------------------------------------------------

    def append(self, journal: str, entry: JournalEntry, *,
               owner: str = "") -> ClaimResult[JournalEntry]:
        return self._claim(JournalEntry, entry, journal_kind(journal), owner)

    def read_journal(self, journal: str) -> list[JournalEntry]:
        kind = journal_kind(journal)
        return self._list(JournalEntry, lambda b: self.keys.listing(kind, b),
                          lambda rid: self.keys.record(kind, rid))

    # -- agents ------------------------------------------------------------------------------

    def provision(self, agent: AgentRecord) -> Provision:
        check_id(agent.id, "agent id")
        check_id(agent.provisioning_key, "provisioning key")
        agent_id, request_id = agent.id, new_request_id()
        for _ in range(5):  # "moved" only repeats if the mapped agent keeps being purged
            reply = self.scripts.provision_agent(
                provisioning_key=self.keys.provisioning(agent.provisioning_key),
                agent_key=self.keys.agent(agent_id), listing_key=self.keys.agent_listing,
                agent_id=agent_id, doc=encode(agent), request_id=request_id,
                pkey=agent.provisioning_key)
            if reply.status == "taken":
                raise AgentIdTakenError(
                    f"agent id {agent.id!r} is taken by another provisioning key")
            if reply.status == "moved":
                assert reply.agent_id is not None
                agent_id = reply.agent_id
                continue
            assert reply.doc is not None
            stored = decode(AgentRecord, reply.doc, self.keys.agent(agent_id))
            return Provision(reply.status == "created", stored)
        raise MarblesError(f"provisioning key {agent.provisioning_key!r} keeps changing")

    def get_agent(self, agent_id: str) -> AgentRecord | None:
        key = self.keys.agent(check_id(agent_id, "agent id"))
        raw = self._read(lambda: self.client.hget(key, "doc"))
        return None if raw is None else decode(AgentRecord, raw, key)

    def list_agents(self) -> list[AgentRecord]:
        return self._list(AgentRecord, lambda b: self.keys.agent_listing, self.keys.agent,
                          buckets=[0])

    # -- workspace entries ---------------------------------------------------------------

    def compare_and_set(self, entry: WorkspaceEntry, expected: str | None, *,
                        owner: str = "") -> CasOutcome:
        ws, key = check_id(entry.workspace_id, "workspace id"), check_id(entry.key, "entry key")
        if owner:
            check_id(owner, "owner")
        if entry.updated_at == (expected or ""):
            raise MarblesError("the new updated_at must differ from the expected one")
        request_id = new_request_id()
        reply = self.scripts.cas_entry(
            entry_key=self.keys.entry(ws, key), listing_key=self.keys.entries(ws),
            owned_key=self.keys.owned(owner, self.keys.bucket_of(ws)),
            marker_key=self.keys.request_marker(ws, request_id),
            expected=expected or "", updated_at=entry.updated_at, doc=encode(entry),
            request_id=request_id, owner=owner, key=key)
        return CasOutcome(reply.ok, reply.current)

    def get_entry(self, workspace_id: str, key: str) -> WorkspaceEntry | None:
        rkey = self.keys.entry(check_id(workspace_id, "workspace id"), check_id(key, "entry key"))
        raw = self._read(lambda: self.client.hget(rkey, "doc"))
        return None if raw is None else decode(WorkspaceEntry, raw, rkey)

    def list_entries(self, workspace_id: str) -> list[WorkspaceEntry]:
        ws = check_id(workspace_id, "workspace id")
        return self._list(WorkspaceEntry, lambda b: self.keys.entries(ws),
                          lambda k: self.keys.entry(ws, k), buckets=[0])

    # -- effects ---------------------------------------------------------------------------

    def claim_effect(self, receipt: EffectReceipt, *, epoch: int | None = None) -> EffectOutcome:
        scope = check_id(receipt.scope, "effect scope")
        if not receipt.key or len(receipt.key) > 512:
            raise MarblesError("an effect key must be 1..512 characters")
        key = self.keys.effect(scope, receipt.key)
        reply = self.scripts.claim_effect(
            receipt_key=key, fence_key=self.keys.scope_fence(scope),
            index_key=self.keys.effect_index(scope), doc=encode(receipt),
            request_id=new_request_id(), epoch=epoch)
        if reply.status == "ok":
            return EffectOutcome(True)
        if reply.status == "stale_epoch":
            return EffectOutcome(False, stale=True)
        assert reply.doc is not None
        return EffectOutcome(False, receipt=decode(EffectReceipt, reply.doc, key))

    # -- purge -------------------------------------------------------------------------------

    def purge(self, owner: str, *, batch_size: int = 100, max_batches: int | None = None) -> int:
        """Delete everything `owner` owns, then the agent `owner` itself. Each batch is atomic
        in its bucket; the whole is idempotent, so an interrupted purge is finished by
        running it again. Returns how many owned records this call removed."""
        check_id(owner, "owner")
        removed = batches = 0
        pending = list(range(self.keys.buckets))
        while pending:
            owned = [self.keys.owned(owner, b) for b in pending]
            found = self._smembers(owned)
            pending_next = []
            for bucket, key, members in zip(pending, owned, found, strict=True):
                batch = sorted(as_text(m) for m in members)[:batch_size]
                if not batch:
                    continue
                if max_batches is not None and batches >= max_batches:
                    return removed
                parsed = [(m, *_record_and_listing(m)) for m in batch]
                n, remaining = self.scripts.purge_owned(owned_key=key, members=parsed)
                removed += n
                batches += 1
                if remaining:
                    pending_next.append(bucket)
            pending = pending_next
        if max_batches is not None and batches >= max_batches:
            return removed
        self._purge_agent(owner)
        return removed

    def _purge_agent(self, agent_id: str) -> None:
        agent_key = self.keys.agent(agent_id)
        for _ in range(5):
            pkey = self._read(lambda: self.client.hget(agent_key, "pkey"))
            prov = self.keys.provisioning(as_text(pkey)) if pkey else self.keys.provisioning("-")
            status = self.scripts.purge_agent(
                provisioning_key=prov, agent_key=agent_key,
                listing_key=self.keys.agent_listing, agent_id=agent_id)
            if status != "moved":
                return

    # -- leases ------------------------------------------------------------------------------

    def acquire_lease(self, name: str, token: str, ttl_ms: int, *,
                      floor: int = 0) -> Lease | LeaseHolder:
        """Take lease `name` (or learn its holder). `floor`: a fresh epoch is above it (see
        lua/acquire_lease.lua)."""
        check_id(name, "lease name")
        if ttl_ms <= 0:
            raise MarblesError("a lease needs ttl_ms > 0")
        started = time.monotonic()
        reply = self.scripts.acquire_lease(lease_key=self.keys.lease(name),
                                           epoch_key=self.keys.lease_epoch(name),
                                           since_key=self.keys.lease_since(name),
                                           token=token, ttl_ms=ttl_ms, floor=floor)
        if not reply.held:
            return LeaseHolder(reply.epoch, reply.holder or "", reply.ttl_ms)
        return Lease(name, token, reply.epoch, ttl_ms, started + ttl_ms / 1000)

    def renew_lease(self, lease: Lease) -> Lease | None:
        started = time.monotonic()
        if not self.scripts.renew_lease(lease_key=self.keys.lease(lease.name), epoch=lease.epoch,
                                        token=lease.token, ttl_ms=lease.ttl_ms):
            return None
        return Lease(lease.name, lease.token, lease.epoch, lease.ttl_ms,
                     started + lease.ttl_ms / 1000)

    def lease_holder(self, name: str) -> LeaseInfo | None:
        """Who holds lease `name` now, read without writing; None when nobody does."""
        keys = (self.keys.lease(name), self.keys.lease_since(name))
        value, pttl, since = self._pipeline_read(
            lambda p: [p.get(keys[0]), p.pttl(keys[0]), p.get(keys[1])])
        if value is None:
            return None
        epoch, _, token = as_text(value).partition("|")
        since_epoch, _, since_ms = as_text(since or b"").partition("|")
        return LeaseInfo(int(epoch), token, max(int(pttl), 0),
                         int(since_ms) if since_epoch == epoch and since_ms else None)

    def release_lease(self, lease: Lease) -> bool:
        released: bool = self.scripts.release_lease(lease_key=self.keys.lease(lease.name),
                                          epoch=lease.epoch, token=lease.token)
        return released

    # -- reading helpers -------------------------------------------------------------------

    def _read(self, fn: Any) -> Any:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise unavailable(self.url or "redis", exc) from None

    def _smembers(self, keys: list[str]) -> list[set[bytes]]:
        return self._pipeline_read(lambda p: [p.smembers(k) for k in keys])

    def _pipeline_read(self, build: Any) -> list[Any]:
        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            build(pipe)
            return list(pipe.execute())
        return self._read(run)  # type: ignore[no-any-return]

    def _list(self, cls: type[R], listing_key: Any, record_key: Any,
              buckets: Iterable[int] | None = None) -> list[R]:
        bucket_list = list(range(self.keys.buckets)) if buckets is None else list(buckets)
        listings = [listing_key(b) for b in bucket_list]
        ranked = self._pipeline_read(
            lambda p: [p.zrange(k, 0, -1, withscores=True) for k in listings])
        ids = sorted(((score, as_text(member)) for rows in ranked for member, score in rows))
        keys = [record_key(rid) for _, rid in ids]
        docs = self._pipeline_read(lambda p: [p.hget(k, "doc") for k in keys])
        records: list[R] = []
        for key, doc in zip(keys, docs, strict=True):
            if doc is None:
                continue  # deleted between the two reads
            try:
                records.append(decode(cls, doc, key))
            except (CorruptRecordError, _Unsupported) as exc:
                log.warning("skipping unreadable record: %s", exc)
        return records


def _record_and_listing(member: str) -> tuple[str, str]:
    record_key, listing_key, _ = member.split("|", 2)
    return record_key, listing_key


def open_store(url: str | None = None, *, prefix: str = DEFAULT_PREFIX,
               buckets: int | None = None, lanes: int | None = None,
               read_only: bool = False) -> RedisStore:
    """Connect, adopt the deployment's recorded layout, and return the store. One clear
    error otherwise. `buckets` and `lanes`: None adopts what the deployment recorded (at
    creation: 1,024 buckets; one lane, or one per master on a Redis Cluster); a number must
    match the recorded value. `read_only`: for reading commands; records nothing."""
    from ..payloads.crypto import check_config

    # A malformed MARBLES_KEYS stops every process at its start (one line), not at the
    # first payload it seals: a worker would otherwise take runs it cannot record.
    check_config()
    adopt = {"layout"} | {n for n, v in (("buckets", buckets), ("lanes", lanes)) if v is None}
    client = connect(url)
    try:
        keys = Keyspace(prefix, DEFAULT_BUCKETS if buckets is None else buckets,
                        lanes=1 if lanes is None else lanes)
        return RedisStore(client, keys, url=url or "", read_only=read_only, adopt=adopt)
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError) as exc:
        raise unavailable(url or "", exc) from None
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise unavailable(url or "", exc) from None
        raise
