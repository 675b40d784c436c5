"""`Store` in process memory: the same contract as RedisStore, for --dry-run and for unit
tests of the layers above. Nothing survives the process; one lock makes every operation
atomic, standing in for Redis running one script at a time."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import AgentIdTakenError, CorruptRecordError, MarblesError
from ..errors import UnsupportedRecordVersionError as _Unsupported
from .ids import check_id, check_kind
from .keys import Keyspace
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
from .redis_store import (
    CasOutcome,
    ClaimResult,
    EffectOutcome,
    Lease,
    LeaseHolder,
    Provision,
    journal_kind,
)

log = logging.getLogger("marbles_rq.store.memory")


@dataclass
class _Doc:
    doc: bytes
    owner: str = ""
    at_ms: int = 0
    updated_at: str = ""
    listing: str = ""  # the listing it appears in, and as which member (for purge)
    member: str = ""


@dataclass
class _Lease:
    epoch: int
    token: str
    expires: float


@dataclass
class MemoryStore:
    keys: Keyspace = field(default_factory=Keyspace)
    docs: dict[str, _Doc] = field(default_factory=dict)  # by the Redis key it mirrors
    listings: dict[str, dict[str, int]] = field(default_factory=dict)
    provisioning: dict[str, str] = field(default_factory=dict)
    leases: dict[str, _Lease] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)
    fences: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _clock_ms: int = 0

    def _now_ms(self) -> int:
        # Strictly increasing, so listings keep insertion order like Redis's TIME mostly does.
        self._clock_ms = max(self._clock_ms + 1, int(time.time() * 1000))
        return self._clock_ms

    def _insert(self, key: str, listing: str, member: str, doc: bytes, owner: str) -> _Doc | None:
        existing = self.docs.get(key)
        if existing is not None:
            return existing
        at = self._now_ms()
        self.docs[key] = _Doc(doc, owner, at, listing=listing, member=member)
        self.listings.setdefault(listing, {})[member] = at
        return None

    def _list(self, cls: type[R], listing_keys: list[str], record_key: Any) -> list[R]:
        with self._lock:
            rows = sorted((at, m) for lk in listing_keys
                          for m, at in self.listings.get(lk, {}).items())
            docs = [(record_key(m), self.docs.get(record_key(m))) for _, m in rows]
        out = []
        for key, doc in docs:
            if doc is None:
                continue
            try:
                out.append(decode(cls, doc.doc, key))
            except (CorruptRecordError, _Unsupported) as exc:
                log.warning("skipping unreadable record: %s", exc)
        return out

    # -- claims ------------------------------------------------------------------------------

    def claim(self, record: IdRecord, *, owner: str = "") -> ClaimResult[Any]:
        kind = check_kind(kind_of(type(record)))
        return self._claim(type(record), record, kind, owner)

    def _claim(self, cls: type[IR], record: IR, kind: str, owner: str) -> ClaimResult[IR]:
        rid = check_id(record.id)
        if owner:
            check_id(owner, "owner")
        key = self.keys.record(kind, rid)
        with self._lock:
            existing = self._insert(key, self.keys.listing(kind, self.keys.bucket_of(rid)), rid,
                                    encode(record), owner)
        if existing is None:
            return ClaimResult(True, record)
        return ClaimResult(False, decode(cls, existing.doc, key))

    def get_raw(self, cls: type[Record], record_id: str) -> bytes | None:
        doc = self.docs.get(self.keys.record(kind_of(cls), check_id(record_id)))
        return None if doc is None else doc.doc

    def get(self, cls: type[R], record_id: str) -> R | None:
        raw = self.get_raw(cls, record_id)
        return None if raw is None else decode(cls, raw, self.keys.record(kind_of(cls), record_id))

    def list_records(self, cls: type[R]) -> list[R]:
        kind = kind_of(cls)
        return self._list(cls, [self.keys.listing(kind, b) for b in range(self.keys.buckets)],
                          lambda rid: self.keys.record(kind, rid))

    def append(self, journal: str, entry: JournalEntry, *,
               owner: str = "") -> ClaimResult[JournalEntry]:
        return self._claim(JournalEntry, entry, journal_kind(journal), owner)

    def read_journal(self, journal: str) -> list[JournalEntry]:
        kind = journal_kind(journal)
        return self._list(JournalEntry,
                          [self.keys.listing(kind, b) for b in range(self.keys.buckets)],
                          lambda rid: self.keys.record(kind, rid))

    # -- agents ------------------------------------------------------------------------------

    def provision(self, agent: AgentRecord) -> Provision:
        check_id(agent.id, "agent id")
        check_id(agent.provisioning_key, "provisioning key")
        with self._lock:
            mapped = self.provisioning.get(agent.provisioning_key)
            if mapped is not None:
                key = self.keys.agent(mapped)
                return Provision(False, decode(AgentRecord, self.docs[key].doc, key))
            key = self.keys.agent(agent.id)
            if key in self.docs:
                raise AgentIdTakenError(
                    f"agent id {agent.id!r} is taken by another provisioning key")
            self.provisioning[agent.provisioning_key] = agent.id
            self._insert(key, self.keys.agent_listing, agent.id, encode(agent), "")
        return Provision(True, agent)

    def get_agent(self, agent_id: str) -> AgentRecord | None:
        key = self.keys.agent(check_id(agent_id, "agent id"))
        doc = self.docs.get(key)
        return None if doc is None else decode(AgentRecord, doc.doc, key)

    def list_agents(self) -> list[AgentRecord]:
        return self._list(AgentRecord, [self.keys.agent_listing], self.keys.agent)

    # -- workspace entries ---------------------------------------------------------------

    def compare_and_set(self, entry: WorkspaceEntry, expected: str | None, *,
                        owner: str = "") -> CasOutcome:
        ws, k = check_id(entry.workspace_id, "workspace id"), check_id(entry.key, "entry key")
        if owner:
            check_id(owner, "owner")
        if entry.updated_at == (expected or ""):
            raise MarblesError("the new updated_at must differ from the expected one")
        key = self.keys.entry(ws, k)
        with self._lock:
            cur = self.docs.get(key)
            current = cur.updated_at if cur else None
            if current != (expected or None):
                return CasOutcome(False, current)
            if cur is None:
                self._insert(key, self.keys.entries(ws), k, encode(entry), owner)
                self.docs[key].updated_at = entry.updated_at
            else:
                cur.doc, cur.updated_at = encode(entry), entry.updated_at
        return CasOutcome(True, entry.updated_at)

    def get_entry(self, workspace_id: str, key: str) -> WorkspaceEntry | None:
        rkey = self.keys.entry(check_id(workspace_id, "workspace id"), check_id(key, "entry key"))
        doc = self.docs.get(rkey)
        return None if doc is None else decode(WorkspaceEntry, doc.doc, rkey)

    def list_entries(self, workspace_id: str) -> list[WorkspaceEntry]:
        ws = check_id(workspace_id, "workspace id")
        return self._list(WorkspaceEntry, [self.keys.entries(ws)],
                          lambda k: self.keys.entry(ws, k))

    # -- effects ---------------------------------------------------------------------------

    def claim_effect(self, receipt: EffectReceipt, *, epoch: int | None = None) -> EffectOutcome:
        scope = check_id(receipt.scope, "effect scope")
        if not receipt.key or len(receipt.key) > 512:
            raise MarblesError("an effect key must be 1..512 characters")
        key = self.keys.effect(scope, receipt.key)
        with self._lock:
            if epoch is not None and self.fences.get(scope, 0) > epoch:
                return EffectOutcome(False, stale=True)
            existing = self.docs.get(key)
            if existing is None:
                self.docs[key] = _Doc(encode(receipt), at_ms=self._now_ms())
                return EffectOutcome(True)
        return EffectOutcome(False, receipt=decode(EffectReceipt, existing.doc, key))

    # -- purge -------------------------------------------------------------------------------

    def purge(self, owner: str, *, batch_size: int = 100, max_batches: int | None = None) -> int:
        check_id(owner, "owner")
        removed = batches = 0
        while True:
            with self._lock:
                mine = sorted(k for k, d in self.docs.items() if d.owner == owner)[:batch_size]
                if not mine:
                    break
                if max_batches is not None and batches >= max_batches:
                    return removed
                for key in mine:
                    doc = self.docs.pop(key)
                    self.listings.get(doc.listing, {}).pop(doc.member, None)
                removed += len(mine)
                batches += 1
        if max_batches is not None and batches >= max_batches:
            return removed
        with self._lock:
            agent = self.docs.pop(self.keys.agent(owner), None)
            self.listings.get(self.keys.agent_listing, {}).pop(owner, None)
            if agent is not None:
                pkey = decode(AgentRecord, agent.doc, self.keys.agent(owner)).provisioning_key
                if self.provisioning.get(pkey) == owner:
                    del self.provisioning[pkey]
        return removed

    # -- leases ------------------------------------------------------------------------------

    def acquire_lease(self, name: str, token: str, ttl_ms: int, *,
                      floor: int = 0) -> Lease | LeaseHolder:
        check_id(name, "lease name")
        if ttl_ms <= 0:
            raise MarblesError("a lease needs ttl_ms > 0")
        now = time.monotonic()
        with self._lock:
            cur = self.leases.get(name)
            if cur is not None and cur.expires > now and cur.token != token:
                return LeaseHolder(cur.epoch, cur.token, int((cur.expires - now) * 1000))
            if cur is None or cur.expires <= now:
                self.epochs[name] = max(self.epochs.get(name, 0), floor) + 1
                cur = _Lease(self.epochs[name], token, 0.0)
                self.leases[name] = cur
            cur.expires = now + ttl_ms / 1000
            return Lease(name, token, cur.epoch, ttl_ms, cur.expires)

    def renew_lease(self, lease: Lease) -> Lease | None:
        now = time.monotonic()
        with self._lock:
            cur = self.leases.get(lease.name)
            if cur is None or not _holds(cur, lease, now):
                return None
            cur.expires = now + lease.ttl_ms / 1000
            return Lease(lease.name, lease.token, lease.epoch, lease.ttl_ms, cur.expires)

    def release_lease(self, lease: Lease) -> bool:
        with self._lock:
            cur = self.leases.get(lease.name)
            if cur is None or not _holds(cur, lease, time.monotonic()):
                return False
            del self.leases[lease.name]
            return True


def _holds(cur: _Lease, lease: Lease, now: float) -> bool:
    return cur.expires > now and (cur.epoch, cur.token) == (
        lease.epoch, lease.token)
