"""The store contract: one suite, run against a durable Redis server, a 3-master Redis
Cluster and the in-memory store.

Concurrency tests run their workers as separate OS processes against Redis (each opens its
own store from the URL) and as threads against MemoryStore, whose state lives in one
process and cannot be shared with others. Workers live in tests/store_workers.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from marbles_rq.errors import AgentIdTakenError, CorruptRecordError
from marbles_rq.store import Lease, LeaseHolder, Store, journal_kind, open_store
from marbles_rq.store.memory import MemoryStore
from marbles_rq.store.records import (
    AgentRecord,
    EffectReceipt,
    EventRecord,
    JournalEntry,
    WorkspaceEntry,
    encode,
)
from tests import store_workers
from tests.redis_procs import RedisServer

BACKENDS = ["redis", "cluster", "memory"]
N_WORKERS = 8


def raw(obj: Any) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(obj))


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 20.0,
             interval: float = 0.005) -> Any:
    """Poll `cond` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# -- backends ------------------------------------------------------------------------------


@dataclass
class Backend:
    name: str
    url: str = ""  # redis / cluster
    memory: MemoryStore | None = None  # memory
    raw_client: Any = None  # a plain redis-py client, to read and tamper with keys directly

    def store(self) -> Store:
        """A store: a new connection for Redis, the one shared instance for memory."""
        if self.memory is not None:
            return self.memory
        return open_store(self.url)

    def run(self, job: str, args: list[tuple[Any, ...]]) -> list[Any]:
        """Run len(args) workers concurrently: OS processes for Redis, each with its own
        connection; threads for memory (its state cannot be shared across processes)."""
        if self.memory is not None:
            return store_workers.run_threads(self.memory, job, args)
        return store_workers.run_processes(self.url, job, args)

    def raw_doc(self, key: str) -> bytes | None:
        """The stored document at `key`, bypassing the store."""
        if self.memory is not None:
            doc = self.memory.docs.get(key)
            return None if doc is None else doc.doc
        value: bytes | None = self.raw_client.hget(key, "doc")
        return value

    def corrupt(self, key: str, garbage: bytes) -> None:
        if self.memory is not None:
            self.memory.docs[key].doc = garbage
        else:
            assert self.raw_client.exists(key) == 1
            self.raw_client.hset(key, "doc", garbage)

    def set_fence(self, store: Store, scope: str, epoch: int) -> None:
        if self.memory is not None:
            self.memory.fences[scope] = epoch
        else:
            self.raw_client.hset(store.keys.scope_fence(scope), "epoch", epoch)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "memory":
        yield Backend("memory", memory=MemoryStore())
        return
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        client: Any = redis.Redis.from_url(url)
    else:
        url = request.getfixturevalue("cluster_url")
        client = redis.RedisCluster.from_url(url.replace("redis+cluster://", "redis://", 1))
    try:
        yield Backend(request.param, url=url, raw_client=client)
    finally:
        client.close()


# -- 1. concurrent claims ------------------------------------------------------------------


def test_concurrent_claims_have_exactly_one_winner_per_id(backend: Backend) -> None:
    n_ids = 1000
    results = backend.run("claim_all", [(n_ids,)] * N_WORKERS)

    winners: dict[str, str] = {}
    for i in range(n_ids):
        won_by = [w for w in range(N_WORKERS) if results[w][i][0]]
        assert len(won_by) == 1, f"ev-{i} was won by workers {won_by}"
        source = f"p{won_by[0]}"
        seen = {results[w][i][1] for w in range(N_WORKERS)}
        assert seen == {source}, f"ev-{i}: winner {source}, claims returned {seen}"
        winners[f"ev-{i}"] = source

    listed = backend.store().list_records(EventRecord)
    assert len(listed) == n_ids
    assert {r.id: r.source for r in listed} == winners
    # The workers really raced: the ids were not all taken by one of them.
    assert len(set(winners.values())) > 1


# -- 2. provisioning -----------------------------------------------------------------------


def test_provisioning_race_creates_one_agent(backend: Backend) -> None:
    results = backend.run("provision", [("pk-race",)] * N_WORKERS)

    created = [r for r in results if r[0]]
    assert len(created) == 1, results
    _, winner_id, winner_doc = created[0]
    assert {(agent_id, doc) for _, agent_id, doc in results} == {(winner_id, winner_doc)}

    store = backend.store()
    assert [a.id for a in store.list_agents()] == [winner_id]
    for w in range(N_WORKERS):  # the losers' proposed ids were not created
        if f"agent-p{w}" != winner_id:
            assert store.get_agent(f"agent-p{w}") is None

    again = store.provision(AgentRecord(version=1, id="agent-late", definition_id="def",
                                        provisioning_key="pk-race"))
    assert not again.created
    assert msgspec.json.encode(again.agent) == winner_doc
    assert store.get_agent("agent-late") is None

    with pytest.raises(AgentIdTakenError):
        store.provision(AgentRecord(version=1, id=winner_id, definition_id="def",
                                    provisioning_key="pk-other"))
    other = store.provision(AgentRecord(version=1, id="agent-other", definition_id="def",
                                        provisioning_key="pk-other"))
    assert other.created and other.agent.id == "agent-other"
    assert sorted(a.id for a in store.list_agents()) == sorted([winner_id, "agent-other"])


# -- 3. compare-and-set ----------------------------------------------------------------------


def test_compare_and_set_race_has_one_winner(backend: Backend) -> None:
    store = backend.store()
    expected: str | None = None
    for round_ in (1, 2):  # absent first, then a given updated_at
        results = backend.run("cas", [("ws-race", "k", expected, round_)] * N_WORKERS)
        oks = [r for r in results if r[0]]
        assert len(oks) == 1, results
        winner = oks[0][2]
        assert oks[0][1] == winner
        for ok, current, _ in results:
            if not ok:
                assert current == winner
        entry = store.get_entry("ws-race", "k")
        assert entry is not None and entry.updated_at == winner
        assert msgspec.json.decode(entry.value) == {
            "by": int(winner.split("-p")[1]), "round": round_}
        assert [e.updated_at for e in store.list_entries("ws-race")] == [winner]
        expected = winner

    # A stale expectation is refused and reports what is stored.
    stale = store.compare_and_set(
        WorkspaceEntry(version=1, workspace_id="ws-race", key="k", updated_at="late"), "u1-p0")
    assert stale.ok is False and stale.current == expected
    absent = store.compare_and_set(
        WorkspaceEntry(version=1, workspace_id="ws-race", key="other", updated_at="v1"), "v0")
    assert absent.ok is False and absent.current is None
    assert store.get_entry("ws-race", "other") is None


# -- 4. purge -----------------------------------------------------------------------------


@dataclass
class Owned:
    """Everything one owner wrote, and where it lives."""

    owner: str
    events: list[str] = field(default_factory=list)
    journals: dict[str, list[str]] = field(default_factory=dict)
    entries: dict[str, list[str]] = field(default_factory=dict)  # workspace -> keys
    docs: dict[str, bytes] = field(default_factory=dict)  # record key -> doc written

    @property
    def total(self) -> int:
        return (len(self.events) + sum(map(len, self.journals.values()))
                + sum(map(len, self.entries.values())))


def populate(store: Store, owner: str, tag: str) -> Owned:
    """~300 records owned by `owner` over many buckets: claims, journal entries (in a journal
    of its own with ids that other owners use too, and in a shared journal) and workspace
    entries (in workspaces of its own with shared keys, and in shared workspaces)."""
    out = Owned(owner)
    store.provision(AgentRecord(version=1, id=owner, definition_id="def",
                                provisioning_key=f"pk-{owner}"))
    for i in range(150):
        rec = EventRecord(version=1, id=f"ev-{tag}-{i}", source=owner, payload=raw([tag, i]))
        assert store.claim(rec, owner=owner).won
        out.events.append(rec.id)
        out.docs[store.keys.record("event", rec.id)] = encode(rec)
    for journal, ids in ((f"j{tag}", [f"e-{i}" for i in range(50)]),
                         ("jshared", [f"{tag}-{i}" for i in range(30)])):
        for rid in ids:
            entry = JournalEntry(version=1, id=rid, type=owner, payload=raw({"i": rid}))
            assert store.append(journal, entry, owner=owner).won
            out.journals.setdefault(journal, []).append(rid)
            out.docs[store.keys.record(journal_kind(journal), rid)] = encode(entry)
    for ws, key in [(f"ws-{tag}-{j}", f"k{i}") for j in range(25) for i in range(2)] + [
            (f"ws-shared-{j}", f"{tag}{i}") for j in range(10) for i in range(2)]:
        entry = WorkspaceEntry(version=1, workspace_id=ws, key=key, updated_at="1",
                               value=raw(owner))
        assert store.compare_and_set(entry, None, owner=owner).ok
        out.entries.setdefault(ws, []).append(key)
        out.docs[store.keys.entry(ws, key)] = encode(entry)
    assert out.total >= 300
    return out


def present(backend: Backend, store: Store, owned: Owned) -> dict[str, tuple[bool, bool]]:
    """Per record key: (readable, listed). Journal entries have no get-by-id: read raw."""
    out: dict[str, tuple[bool, bool]] = {}
    listed_events = {r.id for r in store.list_records(EventRecord)}
    for rid in owned.events:
        out[store.keys.record("event", rid)] = (
            store.get(EventRecord, rid) is not None, rid in listed_events)
    for journal, ids in owned.journals.items():
        listed = {e.id for e in store.read_journal(journal)}
        for rid in ids:
            key = store.keys.record(journal_kind(journal), rid)
            out[key] = (backend.raw_doc(key) is not None, rid in listed)
    for ws, keys in owned.entries.items():
        listed = {e.key for e in store.list_entries(ws)}
        for k in keys:
            out[store.keys.entry(ws, k)] = (store.get_entry(ws, k) is not None, k in listed)
    return out


def count_present(backend: Backend, store: Store, owned: Owned) -> int:
    """How many of `owned` remain; each is either readable and listed, or neither."""
    state = present(backend, store, owned)
    for key, (readable, listed) in state.items():
        assert readable == listed, f"{key}: readable={readable} listed={listed}"
    return sum(readable for readable, _ in state.values())


def assert_gone(backend: Backend, store: Store, owned: Owned) -> None:
    assert count_present(backend, store, owned) == 0
    for key in owned.docs:
        assert backend.raw_doc(key) is None, key
    for rid in owned.events:
        assert store.get_raw(EventRecord, rid) is None
    assert store.get_agent(owned.owner) is None
    assert owned.owner not in {a.id for a in store.list_agents()}
    # the provisioning key is free again
    again = store.provision(AgentRecord(version=1, id=f"{owned.owner}-2", definition_id="def",
                                        provisioning_key=f"pk-{owned.owner}"))
    assert again.created and again.agent.id == f"{owned.owner}-2"


def assert_intact(backend: Backend, store: Store, owned: Owned) -> None:
    assert count_present(backend, store, owned) == owned.total
    for key, doc in owned.docs.items():
        assert backend.raw_doc(key) == doc, key
    for rid in owned.events:
        assert store.get_raw(EventRecord, rid) == owned.docs[store.keys.record("event", rid)]
    agent = store.get_agent(owned.owner)
    assert agent is not None and agent.provisioning_key == f"pk-{owned.owner}"


@pytest.fixture
def two_owners(backend: Backend) -> tuple[Store, Owned, Owned, list[str]]:
    store = backend.store()
    a = populate(store, "agent-a", "a")
    b = populate(store, "agent-b", "b")
    unowned = [f"ev-u-{i}" for i in range(20)]
    for rid in unowned:
        assert store.claim(EventRecord(version=1, id=rid, source="nobody")).won
    assert count_present(backend, store, a) == a.total
    return store, a, b, unowned


def check_purged(backend: Backend, store: Store, a: Owned, b: Owned,
                 unowned: list[str]) -> None:
    assert_gone(backend, store, a)
    assert_intact(backend, store, b)
    listed = {r.id for r in store.list_records(EventRecord)}
    assert listed == set(b.events) | set(unowned)
    assert {e.id for e in store.read_journal("jshared")} == set(b.journals["jshared"])


def test_purge_removes_only_the_owners_records(
        backend: Backend, two_owners: tuple[Store, Owned, Owned, list[str]]) -> None:
    store, a, b, unowned = two_owners
    assert store.purge("agent-a") == a.total
    check_purged(backend, store, a, b, unowned)
    assert store.purge("agent-a") == 0  # idempotent


def test_interrupted_purge_is_finished_by_the_next(
        backend: Backend, two_owners: tuple[Store, Owned, Owned, list[str]]) -> None:
    store, a, b, unowned = two_owners
    removed = store.purge("agent-a", batch_size=10, max_batches=3)
    assert 0 < removed <= 30
    assert count_present(backend, store, a) == a.total - removed
    assert store.get_agent("agent-a") is not None  # the agent goes last
    assert_intact(backend, store, b)

    assert store.purge("agent-a") == a.total - removed
    check_purged(backend, store, a, b, unowned)


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
def test_purge_killed_midway_is_finished_by_the_next(
        backend: Backend, two_owners: tuple[Store, Owned, Owned, list[str]]) -> None:
    store, a, b, unowned = two_owners
    keys = store.keys

    def owned_left() -> int:
        pipe = backend.raw_client.pipeline(transaction=False)
        for bucket in range(keys.buckets):
            pipe.scard(keys.owned("agent-a", bucket))
        return sum(pipe.execute())

    assert owned_left() == a.total
    proc = store_workers.start_process(store_workers.slow_purge, backend.url, "agent-a", 3, 0.01)
    try:
        wait_for(lambda: owned_left() < a.total or not proc.is_alive(), "the purge to start")
        os.kill(proc.pid, 9)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == -9, "the purge finished before it could be killed"

    left = owned_left()
    assert 0 < left < a.total
    assert count_present(backend, store, a) == left  # each batch went whole or not at all
    assert store.get_agent("agent-a") is not None
    assert_intact(backend, store, b)

    assert store.purge("agent-a") == left
    check_purged(backend, store, a, b, unowned)


# -- 5. read your writes ------------------------------------------------------------------


def test_listings_show_every_acknowledged_write(backend: Backend) -> None:
    writer, reader = backend.store(), backend.store()
    for i in range(50):
        rec = EventRecord(version=1, id=f"ryw-{i}", source="w", payload=raw(i))
        assert writer.claim(rec).won
        assert rec in reader.list_records(EventRecord)

        entry = JournalEntry(version=1, id=f"j-{i}", type="t", payload=raw(i))
        assert writer.append("jryw", entry).won
        assert entry in reader.read_journal("jryw")

        ws = WorkspaceEntry(version=1, workspace_id="ws-ryw", key=f"k{i}", updated_at="1",
                            value=raw(i))
        assert writer.compare_and_set(ws, None).ok
        assert ws in reader.list_entries("ws-ryw")
        ws2 = WorkspaceEntry(version=1, workspace_id="ws-ryw", key=f"k{i}", updated_at="2",
                             value=raw(-i))
        assert writer.compare_and_set(ws2, "1").ok
        assert reader.get_entry("ws-ryw", f"k{i}") == ws2
        listed = reader.list_entries("ws-ryw")
        assert ws2 in listed and ws not in listed

        agent = AgentRecord(version=1, id=f"ag-{i}", definition_id="d",
                            provisioning_key=f"pk-{i}")
        assert writer.provision(agent).created
        assert agent in reader.list_agents()
    assert len(reader.list_records(EventRecord)) == 50
    assert sorted(e.id for e in reader.read_journal("jryw")) == sorted(
        f"j-{i}" for i in range(50))
    assert len(reader.list_entries("ws-ryw")) == 50
    assert len(reader.list_agents()) == 50


# -- 6. durability (redis only) ------------------------------------------------------------


def read_acks(path: Path) -> list[list[str]]:
    text = path.read_text()
    lines = text.split("\n")[:-1]  # a line cut by the SIGKILL has no newline: not an ack
    return [line.split(" ") for line in lines]


def test_acknowledged_writes_survive_kill9(redis_server: RedisServer, tmp_path: Path) -> None:
    store = open_store(redis_server.url)
    claims: dict[str, bytes] = {}
    entries: dict[str, WorkspaceEntry] = {}
    journal: dict[str, bytes] = {}
    for i in range(200):
        rec = EventRecord(version=1, id=f"d-{i}", source="main", payload=raw({"i": i}))
        assert store.claim(rec, owner="owner-d").won
        claims[rec.id] = encode(rec)
        key = f"k{i % 20}"
        cur = entries.get(key)
        new = WorkspaceEntry(version=1, workspace_id="ws-d", key=key,
                             updated_at=f"{i:04d}", value=raw(i))
        assert store.compare_and_set(new, None if cur is None else cur.updated_at).ok
        entries[key] = new
        je = JournalEntry(version=1, id=f"je-{i}", type="t", payload=raw([i]))
        assert store.append("jd", je, owner="owner-d").won
        journal[je.id] = encode(je)

    # A writer in another process keeps writing while Redis is SIGKILLed.
    ack_path = tmp_path / "acks.txt"
    ack_path.touch()
    proc = store_workers.start_process(store_workers.continuous_writer, redis_server.url,
                                       str(ack_path))
    try:
        wait_for(lambda: len(read_acks(ack_path)) >= 600 or not proc.is_alive(),
                 "the writer's first acknowledged writes")
        assert proc.is_alive(), f"writer exited with {proc.exitcode}"
        redis_server.kill9()
    finally:
        proc.kill()
        proc.join(10)
    acks = read_acks(ack_path)
    redis_server.restart()

    store = open_store(redis_server.url)
    for rid, doc in claims.items():
        assert store.get_raw(EventRecord, rid) == doc
    for key, entry in entries.items():
        assert store.get_entry("ws-d", key) == entry
    client = redis_server.client(decode_responses=False)
    stored = {e.id: e for e in store.read_journal("jd")}
    assert set(stored) == set(journal)
    for rid, doc in journal.items():
        assert client.hget(store.keys.record(journal_kind("jd"), rid), "doc") == doc
    assert {r.id for r in store.list_records(EventRecord)} >= set(claims)

    acked_claims = [a[1] for a in acks if a[0] == "claim"]
    acked_journal = [a[1] for a in acks if a[0] == "journal"]
    acked_cas: dict[str, int] = {}
    for a in acks:
        if a[0] == "cas":
            acked_cas[a[1]] = max(acked_cas.get(a[1], 0), int(a[2]))
    assert len(acked_claims) >= 100 and len(acked_cas) == 7
    for rid in acked_claims:
        rec = store.get(EventRecord, rid)
        assert rec is not None and rec.source == "writer", rid
    listed = {r.id for r in store.list_records(EventRecord)}
    assert set(acked_claims) <= listed
    assert set(acked_journal) <= {e.id for e in store.read_journal("jwriter")}
    for key, n in acked_cas.items():
        entry = store.get_entry("ws-writer", key)
        # the last acknowledged value, or one more whose reply was lost in the crash
        assert entry is not None and int(entry.updated_at) in (n, n + 1), (key, n, entry)
    client.close()


# -- 7. documents round-trip byte for byte ---------------------------------------------------

PAYLOADS = [
    '{"zeta": 1, "alpha": {"y": [], "x": {}}, "text": "é 日本 😀",'
    ' "esc": "\\u00e9\\ud83d\\ude00", "big": 123456789012345678901234567890,'
    ' "neg": -9223372036854775809, "tiny": 1e-7, "nested": [[], {}, [[]], {"": {}}],'
    ' "spaced" : [ 1 , 2.50 ] }',
    "123456789012345678901234567890",
    str(-(2**63) - 1),
    "1e-7",
    "[]",
    "{}",
    '"日本 é 😀"',
    '[{"b":1,"a":2},{"z":[],"y":{}}]',
]


@pytest.mark.parametrize("payload", [p.encode() for p in PAYLOADS],
                         ids=[f"p{i}" for i in range(len(PAYLOADS))])
def test_documents_round_trip_byte_for_byte(backend: Backend, payload: bytes) -> None:
    store = backend.store()
    reader = backend.store()

    rec = EventRecord(version=1, id="rt", source="é日本😀", payload=msgspec.Raw(payload))
    assert store.claim(rec, owner="owner-rt").won
    assert reader.get_raw(EventRecord, "rt") == encode(rec)
    got = reader.get(EventRecord, "rt")
    assert got is not None and bytes(got.payload) == payload
    (listed,) = reader.list_records(EventRecord)
    assert bytes(listed.payload) == payload
    lost = reader.claim(EventRecord(version=1, id="rt", source="other"))
    assert not lost.won and encode(lost.record) == encode(rec)

    entry = JournalEntry(version=1, id="rt", type="t", payload=msgspec.Raw(payload))
    assert store.append("jrt", entry).won
    (read,) = reader.read_journal("jrt")
    assert bytes(read.payload) == payload and encode(read) == encode(entry)
    assert backend.raw_doc(store.keys.record(journal_kind("jrt"), "rt")) == encode(entry)

    ws = WorkspaceEntry(version=1, workspace_id="ws-rt", key="k", updated_at="1",
                        value=msgspec.Raw(payload))
    assert store.compare_and_set(ws, None).ok
    got_ws = reader.get_entry("ws-rt", "k")
    assert got_ws is not None and bytes(got_ws.value) == payload
    assert backend.raw_doc(store.keys.entry("ws-rt", "k")) == encode(ws)
    (listed_ws,) = reader.list_entries("ws-rt")
    assert bytes(listed_ws.value) == payload

    agent = AgentRecord(version=1, id="ag-rt", definition_id="d", provisioning_key="pk-rt",
                        meta=msgspec.Raw(payload))
    assert store.provision(agent).created
    got_agent = reader.get_agent("ag-rt")
    assert got_agent is not None and bytes(got_agent.meta) == payload
    assert backend.raw_doc(store.keys.agent("ag-rt")) == encode(agent)

    receipt = EffectReceipt(version=1, scope="run-rt", key="k", meta=msgspec.Raw(payload))
    assert store.claim_effect(receipt).won
    dup = reader.claim_effect(EffectReceipt(version=1, scope="run-rt", key="k"))
    assert not dup.won and dup.receipt is not None and bytes(dup.receipt.meta) == payload


# -- 8. corrupt records ------------------------------------------------------------------------

GARBAGE = {
    "truncated": b'{"kind":"event","version":1,"id":"ev-7","source":',
    "not-utf8": b"\xff\xfe\x00garbage",
    "wrong-shape": b'{"kind":"event","version":1}',
    "wrong-kind": b'{"kind":"journal","version":1,"id":"ev-7","type":"x"}',
}


@pytest.mark.parametrize("garbage", list(GARBAGE.values()), ids=list(GARBAGE))
def test_corrupt_record_is_named_and_skipped(backend: Backend, garbage: bytes,
                                             caplog: pytest.LogCaptureFixture) -> None:
    store = backend.store()
    for i in range(20):
        assert store.claim(EventRecord(version=1, id=f"ev-{i}", source="s")).won
        assert store.append("jc", JournalEntry(version=1, id=f"ev-{i}", type="t")).won
    key = store.keys.record("event", "ev-7")
    jkey = store.keys.record(journal_kind("jc"), "ev-7")
    backend.corrupt(key, garbage)
    backend.corrupt(jkey, garbage.replace(b'"kind":"journal"', b'"kind":"event"'))

    with pytest.raises(CorruptRecordError) as info:
        store.get(EventRecord, "ev-7")
    assert key in str(info.value)
    assert store.get_raw(EventRecord, "ev-7") == garbage

    with caplog.at_level(logging.WARNING):
        records = store.list_records(EventRecord)
        journal = store.read_journal("jc")
    assert sorted(r.id for r in records) == sorted(f"ev-{i}" for i in range(20) if i != 7)
    assert sorted(e.id for e in journal) == sorted(f"ev-{i}" for i in range(20) if i != 7)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(key in m for m in warnings), warnings
    assert any(jkey in m for m in warnings), warnings


# -- 9. leases -----------------------------------------------------------------------------


def test_leases_fence_with_increasing_epochs(backend: Backend) -> None:
    sa, sb = backend.store(), backend.store()
    a = sa.acquire_lease("lease-1", "tok-a", 10_000)
    assert isinstance(a, Lease) and a.token == "tok-a"
    e = a.epoch

    held = sb.acquire_lease("lease-1", "tok-b", 10_000)
    assert isinstance(held, LeaseHolder)
    assert held.token == "tok-a" and held.epoch == e and 0 < held.ttl_ms <= 10_000

    again = sa.acquire_lease("lease-1", "tok-a", 10_000)  # re-acquire keeps the epoch
    assert isinstance(again, Lease) and again.epoch == e

    renewed = sa.renew_lease(a)
    assert renewed is not None and renewed.epoch == e and renewed.token == "tok-a"
    assert sa.release_lease(a)
    assert not sa.release_lease(a)

    b = sb.acquire_lease("lease-1", "tok-b", 10_000)
    assert isinstance(b, Lease) and b.epoch > e
    assert sa.renew_lease(a) is None  # stale: released and re-taken by B
    assert sa.release_lease(a) is False
    held = sa.acquire_lease("lease-1", "tok-a", 10_000)
    assert isinstance(held, LeaseHolder) and held.token == "tok-b" and held.epoch == b.epoch
    # B's token with A's old epoch is not B's lease
    forged = Lease("lease-1", "tok-b", e, 10_000, a.valid_until)
    assert sa.renew_lease(forged) is None and sa.release_lease(forged) is False
    assert sb.renew_lease(b) is not None
    assert sb.release_lease(b)

    # expiry: C's short lease lapses; D then gets a strictly larger epoch
    started = time.monotonic()
    c = sa.acquire_lease("lease-1", "tok-c", 300)
    assert isinstance(c, Lease) and c.epoch > b.epoch
    early = sb.acquire_lease("lease-1", "tok-d", 10_000)
    if isinstance(early, Lease):  # only possible on a machine so slow that C already lapsed
        assert time.monotonic() - started >= 0.3
        assert early.epoch > c.epoch
        assert sb.release_lease(early)
    else:
        assert early.token == "tok-c" and early.epoch == c.epoch

    def acquired() -> Lease | None:
        got = sb.acquire_lease("lease-1", "tok-d", 10_000)
        return got if isinstance(got, Lease) else None

    d = wait_for(acquired, "C's lease to expire", interval=0.02)
    assert d.epoch > c.epoch
    assert sa.renew_lease(c) is None and sa.release_lease(c) is False

    other = sa.acquire_lease("lease-2", "tok-a", 10_000)  # leases are independent
    assert isinstance(other, Lease)


# -- 10. effect claims -----------------------------------------------------------------------


def test_effect_claims_one_winner_and_fencing(backend: Backend) -> None:
    results = backend.run("claim_effect", [("run-1", "charge-42", None)] * N_WORKERS)
    won = [w for w, (ok, _, _) in enumerate(results) if ok]
    assert len(won) == 1, results
    first = msgspec.json.encode({"by": won[0]})
    for w, (ok, stale, receipt) in enumerate(results):
        assert not stale
        if w != won[0]:
            assert not ok and receipt == first

    store = backend.store()
    backend.set_fence(store, "run-1", 5)

    def claim(key: str, epoch: int | None) -> Any:
        return store.claim_effect(EffectReceipt(version=1, scope="run-1", key=key), epoch=epoch)

    stale = claim("email-1", 4)
    assert stale.stale and not stale.won and stale.receipt is None
    assert claim("charge-42", 4).stale  # refused before looking at the receipt
    assert claim("email-1", 5).won
    assert not claim("email-1", 6).won
    assert claim("email-2", 6).won
    assert claim("email-3", None).won  # unfenced
    assert claim("email-3", 4).stale
    other = store.claim_effect(EffectReceipt(version=1, scope="run-2", key="email-1"), epoch=0)
    assert other.won  # fences are per scope

    # concurrent: workers with a stale epoch are refused, exactly one current worker wins
    results = backend.run("claim_effect",
                          [("run-1", "sms-1", 4 if w % 2 else 5) for w in range(N_WORKERS)])
    for w, (_, stale_, _) in enumerate(results):
        assert stale_ == bool(w % 2)
    won = [w for w, (ok, _, _) in enumerate(results) if ok]
    assert len(won) == 1 and won[0] % 2 == 0
