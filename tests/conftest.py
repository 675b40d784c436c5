"""Shared pytest fixtures: real redis-server processes from tests/redis_procs.py.

Fixtures
--------
redis_server           function: a fresh durable server (ops/redis.conf) in tmp_path.
redis_session_server   session: one durable server shared by the whole run.
redis_url              function: URL of redis_session_server, emptied before the test
                       (FLUSHALL + FUNCTION FLUSH + SCRIPT FLUSH); restarted if a test killed it.
redis_cluster          session: a 3-master Redis Cluster with the durable config.
cluster_url            function: ``redis+cluster://...`` URL of redis_cluster, every master
                       emptied before the test; dead nodes restarted first.
default_config_server  function: a server with Redis's built-in defaults (no AOF, no fsync
                       guarantees) for negative tests of durability checks.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Procs
from tests.redis_procs import RedisCluster, RedisServer


def _require_redis() -> None:
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        pytest.fail(
            f"{' and '.join(missing)} not found on PATH: the tests run real Redis servers. "
            "Install it with 'apt-get install redis-server' (Debian/Ubuntu), or run ops/test.",
            pytrace=False,
        )


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    _require_redis()
    server = RedisServer.start(dir=tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_session_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    _require_redis()
    server = RedisServer.start(dir=tmp_path_factory.mktemp("redis-session"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_session_server: RedisServer) -> str:
    if not redis_session_server.is_running():
        redis_session_server.restart()
    redis_session_server.flushall()
    return redis_session_server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    _require_redis()
    cluster = RedisCluster.start(dir=tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: RedisCluster) -> str:
    dead = [node for node in redis_cluster.nodes if not node.is_running()]
    for node in dead:
        node.restart()
    if dead:
        redis_cluster.wait_ready()
    redis_cluster.flushall()
    return redis_cluster.url


@pytest.fixture
def default_config_server(tmp_path: Path) -> Iterator[RedisServer]:
    _require_redis()
    server = RedisServer.start(dir=tmp_path / "redis-default", conf=None)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def procs(request: pytest.FixtureRequest, redis_server: RedisServer,
          tmp_path: Path) -> Iterator[Procs]:
    """Real marbles-rq processes against a fresh durable server, stopped after the test.
    A test module may set PROCS_SOURCES (the workflow sources every process loads; default:
    examples/chain.py and tests/kill_workflows.py) and PROCS_REPORT_LINES."""
    sources = getattr(request.module, "PROCS_SOURCES", None)
    p = (Procs(redis_server.url, tmp_path / "procs") if sources is None
         else Procs(redis_server.url, tmp_path / "procs", sources=sources))
    try:
        yield p
    finally:
        p.stop_all()
        print(p.report(lines=getattr(request.module, "PROCS_REPORT_LINES", 40)))  # shown on failure
