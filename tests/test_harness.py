"""Tests of the test harness itself (tests/redis_procs.py and the conftest fixtures)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from tests.redis_procs import CLUSTER_SLOTS, RedisCluster, RedisServer


def test_durable_server_reports_durable_config(redis_server: RedisServer) -> None:
    client = redis_server.client()
    assert client.config_get("appendonly") == {"appendonly": "yes"}
    assert client.config_get("appendfsync") == {"appendfsync": "always"}
    assert client.config_get("no-appendfsync-on-rewrite") == {"no-appendfsync-on-rewrite": "no"}
    assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"


def test_write_survives_kill9_and_restart(redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.set("k", "v")
    client.rpush("journal", "a", "b")
    client.close()
    old_pid = redis_server.pid

    redis_server.kill9()
    assert not redis_server.is_running()
    redis_server.restart()

    assert redis_server.pid != old_pid
    client = redis_server.client()
    assert client.get("k") == "v"
    assert client.lrange("journal", 0, -1) == ["a", "b"]


def test_default_config_server_is_not_durable(default_config_server: RedisServer) -> None:
    client = default_config_server.client()
    assert client.config_get("appendonly") == {"appendonly": "no"}
    assert client.config_get("appendfsync") == {"appendfsync": "everysec"}


def test_password_server(tmp_path: Path) -> None:
    server = RedisServer.start(dir=tmp_path / "pw", extra_args=["--requirepass", "x"])
    try:
        assert server.password == "x"
        assert redis.Redis.from_url(server.auth_url).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(server.url).get("k")
    finally:
        server.stop()
    assert not server.is_running()


def test_redis_url_is_flushed(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0
    client.set("leftover", "1")  # the next test using redis_url must not see it


def test_redis_url_is_flushed_again(redis_url: str) -> None:
    assert redis.Redis.from_url(redis_url).dbsize() == 0


def _slot_ranges(cluster: RedisCluster) -> list[tuple[int, int, int]]:
    rows = cluster.nodes[0].client().cluster("SLOTS")
    return sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in rows)


def test_cluster_three_masters_cover_all_slots(
    redis_cluster: RedisCluster, cluster_url: str
) -> None:
    assert cluster_url == f"redis+cluster://127.0.0.1:{redis_cluster.ports[0]}"
    ranges = _slot_ranges(redis_cluster)
    assert sum(end - start + 1 for start, end, _ in ranges) == CLUSTER_SLOTS
    assert {port for _, _, port in ranges} == set(redis_cluster.ports)
    assert len(redis_cluster.ports) == 3
    for node in redis_cluster.nodes:
        client = node.client()
        assert client.cluster("INFO")["cluster_state"] == "ok"
        assert client.info("replication")["role"] == "master"
        assert client.config_get("appendfsync") == {"appendfsync": "always"}


def test_cluster_writes_land_on_every_master(redis_cluster: RedisCluster, cluster_url: str) -> None:
    rc = redis_cluster.client()
    try:
        keys: dict[int, str] = {}
        for start, end, port in _slot_ranges(redis_cluster):
            i = 0
            while f"k{i}" in keys.values() or not start <= key_slot(f"k{i}".encode()) <= end:
                i += 1
            keys[port] = f"k{i}"
        assert set(keys) == set(redis_cluster.ports)
        for port, key in keys.items():
            assert rc.set(key, str(port))
            assert rc.get(key) == str(port)
    finally:
        rc.close()
    # each key really lives on the master that owns its slot
    for node in redis_cluster.nodes:
        assert node.client().get(keys[node.port]) == str(node.port)


def test_cluster_node_kill9_restart_keeps_data(
    redis_cluster: RedisCluster, cluster_url: str
) -> None:
    rc = redis_cluster.client()
    tag = "{t}"
    rc.set(f"{tag}:a", "1")
    slot = key_slot(f"{tag}:a".encode())
    rc.close()
    owner = next(
        n
        for n in redis_cluster.nodes
        for start, end, port in _slot_ranges(redis_cluster)
        if port == n.port and start <= slot <= end
    )
    owner.kill9()
    owner.restart()
    redis_cluster.wait_ready()
    rc = redis_cluster.client()
    try:
        assert rc.get(f"{tag}:a") == "1"
    finally:
        rc.close()
