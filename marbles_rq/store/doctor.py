"""Is this Redis safe to keep our promises on? An acknowledged write must survive a crash
and must never be evicted; everything else in marbles-rq assumes both. Beyond durability:
may our user run scripts (every write is one), how close is memory to `maxmemory`, and can
a failover to an asynchronous replica lose acknowledged writes.

A check is ok, a "problem" (doctor exits 1; worker and controller refuse to start, except
for memory headroom) or a "warning" (reported, never fatal)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from ..errors import UnsafeRedisError
from .connection import Client
from .replies import as_text

log = logging.getLogger("marbles_rq.store.doctor")

MIN_VERSION = (7, 0)

# setting -> (required value, why an acknowledged write is at risk otherwise)
REQUIRED = {
    "appendonly": ("yes", "without the append-only file a restart loses every write since the "
                          "last snapshot"),
    "appendfsync": ("always", "only 'always' fsyncs before replying; 'everysec' can lose about "
                              "a second of acknowledged writes"),
    "no-appendfsync-on-rewrite": ("no", "'yes' skips fsync while a rewrite runs, losing up to "
                                        "30 s of acknowledged writes"),
    "maxmemory-policy": ("noeviction", "an evicting policy silently deletes records and leases "
                                       "under memory pressure"),
}
RECOMMENDED = {
    "aof-use-rdb-preamble": ("yes", "faster restarts; not a durability risk"),
}
EXTRA_CONFIG = ["maxmemory", "min-replicas-to-write"]
MEMORY_PROBLEM_RATIO = 0.9
# Checks about capacity, not about losing writes: reported, but no reason to refuse a
# worker, which would then not drain the queue either.
NOT_REFUSED = {"memory"}


@dataclass(frozen=True)
class Check:
    node: str
    name: str
    value: str
    expected: str
    ok: bool
    severity: str  # "problem" | "warning": what it is when not ok
    why: str

    def line(self) -> str:
        where = f"{self.node} " if self.node else ""
        mark = "ok" if self.ok else self.severity
        return f"{mark:8} {where}{self.name} = {self.value} (want {self.expected})"


def _node_checks(node: str, config: dict[str, Any], info: dict[str, Any]) -> list[Check]:
    checks = []
    version = as_text(info.get("redis_version", "0"))
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    checks.append(Check(node, "redis_version", version, ">= 7.0", parts >= MIN_VERSION,
                        "problem", "marbles-rq needs Redis 7.0 (fsync-before-reply fixes, "
                                   "script shebangs)"))
    for table, severity in ((REQUIRED, "problem"), (RECOMMENDED, "warning")):
        for name, (want, why) in table.items():
            value = as_text(config.get(name, "<unreadable>"))
            checks.append(Check(node, name, value, want, value == want, severity, why))
    status = as_text(info.get("aof_last_write_status", "ok"))
    checks.append(Check(node, "aof_last_write_status", status, "ok", status == "ok", "problem",
                        "the server reports failing AOF writes"))
    checks.append(_memory_check(node, config, info))
    checks.append(_replication_check(node, config, info))
    return checks


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _int(value: Any) -> int:
    try:
        return int(as_text(value))
    except ValueError:
        return 0


def _memory_check(node: str, config: dict[str, Any], info: dict[str, Any]) -> Check:
    used, limit = _int(info.get("used_memory", 0)), _int(config.get("maxmemory", 0))
    want = f"< {MEMORY_PROBLEM_RATIO:.0%} of maxmemory"
    if limit <= 0:
        return Check(node, "memory", f"{_mib(used)} used, no maxmemory", "a maxmemory", False,
                     "warning", "without maxmemory Redis grows until the machine swaps or the "
                                "kernel kills it; set maxmemory so writes are refused (OOM) "
                                "first")
    ratio = used / limit
    return Check(node, "memory", f"{_mib(used)} of {_mib(limit)} ({ratio:.0%})", want,
                 ratio < MEMORY_PROBLEM_RATIO, "problem",
                 "near maxmemory every write (enqueue, step commits) is refused with OOM")


def _replication_check(node: str, config: dict[str, Any], info: dict[str, Any]) -> Check:
    role = as_text(info.get("role", "master"))
    if role != "master":
        primary = f"{as_text(info.get('master_host', '?'))}:{as_text(info.get('master_port', '?'))}"
        return Check(node, "replication", f"a replica of {primary}", "a primary", False,
                     "problem", "a replica refuses writes (READONLY); give the primary's URL")
    replicas = _int(info.get("connected_slaves", 0))
    min_replicas = _int(config.get("min-replicas-to-write", 0))
    value = f"{replicas} replicas, min-replicas-to-write {min_replicas}"
    return Check(node, "replication", value, "no replicas or min-replicas-to-write >= 1",
                 replicas == 0 or min_replicas >= 1, "warning",
                 "replication is asynchronous: a failover to a replica can lose writes the "
                 "primary acknowledged; min-replicas-to-write bounds that to "
                 "min-replicas-max-lag seconds")


def _script_check(conn: redis.Redis, node: str) -> Check:
    """Every write of marbles-rq is a Lua script: a user who may read and write but not
    run scripts passes the settings checks and then fails on every command."""
    try:
        conn.eval("return 1", 0)
    except redis.ResponseError as exc:
        user = "?"
        with contextlib.suppress(redis.ResponseError):
            user = as_text(conn.acl_whoami())
        code = "NOPERM" if isinstance(exc, redis.exceptions.NoPermissionError) else str(exc)
        return Check(node, "scripts", f"refused for ACL user {user!r} ({code})", "allowed",
                     False, "problem", f"every write is a Lua script; grant ACL user {user!r} "
                                       f"+@scripting (at least +eval +evalsha)")
    return Check(node, "scripts", "allowed", "allowed", True, "problem",
                 "every write is a Lua script (EVALSHA, EVAL on a cold script cache)")


def check_durability(client: Client) -> list[Check]:
    """Read each primary's settings. Raises redis errors (caller maps them to one line)."""
    names = [*REQUIRED, *RECOMMENDED, *EXTRA_CONFIG]
    if isinstance(client, RedisCluster):
        checks = []
        for node in client.get_primaries():  # type: ignore[no-untyped-call]
            conn = client.get_redis_connection(node)
            checks += _read(conn, node.name, names)
        return checks
    return _read(client, "", names)


def _read(conn: redis.Redis, node: str, names: list[str]) -> list[Check]:
    try:
        config: dict[str, Any] = {}
        for name in names:
            config.update({as_text(k): v for k, v in conn.config_get(name).items()})
    except redis.ResponseError as exc:  # CONFIG renamed or denied (managed services)
        return [Check(node, "config", f"unreadable ({exc})", "readable", False, "problem",
                      "durability settings cannot be verified")]
    info = (conn.info("server") | conn.info("persistence") | conn.info("memory")
            | conn.info("replication"))
    return [*_node_checks(node, config, info), _script_check(conn, node)]


def problems(checks: list[Check]) -> list[Check]:
    return [c for c in checks if not c.ok and c.severity == "problem"]


def warnings(checks: list[Check]) -> list[Check]:
    return [c for c in checks if not c.ok and c.severity != "problem"]


def report(checks: list[Check]) -> dict[str, Any]:
    bad = problems(checks)
    return {"ok": not bad, "checks": [asdict(c) for c in checks],
            "problems": [problem_line(c) for c in bad],
            "warnings": [problem_line(c) for c in warnings(checks)]}


def problem_line(check: Check) -> str:
    where = f" on {check.node}" if check.node else ""
    verb = "must be" if check.severity == "problem" else "should be"
    return f"{check.name} is {check.value!r}{where}, {verb} {check.expected!r}: {check.why}"


def require_durable(client: Client, *, allow_unsafe: bool = False) -> list[Check]:
    """For long-running commands: refuse a Redis that could lose acknowledged writes, unless
    the operator said --allow-unsafe-redis, and then say so loudly."""
    bad = [c for c in problems(check_durability(client)) if c.name not in NOT_REFUSED]
    if bad and not allow_unsafe:
        raise UnsafeRedisError("Redis is not durable: " + "; ".join(problem_line(c) for c in bad)
                               + " (run 'marbles-rq doctor'; --allow-unsafe-redis overrides)")
    for check in bad:
        log.warning("UNSAFE REDIS (allowed by --allow-unsafe-redis): %s", problem_line(check))
    return bad
