"""Behaviour of RedisStore that only exists on Redis: resends after a timeout, the script
cache, the bucket-count check, and the hash-slot layout on a cluster."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import msgspec
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from marbles_rq.errors import BucketMismatchError
from marbles_rq.store import Lease, RedisStore, journal_kind, open_store
from marbles_rq.store.connection import connect
from marbles_rq.store.keys import Keyspace
from marbles_rq.store.records import (
    AgentRecord,
    EffectReceipt,
    EventRecord,
    JournalEntry,
    WorkspaceEntry,
    encode,
)
from tests.redis_procs import RedisCluster, RedisServer

# Busy-waits for ARGV[1] milliseconds without writing: the server answers nobody meanwhile.
STALL_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
local start = now_ms()
while now_ms() - start < tonumber(ARGV[1]) do end
return 1
"""


def raw(obj: Any) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(obj))


def plain_client(url: str, timeout: float = 5.0) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=timeout, retry=Retry(NoBackoff(), 0))


def calls(client: redis.Redis, command: str) -> int:
    stats = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


@contextmanager
def stalled(url: str, ms: int) -> Iterator[None]:
    """Run a busy script of `ms` milliseconds from another connection; enter once the
    server has stopped answering (a PING from a third connection times out)."""
    errors: list[BaseException] = []

    def stall() -> None:
        client = plain_client(url, timeout=10)
        try:
            client.eval(STALL_LUA, 0, ms)
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    thread = threading.Thread(target=stall, daemon=True)
    thread.start()
    # A PING answers in well under a millisecond unless the server is busy; 150 ms leaves
    # room for a loaded test machine, and the stalls below are long enough to absorb it.
    probe = plain_client(url, timeout=0.15)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                probe.ping()
            except redis.TimeoutError:
                break  # the stall script is running
            assert thread.is_alive() and time.monotonic() < deadline, f"no stall: {errors}"
            time.sleep(0.002)
        yield
    finally:
        probe.close()
        thread.join(10)
    assert not errors, errors


class CountingClient:
    """Counts the script sends a Scripts instance makes (EVALSHA and EVAL)."""

    def __init__(self, client: Any) -> None:
        self.sends = 0
        for name in ("evalsha", "eval"):
            real = getattr(client, name)
            setattr(client, name, self._counted(real))

    def _counted(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def send(*args: Any) -> Any:
            self.sends += 1
            return real(*args)
        return send


# -- no silent duplicate writes -------------------------------------------------------------


def node_for(request: pytest.FixtureRequest, deployment: str, key: str) -> tuple[str, str]:
    """(store URL, URL of the server holding `key`) for a single server or the cluster."""
    if deployment == "redis":
        url: str = request.getfixturevalue("redis_url")
        return url, url
    cluster: RedisCluster = request.getfixturevalue("redis_cluster")
    url = request.getfixturevalue("cluster_url")
    client = cluster.nodes[0].client()
    try:
        slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
        port = next(int(row[2][1]) for row in client.cluster("SLOTS")
                    if int(row[0]) <= slot <= int(row[1]))
    finally:
        client.close()
    return url, next(n.url for n in cluster.nodes if n.port == port)


def same_bucket_id(keys: Any, like: str) -> str:
    return next(f"warm-{i}" for i in range(10_000)
                if keys.bucket_of(f"warm-{i}") == keys.bucket_of(like))


@pytest.mark.parametrize("op", ["claim", "append", "cas"])
@pytest.mark.parametrize("deployment", ["redis", "cluster"])
def test_resend_after_timeout_writes_once_and_reports_success(
        request: pytest.FixtureRequest, deployment: str, op: str) -> None:
    keys = Keyspace()
    target = {"claim": keys.record("event", "ev-1"),
              "append": keys.record(journal_kind("j"), "e-1"),
              "cas": keys.entry("ws", "k")}[op]
    url, node_url = node_for(request, deployment, target)
    store = RedisStore(connect(url, socket_timeout=0.2), keys, url=url)
    reader = open_store(url)
    admin = plain_client(node_url)
    # Warm the script cache of the node (same bucket), so the timed-out send runs too.
    warm = same_bucket_id(keys, "ev-1" if op == "claim" else "e-1")
    assert store.claim(EventRecord(version=1, id=warm, source="w")).won
    assert store.append("j", JournalEntry(version=1, id=warm, type="t")).won
    first = WorkspaceEntry(version=1, workspace_id="ws", key="k", updated_at="1", value=raw(1))
    assert store.compare_and_set(first, None).ok

    counter = CountingClient(store.client)
    before = calls(admin, "evalsha")
    with stalled(node_url, 800):
        if op == "claim":
            rec = EventRecord(version=1, id="ev-1", source="mine", payload=raw({"a": 1}))
            result: Any = store.claim(rec)
            assert result.won and result.record == rec
        elif op == "append":
            entry = JournalEntry(version=1, id="e-1", type="mine", payload=raw([1]))
            result = store.append("j", entry)
            assert result.won and result.record == entry
        else:
            update = WorkspaceEntry(version=1, workspace_id="ws", key="k", updated_at="2",
                                    value=raw(2))
            result = store.compare_and_set(update, "1")
            assert result.ok and result.current == "2"
    server_sends = calls(admin, "evalsha") - before

    # The store really resent (otherwise this test proves nothing). The first send was
    # already in the server's socket buffer when it timed out, so the server ran it after
    # the stall; the send that answered was another one. (A resend can also fail in the
    # reconnect handshake without reaching the server, so the counts may differ.)
    assert counter.sends >= 2
    assert server_sends >= 2
    if op == "claim":
        assert [r.id for r in reader.list_records(EventRecord)].count("ev-1") == 1
        assert reader.get_raw(EventRecord, "ev-1") == encode(rec)
    elif op == "append":
        assert sorted(e.id for e in reader.read_journal("j")) == sorted(["e-1", warm])
        assert admin.hget(target, "doc") == encode(entry)
    else:
        assert reader.list_entries("ws") == [update]
        assert admin.hget(target, "doc") == encode(update)
    admin.close()


def test_control_default_redis_py_retry_applies_a_write_twice(redis_url: str) -> None:
    """Why connection.connect() disables redis-py's retry: with its default Retry, a command
    that times out is sent again, and both sends are applied while the caller sees one
    success. (Control for the test above.) Note: in redis-py 8 the Redis() constructor has
    this default retry (10 attempts on ConnectionError/TimeoutError); Redis.from_url() has
    none, so the control builds its client with the constructor."""
    parts = urlsplit(redis_url)
    client = redis.Redis(host=parts.hostname or "", port=parts.port or 6379,
                         socket_timeout=0.25)  # everything else: redis-py's defaults
    admin = plain_client(redis_url)
    assert client.ping()  # connected before the stall: the first RPUSH reaches the server
    with stalled(redis_url, 800):
        length = client.rpush("control", "x")
    assert length > 1  # one RPUSH call, several elements
    assert admin.llen("control") == length
    client.close()
    admin.close()


# -- script cache -----------------------------------------------------------------------------


def test_claim_works_after_script_flush(redis_url: str) -> None:
    store = open_store(redis_url)
    admin = plain_client(redis_url)
    assert store.claim(EventRecord(version=1, id="a", source="s")).won
    admin.script_flush()
    evals = calls(admin, "eval")
    assert store.claim(EventRecord(version=1, id="b", source="s")).won
    assert not store.claim(EventRecord(version=1, id="a", source="t")).won
    assert calls(admin, "eval") == evals + 1  # NOSCRIPT answered with EVAL, once
    assert {r.id for r in store.list_records(EventRecord)} == {"a", "b"}
    admin.close()


def test_same_store_keeps_working_across_kill9_and_restart(redis_server: RedisServer) -> None:
    store = open_store(redis_server.url)
    rec = EventRecord(version=1, id="before", source="s")
    assert store.claim(rec).won
    redis_server.kill9()
    redis_server.restart()  # empty script cache, and the store's connection is dead
    assert store.claim(EventRecord(version=1, id="after", source="s")).won
    lost = store.claim(EventRecord(version=1, id="before", source="t"))
    assert not lost.won and lost.record == rec
    assert store.append("j", JournalEntry(version=1, id="e", type="t")).won
    assert {r.id for r in store.list_records(EventRecord)} == {"before", "after"}


# -- bucket count -------------------------------------------------------------------------------


def test_bucket_count_is_fixed_per_prefix(redis_url: str) -> None:
    store = open_store(redis_url, buckets=64)
    assert store.claim(EventRecord(version=1, id="x", source="s")).won
    with pytest.raises(BucketMismatchError, match="64 buckets"):
        open_store(redis_url, buckets=32)
    assert open_store(redis_url).keys.buckets == 64  # the default matches

    other = open_store(redis_url, prefix="other", buckets=32)
    assert other.list_records(EventRecord) == []
    assert other.claim(EventRecord(version=1, id="x", source="other")).won
    assert open_store(redis_url, prefix="other", buckets=32).get(EventRecord, "x") is not None
    with pytest.raises(BucketMismatchError):
        open_store(redis_url, prefix="other", buckets=64)
    got = open_store(redis_url, buckets=64).get(EventRecord, "x")
    assert got is not None and got.source == "s"


# -- cluster layout -------------------------------------------------------------------------------


def test_cluster_keys_of_one_script_share_a_slot(redis_cluster: RedisCluster,
                                                 cluster_url: str) -> None:
    store = open_store(cluster_url)
    sent: list[tuple[str, list[str]]] = []
    real_call = store.scripts.call

    def call(name: str, keys: list[str], args: list[Any]) -> list[Any]:
        sent.append((name, list(keys)))
        return real_call(name, keys, args)

    store.scripts.call = call  # type: ignore[method-assign]
    n = 300
    for i in range(n):
        assert store.claim(EventRecord(version=1, id=f"ev-{i}", source="s"), owner="own").won
        assert store.append("jc", JournalEntry(version=1, id=f"e-{i}", type="t"),
                            owner="own").won
        assert store.compare_and_set(WorkspaceEntry(version=1, workspace_id=f"ws-{i}",
                                                    key="k", updated_at="1"), None,
                                     owner="own").ok
        assert store.claim_effect(EffectReceipt(version=1, scope=f"run-{i}", key="k"),
                                  epoch=1).won
        if i % 10 == 0:
            assert store.provision(AgentRecord(version=1, id=f"ag-{i}", definition_id="d",
                                               provisioning_key=f"pk-{i}")).created
            lease = store.acquire_lease(f"lease-{i}", "tok", 10_000)
            assert isinstance(lease, Lease)
            assert store.renew_lease(lease) is not None and store.release_lease(lease)
    assert store.purge("own", batch_size=7) == 3 * n
    names = {name for name, _ in sent}
    assert names >= {"claim_record", "cas_entry", "claim_effect", "provision_agent",
                     "purge_owned", "acquire_lease", "renew_lease", "release_lease"}

    node = redis_cluster.nodes[0].client(decode_responses=True)
    pipe = node.pipeline(transaction=False)
    for _, keys in sent:
        for key in keys:
            pipe.execute_command("CLUSTER", "KEYSLOT", key)
    slots = iter(pipe.execute())
    per_call = [(name, {next(slots) for _ in keys}) for name, keys in sent]
    assert all(len(s) == 1 for _, s in per_call), [c for c in per_call if len(c[1]) != 1][:5]
    used = {next(iter(s)) for _, s in per_call}
    tags = [store.keys.tag(b) for b in range(store.keys.buckets)] + [store.keys.agents_tag]
    for tag in tags:
        pipe.execute_command("CLUSTER", "KEYSLOT", tag)
    tag_slots = pipe.execute()
    assert used <= set(tag_slots)
    assert len(used) > store.keys.buckets // 2  # the load is spread, not one hot slot
    node.close()


def test_cluster_records_spread_over_all_masters(redis_cluster: RedisCluster,
                                                 cluster_url: str) -> None:
    store = open_store(cluster_url)
    n = 300
    for i in range(n):
        assert store.claim(EventRecord(version=1, id=f"ev-{i}", source="s")).won
    per_node = {}
    for node in redis_cluster.nodes:
        client = node.client(decode_responses=True)
        per_node[node.port] = sum(1 for _ in client.scan_iter(match="*:rec:event:*", count=500))
        client.close()
    assert sum(per_node.values()) == n
    assert all(count > 0 for count in per_node.values()), per_node
    assert len(store.list_records(EventRecord)) == n
