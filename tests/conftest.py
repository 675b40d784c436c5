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

Every fixture is per process, so pytest-xdist workers (ops/test runs ``-n``) never share a
server, a port or a directory. The run order is longest first, from tests/durations.json
(``--write-durations`` records it again): with ``--dist loadgroup`` a worker that frees up
takes the next test, so the minute-long tests start at once and the short ones fill the gaps
at the end instead of one long test running alone last.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Procs
from tests.redis_procs import RedisCluster, RedisServer

DURATIONS = Path(__file__).with_name("durations.json")
# Tests one xdist worker runs one after the other: those sharing a module-scoped fixture too
# costly to start on every worker (a 6-node replicated cluster, a browser), and the two chaos
# runs, which each keep both cores busy for minutes -- on the worker of the cluster's
# failover tests, which the chaos load beside them once starved past their deadlines.
# (group, file, fixture or None for every test)
GROUPS = (("heavy", "tests/test_lanes.py", "lane_cluster"),
          ("browser", "tests/test_web_browser.py", "browser"),
          ("heavy", "tests/test_chaos.py", None))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--write-durations", action="store_true",
                     help=f"record every test's duration in {DURATIONS.name} (the run order)")


def _base_nodeid(nodeid: str) -> str:
    # under --dist loadgroup xdist appends "@<group>" to a grouped test's id
    return nodeid.split("@")[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        known: dict[str, float] = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        known = {}

    def unit_of(item: pytest.Item) -> str:
        mark = item.get_closest_marker("xdist_group")
        return str(mark.args[0]) if mark is not None else item.nodeid

    weight: dict[str, float] = {}
    for item in items:
        for group, path, fixture in GROUPS:
            if item.nodeid.split("::")[0] == path and (
                    fixture is None or fixture in getattr(item, "fixturenames", ())):
                item.add_marker(pytest.mark.xdist_group(group))
        unit = unit_of(item)
        weight[unit] = weight.get(unit, 0.0) + known.get(item.nodeid, 0.0)
    # stable: tests never timed keep their file order, after the timed ones
    items.sort(key=lambda item: -weight[unit_of(item)])


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    nodeid = _base_nodeid(report.nodeid)
    _durations[nodeid] = _durations.get(nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if not config.getoption("write_durations") or hasattr(config, "workerinput"):
        return  # the xdist controller writes it: it sees every worker's reports
    try:
        timed: dict[str, float] = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        timed = {}
    timed.update((k, round(v, 1)) for k, v in _durations.items())  # a partial run updates
    timed = {k: v for k, v in sorted(timed.items(), key=lambda kv: -kv[1]) if v >= 0.5}
    DURATIONS.write_text("{\n" + ",\n".join(f"  {json.dumps(k)}: {v}"
                                              for k, v in timed.items()) + "\n}\n")


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
