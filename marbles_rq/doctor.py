"""Is this Redis safe to keep our promises on? An acknowledged write must survive a crash
and must never be evicted; everything else in marbles-rq assumes both."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from .connection import Client
from .errors import UnsafeRedisError

log = logging.getLogger("marbles_rq.doctor")

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


@dataclass(frozen=True)
class Check:
    node: str
    name: str
    value: str
    expected: str
    ok: bool
    severity: str  # "problem" | "note"
    why: str

    def line(self) -> str:
        where = f"{self.node} " if self.node else ""
        mark = "ok" if self.ok else self.severity
        return f"{mark:8} {where}{self.name} = {self.value} (want {self.expected})"


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _node_checks(node: str, config: dict[str, Any], info: dict[str, Any]) -> list[Check]:
    checks = []
    version = _s(info.get("redis_version", "0"))
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    checks.append(Check(node, "redis_version", version, ">= 7.0", parts >= MIN_VERSION,
                        "problem", "marbles-rq needs Redis 7.0 (fsync-before-reply fixes, "
                                   "script shebangs)"))
    for table, severity in ((REQUIRED, "problem"), (RECOMMENDED, "note")):
        for name, (want, why) in table.items():
            value = _s(config.get(name, "<unreadable>"))
            checks.append(Check(node, name, value, want, value == want, severity, why))
    status = _s(info.get("aof_last_write_status", "ok"))
    checks.append(Check(node, "aof_last_write_status", status, "ok", status == "ok", "problem",
                        "the server reports failing AOF writes"))
    return checks


def check_durability(client: Client) -> list[Check]:
    """Read each primary's settings. Raises redis errors (caller maps them to one line)."""
    names = [*REQUIRED, *RECOMMENDED]
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
            config.update({_s(k): v for k, v in conn.config_get(name).items()})
    except redis.ResponseError as exc:  # CONFIG renamed or denied (managed services)
        return [Check(node, "config", f"unreadable ({exc})", "readable", False, "problem",
                      "durability settings cannot be verified")]
    info = conn.info("server") | conn.info("persistence")
    return _node_checks(node, config, info)


def problems(checks: list[Check]) -> list[Check]:
    return [c for c in checks if not c.ok and c.severity == "problem"]


def report(checks: list[Check]) -> dict[str, Any]:
    bad = problems(checks)
    return {"ok": not bad, "checks": [asdict(c) for c in checks],
            "problems": [problem_line(c) for c in bad]}


def problem_line(check: Check) -> str:
    where = f" on {check.node}" if check.node else ""
    return f"{check.name} is {check.value!r}{where}, must be {check.expected!r}: {check.why}"


def require_durable(client: Client, *, allow_unsafe: bool = False) -> list[Check]:
    """For long-running commands: refuse a Redis that could lose acknowledged writes, unless
    the operator said --allow-unsafe-redis, and then say so loudly."""
    bad = problems(check_durability(client))
    if bad and not allow_unsafe:
        raise UnsafeRedisError("Redis is not durable: " + "; ".join(problem_line(c) for c in bad)
                               + " (run 'marbles-rq doctor'; --allow-unsafe-redis overrides)")
    for check in bad:
        log.warning("UNSAFE REDIS (allowed by --allow-unsafe-redis): %s", problem_line(check))
    return bad
