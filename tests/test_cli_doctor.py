"""`marbles-rq doctor` and the CLI's handling of bad Redis settings, run as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.redis_procs import RedisServer, free_port


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "marbles_rq", *args], capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_doctor_passes_on_the_durable_config(redis_server: RedisServer) -> None:
    proc = run_cli("--redis-url", redis_server.url, "doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "appendfsync = always" in proc.stdout
    assert "problem" not in proc.stdout + proc.stderr


def test_doctor_names_each_problem_on_a_default_server(
        default_config_server: RedisServer) -> None:
    proc = run_cli("--redis-url", default_config_server.url, "doctor")
    assert proc.returncode == 1
    problems = [ln for ln in proc.stderr.splitlines() if ln.startswith("problem: ")]
    assert any(p.startswith("problem: appendonly is 'no'") for p in problems), proc.stderr
    assert any(p.startswith("problem: appendfsync is 'everysec'") for p in problems)
    assert len(problems) == 2, proc.stderr


def test_doctor_flags_an_evicting_policy(tmp_path: Path) -> None:
    with RedisServer.start(dir=tmp_path, extra_args=["--maxmemory-policy", "allkeys-lru"]) as srv:
        proc = run_cli("--redis-url", srv.url, "doctor", "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    assert [p.split(" ")[0] for p in report["problems"]] == ["maxmemory-policy"]
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["appendfsync"]["ok"] is True
    assert by_name["maxmemory-policy"]["value"] == "allkeys-lru"


def test_doctor_json_on_a_durable_server(redis_server: RedisServer) -> None:
    proc = run_cli("--redis-url", redis_server.url, "doctor", "--json")
    assert proc.returncode == 0
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert {c["name"] for c in report["checks"]} >= {
        "appendonly", "appendfsync", "maxmemory-policy", "no-appendfsync-on-rewrite",
        "redis_version"}


def test_doctor_checks_every_cluster_master(cluster_url: str) -> None:
    proc = run_cli("--redis-url", cluster_url, "doctor", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # (a cluster deployment has a lane per master: its lanes' leaders are checks too, and
    # the blob store is one)
    nodes = {c["node"] for c in json.loads(proc.stdout)["checks"]
             if c["node"] not in ("controller", "blobs")}
    assert len(nodes) == 3


@pytest.mark.parametrize("url", ["redis://127.0.0.1:99999/0", "http://127.0.0.1:6379",
                                 "redis://[::1/0", "redis:///0"])
def test_malformed_url_is_one_line_and_exit_2(url: str) -> None:
    proc = run_cli("--redis-url", url, "doctor")
    assert proc.returncode == 2
    assert "invalid Redis URL" in one_line_error(proc)


def test_unreachable_redis_fails_fast_with_one_line() -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    proc = run_cli("--redis-url", f"redis://127.0.0.1:{port}/0", "doctor")
    assert time.monotonic() - started < 5
    assert proc.returncode == 3
    assert f"cannot reach Redis at redis://127.0.0.1:{port}/0" in one_line_error(proc)


def test_unanswering_redis_times_out_with_a_clear_error() -> None:
    # A TCP listener that never speaks RESP: connect succeeds, replies never come.
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        env_url = f"redis://127.0.0.1:{port}/0"
        # The socket timeout ends it (not this subprocess timeout, which would raise): how
        # long it takes is for bench/, not an assert on a loaded CI machine.
        proc = subprocess.run(
            [sys.executable, "-c",
             f"from marbles_rq.cli import main; main(['--redis-url', {env_url!r}, 'doctor'])"],
            capture_output=True, text=True, timeout=60)
        assert proc.returncode == 3
        assert "did not answer in time" in one_line_error(proc)
    finally:
        listener.close()


def test_wrong_password(tmp_path: Path) -> None:
    with RedisServer.start(dir=tmp_path, extra_args=["--requirepass", "s3cret"]) as srv:
        wrong = run_cli("--redis-url", f"redis://:nope@127.0.0.1:{srv.port}/0", "doctor")
        missing = run_cli("--redis-url", srv.url, "doctor")
        right = run_cli("--redis-url", srv.auth_url, "doctor")
    assert wrong.returncode == 3
    line = one_line_error(wrong)
    assert "refused the credentials" in line and "nope" not in line
    assert missing.returncode == 3
    assert "requires a password" in one_line_error(missing)
    assert right.returncode == 0, right.stderr


def test_require_durable_refuses_unless_allowed(default_config_server: RedisServer,
                                                caplog: pytest.LogCaptureFixture) -> None:
    from marbles_rq.errors import UnsafeRedisError
    from marbles_rq.store.connection import connect
    from marbles_rq.store.doctor import require_durable

    client = connect(default_config_server.url)
    with pytest.raises(UnsafeRedisError, match="appendfsync is 'everysec'"):
        require_durable(client)
    bad = require_durable(client, allow_unsafe=True)
    assert {c.name for c in bad} == {"appendonly", "appendfsync"}
    assert "UNSAFE REDIS" in caplog.text


@pytest.mark.parametrize("command", [["worker", "--burst"], ["controller"]])
def test_long_running_commands_refuse_a_non_durable_redis(
        default_config_server: RedisServer, command: list[str]) -> None:
    proc = run_cli("--redis-url", default_config_server.url, "--source", "examples/chain.py",
                   *command)
    assert proc.returncode == 3
    line = one_line_error(proc)
    assert "Redis is not durable" in line and "appendfsync is 'everysec'" in line


def test_allow_unsafe_redis_runs_and_says_so_loudly(default_config_server: RedisServer) -> None:
    proc = run_cli("--redis-url", default_config_server.url, "--source", "examples/chain.py",
                   "worker", "--burst", "--allow-unsafe-redis")
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if "UNSAFE REDIS" in ln]
    assert len(warnings) == 2, proc.stderr  # appendonly and appendfsync
