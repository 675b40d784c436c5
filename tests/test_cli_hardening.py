"""The CLI facing bad input, a refusing Redis and hostile run output, run as real processes
against real redis-server processes: one line on stderr, the README's exit codes, reads that
write nothing, terminal-safe text, and doctor's script, memory and replication checks."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from textwrap import dedent
from typing import Any

import pytest
import redis

from marbles_rq.store.keys import Keyspace
from tests.redis_procs import REPO_ROOT, RedisServer, free_port

CHAIN = "examples/chain.py"


def mrq(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
        preexec_fn: Callable[[], None] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
    try:
        return subprocess.run([sys.executable, "-m", "marbles_rq", *args], capture_output=True,
                              text=True, timeout=timeout, env={**base, **(env or {})},
                              preexec_fn=preexec_fn)
    except subprocess.TimeoutExpired:
        pytest.fail(f"marbles-rq {' '.join(args)} still running after {timeout} s")


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), proc.stderr
    return lines[0]


def run_keys(url: str) -> list[bytes]:
    return [k for k in redis.Redis.from_url(url).keys("*") if b":run:" in k or b"rq:" in k]


def write_source(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("import marbles_rq as mr\n\n" + dedent(body))
    return path


# -- 16: one line, the README's exit codes -----------------------------------------------


@pytest.mark.parametrize("args,expected", [
    (["--no-such-option", "status", "x"], "No such option"),
    (["status"], "Missing argument"),
    (["worker", "--burst", "--log-level", "FOO"], "'--log-level'"),
    (["controller", "--interval", "nan"], "'--interval'"),
    (["worker", "--burst", "--queues", "a;b"], "invalid queue name 'a;b'"),
])
def test_usage_errors_are_one_line_and_exit_2(redis_url: str, args: list[str],
                                              expected: str) -> None:
    proc = mrq("--redis-url", redis_url, "--source", CHAIN, *args, timeout=20)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in one_line_error(proc)


@pytest.mark.parametrize("env,args,expected", [
    ({"MARBLES_SOCKET_TIMEOUT": "abc"}, ["status", "x"], "MARBLES_SOCKET_TIMEOUT must be"),
    ({"MARBLES_SOCKET_TIMEOUT": "nan"}, ["status", "x"], "MARBLES_SOCKET_TIMEOUT must be"),
    ({"MARBLES_SOCKET_TIMEOUT": "-1"}, ["status", "x"], "MARBLES_SOCKET_TIMEOUT must be"),
    ({"MARBLES_MAX_PAYLOAD": "1MB"}, ["enqueue", "chain"], "MARBLES_MAX_PAYLOAD must be"),
    ({"MARBLES_MAX_PAYLOAD": "-5"}, ["enqueue", "chain"], "MARBLES_MAX_PAYLOAD must be"),
])
def test_garbage_in_the_environment_is_bad_input(redis_url: str, env: dict[str, str],
                                                 args: list[str], expected: str) -> None:
    proc = mrq("--redis-url", redis_url, "--source", CHAIN, *args, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in one_line_error(proc)
    assert run_keys(redis_url) == []


@pytest.mark.parametrize("url", ["redis://127.0.0.1:0/0", "redis+cluster://127.0.0.1:0"])
def test_port_zero_is_a_bad_url_not_the_default_port(url: str) -> None:
    proc = mrq("--redis-url", url, "status", "x")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "invalid Redis URL" in one_line_error(proc)


@pytest.mark.parametrize("delimiter", ["#", "?", "/"])
@pytest.mark.parametrize("option", ["--redis-url", "--rq-url"])
def test_a_password_with_url_delimiters_is_never_echoed(redis_url: str, delimiter: str,
                                                        option: str) -> None:
    url = f"redis://app:hun{delimiter}ter2-secret@127.0.0.1:{free_port()}/0"
    args = ["--redis-url", redis_url, "--rq-url", url] if option == "--rq-url" else [
        "--redis-url", url]
    proc = mrq(*args, "--source", CHAIN, "worker", "--burst")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_line_error(proc)
    assert "invalid Redis URL" in line and "percent-encode" in line
    assert "hun" not in line and "ter2" not in line and "secret" not in line


def test_a_cluster_url_at_a_single_server_is_one_line(redis_url: str) -> None:
    single = redis_url.replace("redis://", "redis+cluster://").rsplit("/", 1)[0]
    proc = mrq("--redis-url", single, "status", "x")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not in cluster mode" in one_line_error(proc)


@pytest.mark.parametrize("command", [["worker", "--burst"], ["controller"]])
def test_an_unreachable_rq_url_is_named_not_the_store(redis_url: str,
                                                      command: list[str]) -> None:
    rq_url = f"redis://127.0.0.1:{free_port()}/0"
    proc = mrq("--redis-url", redis_url, "--rq-url", rq_url, "--source", CHAIN, *command,
               timeout=30)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    line = one_line_error(proc)
    assert f"cannot reach Redis at {rq_url}" in line
    assert redis_url not in line


def test_an_empty_run_id_is_refused_not_made_random(redis_url: str) -> None:
    proc = mrq("--redis-url", redis_url, "--source", CHAIN, "enqueue", "chain", "--input",
               '{"steps": 1}', "--id", "")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "invalid run id ''" in one_line_error(proc)
    assert run_keys(redis_url) == []


@pytest.mark.parametrize("queue", ["a,b", "", "a b", "q" * 65, "rq:queue"])
def test_enqueue_refuses_a_queue_no_worker_can_serve(redis_url: str, queue: str) -> None:
    proc = mrq("--redis-url", redis_url, "--source", CHAIN, "enqueue", "chain", "--input",
               '{"steps": 1}', "--queue", queue)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "invalid queue name" in one_line_error(proc)
    assert run_keys(redis_url) == []


def test_a_workflow_declaring_a_bad_queue_fails_at_load(redis_url: str, tmp_path: Path) -> None:
    source = write_source(tmp_path / "flows.py", """
        @mr.workflow(queue="high,low")
        def split(ctx):
            return 1
    """)
    proc = mrq("--redis-url", redis_url, "--source", str(source), "enqueue", "split")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "invalid queue name 'high,low'" in one_line_error(proc)
    assert run_keys(redis_url) == []


def test_a_huge_input_file_is_not_read_whole(redis_url: str) -> None:
    def cap_memory() -> None:  # reading /dev/zero whole fails fast instead of eating the box
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    proc = mrq("--redis-url", redis_url, "--source", CHAIN, "enqueue", "chain", "--input",
               "@/dev/zero", env={"MARBLES_MAX_PAYLOAD": "4096"}, preexec_fn=cap_memory)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "larger than the limit of 4096 bytes" in one_line_error(proc)
    assert run_keys(redis_url) == []


@pytest.mark.parametrize("depth", [65, 980, 1000, 50_000])
def test_deeply_nested_input_is_refused_at_enqueue(redis_url: str, tmp_path: Path,
                                                   depth: int) -> None:
    source = write_source(tmp_path / "flows.py", """
        @mr.workflow
        def anything(ctx, inp):
            return inp
    """)
    deep = "[" * depth + "]" * depth
    proc = mrq("--redis-url", redis_url, "--source", str(source), "enqueue", "anything",
               "--input", deep)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "deeper than 64 levels" in one_line_error(proc)
    assert run_keys(redis_url) == []
    ok = mrq("--redis-url", redis_url, "--source", str(source), "enqueue", "anything",
             "--input", '[{"a": "[[[["}, ' + "[" * 63 + "]" * 63 + "]")  # 64 levels
    assert ok.returncode == 0, ok.stderr


def test_a_worker_without_workflows_refuses_to_start(redis_url: str, tmp_path: Path) -> None:
    bare = mrq("--redis-url", redis_url, "worker", "--burst")
    assert bare.returncode == 2, bare.stdout + bare.stderr
    assert "needs --source" in one_line_error(bare)
    steps_only = write_source(tmp_path / "steps.py", """
        @mr.step
        def helper():
            return 1
    """)
    empty = mrq("--redis-url", redis_url, "--source", str(steps_only), "worker", "--burst")
    assert empty.returncode == 2, empty.stdout + empty.stderr
    assert "defines no workflow" in one_line_error(empty)
    assert not [k for k in redis.Redis.from_url(redis_url).keys("rq:worker*")]


def test_two_sources_with_the_same_file_name_both_load(redis_url: str, tmp_path: Path) -> None:
    a = write_source(tmp_path / "a" / "flows.py", """
        @mr.workflow
        def from_a(ctx):
            return "a"
    """)
    b = write_source(tmp_path / "b" / "flows.py", """
        @mr.workflow
        def from_b(ctx):
            return "b"
    """)
    for name in ("from_a", "from_b"):
        proc = mrq("--redis-url", redis_url, "--source", f"{a}:{b}", "enqueue", name)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_out_of_memory_is_one_line_and_reads_still_work(redis_server: RedisServer) -> None:
    url = redis_server.url
    first = mrq("--redis-url", url, "--source", CHAIN, "enqueue", "chain", "--input",
                '{"steps": 1}', "--id", "before-oom")
    assert first.returncode == 0, first.stderr
    redis_server.client().config_set("maxmemory", 1)
    refused = mrq("--redis-url", url, "--source", CHAIN, "enqueue", "chain", "--input",
                  '{"steps": 1}', "--id", "during-oom")
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert one_line_error(refused) == ("error: Redis refused the write: out of memory "
                                       "(maxmemory reached)")
    status = mrq("--redis-url", url, "status", "before-oom")
    assert status.returncode == 0, status.stderr
    assert "before-oom  chain  queued" in status.stdout
    listed = mrq("--redis-url", url, "runs")
    assert listed.returncode == 0 and "before-oom" in listed.stdout, listed.stderr
    watched = mrq("--redis-url", url, "watch", "before-oom", "--no-follow")
    assert watched.stderr == "" and "queued: chain on default" in watched.stdout
    assert watched.returncode == 1  # it has not run: not succeeded


def _acl_user_without_scripts(server: RedisServer) -> str:
    server.client().acl_setuser("app", enabled=True, passwords=["+apppw"], keys=["*"],
                                channels=["*"], commands=["+@all", "-@scripting"])
    return f"redis://app:apppw@127.0.0.1:{server.port}/0"


def test_an_acl_user_without_scripts_gets_one_line_and_doctor_says_so(
        redis_server: RedisServer) -> None:
    url = _acl_user_without_scripts(redis_server)
    enqueue = mrq("--redis-url", url, "--source", CHAIN, "enqueue", "chain", "--input",
                  '{"steps": 1}')
    assert enqueue.returncode == 3, enqueue.stdout + enqueue.stderr
    line = one_line_error(enqueue)
    assert "NOPERM" in line and "marbles-rq doctor" in line
    doctor = mrq("--redis-url", url, "doctor", "--json")
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    report = json.loads(doctor.stdout)
    assert [p.split(" ")[0] for p in report["problems"]] == ["scripts"]
    assert "ACL user 'app'" in report["problems"][0] and "+@scripting" in report["problems"][0]
    reading = mrq("--redis-url", url, "status", "nothing-here")  # reads need no script
    assert "no run with id 'nothing-here'" in one_line_error(reading)


def test_doctor_denied_info_says_refused_not_unreachable(redis_server: RedisServer) -> None:
    redis_server.client().acl_setuser("blind", enabled=True, passwords=["+pw"], keys=["*"],
                                      channels=["*"], commands=["+@all", "-info"])
    proc = mrq("--redis-url", f"redis://blind:pw@127.0.0.1:{redis_server.port}/0", "doctor")
    assert proc.returncode == 3
    line = one_line_error(proc)
    assert "Redis refused the command" in line and "'info'" in line
    assert "cannot reach" not in line and "pw@" not in line


@pytest.mark.parametrize("exc,expected", [
    (redis.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's "
                         "currently unable to persist to disk."), "cannot persist to disk"),
    (redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
     "read-only replica"),
    (redis.ResponseError("READONLY You can't write against a read only replica."),
     "read-only replica"),
    (redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
     "out of memory"),
    (redis.exceptions.NoPermissionError("this user has no permissions to run the 'eval' "
                                        "command"), "NOPERM: this user has no permissions"),
    (redis.ResponseError("ERR something odd\nsecond line"), "refused the command: ERR "
                                                            "something odd"),
])
def test_each_redis_refusal_maps_to_one_line(exc: redis.ResponseError, expected: str) -> None:
    from marbles_rq.store.connection import refused

    message = str(refused(exc))
    assert expected in message and "\n" not in message


def test_a_corrupt_run_is_one_line_naming_its_key(redis_url: str) -> None:
    made = mrq("--redis-url", redis_url, "--source", CHAIN, "enqueue", "chain", "--input",
               '{"steps": 1}', "--id", "mangled")
    assert made.returncode == 0, made.stderr
    redis.Redis.from_url(redis_url).hset(Keyspace().run("mangled"), "attempt", "not-a-number")
    proc = mrq("--redis-url", redis_url, "status", "mangled")
    assert proc.returncode == 1
    line = one_line_error(proc)
    assert Keyspace().run("mangled") in line and "attempt" in line


_BOOM = """
import sys
from marbles_rq import cli

@cli.cli.command()
def boom() -> None:
    raise ValueError("a bug, not an expected condition")

cli.main(sys.argv[1:])
"""


def test_an_unexpected_error_is_one_line_unless_debugging() -> None:
    def boom(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
        return subprocess.run([sys.executable, "-c", _BOOM, *args], capture_output=True,
                              text=True, timeout=60, env={**base, **(env or {})})

    proc = boom("boom")
    assert proc.returncode == 1
    line = one_line_error(proc)
    assert line.startswith("error: unexpected ValueError: ") and "--debug" in line
    for debug in (boom("--debug", "boom"), boom("boom", env={"MARBLES_DEBUG": "1"})):
        assert debug.returncode == 1
        assert "Traceback" in debug.stderr
        assert debug.stderr.strip().splitlines()[-1].startswith("error: unexpected ValueError")


# -- 17: reading commands write nothing --------------------------------------------------


def test_reading_commands_write_nothing_on_a_fresh_prefix(redis_url: str) -> None:
    common = ("--redis-url", redis_url, "--prefix", "fresh", "--buckets", "8")
    assert mrq(*common, "status", "nope").returncode == 2
    assert mrq(*common, "watch", "nope", "--no-follow").returncode == 2
    assert mrq(*common, "runs").returncode == 0
    assert redis.Redis.from_url(redis_url).dbsize() == 0  # {fresh}:meta was not written
    # So the mistyped --buckets 8 did not fix the deployment: the real one records 1024.
    made = mrq("--redis-url", redis_url, "--prefix", "fresh", "--source", CHAIN, "enqueue",
               "chain", "--input", '{"steps": 1}', "--id", "r1")
    assert made.returncode == 0, made.stderr
    assert redis.Redis.from_url(redis_url).hget("{fresh}:meta", "buckets") == b"1024"
    mismatch = mrq(*common, "status", "r1")  # a recorded count still has to match
    assert mismatch.returncode == 2
    assert "was created with 1024 buckets" in one_line_error(mismatch)


# -- 18: run output cannot drive the terminal ---------------------------------------------

EVIL = ("\x1b]0;pwned\x07\x1b[2J\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\"
        "\r\nrun succeeded: forged\u202eevil\u2066\x9b31m\x7f\x00")
CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069"
                      "\u200b-\u200f\u061c\u2028\u2029\ufeff]")


def test_safe_escapes_every_terminal_control() -> None:
    from marbles_rq.terminal import safe

    assert safe(EVIL) == ("\\x1b]0;pwned\\x07\\x1b[2J\\x1b]8;;http://evil.example/\\x1b\\"
                          "click\\x1b]8;;\\x1b\\\\r\\nrun succeeded: forged\\u202eevil\\u2066"
                          "\\x9b31m\\x7f\\x00")
    plain = "plain text, é, 中文, emoji 🙂, back\\slash"
    assert safe(plain) == plain
    assert not CONTROLS.search(safe("".join(map(chr, range(0x00, 0x2100)))))
    # invisible marks, zero-width characters, line/paragraph separators, the BOM
    assert safe("A\u200fB\u061cC\u2028D\u2029E\u200bF\ufeffG") == (
        "A\\u200fB\\u061cC\\u2028D\\u2029E\\u200bF\\ufeffG")


def test_run_output_cannot_drive_the_terminal(redis_url: str, tmp_path: Path) -> None:
    source = write_source(tmp_path / "evil.py", f"""
        EVIL = {EVIL!r}

        @mr.workflow
        def evil(ctx):
            ctx.stream.write(EVIL)
            ctx.log.info(EVIL)
            return EVIL
    """)
    args = ("--redis-url", redis_url, "--source", str(source))
    assert mrq(*args, "enqueue", "evil", "--id", "e1").returncode == 0
    worker = mrq(*args, "worker", "--burst", timeout=120)
    assert worker.returncode == 0, worker.stderr
    logged = [ln for ln in worker.stderr.splitlines() if "[e1]" in ln]
    assert logged and not any(CONTROLS.search(ln) for ln in logged), logged  # worker log too
    watched = mrq(*args, "watch", "e1", "--no-follow")
    assert watched.returncode == 0, watched.stderr
    status = mrq(*args, "status", "e1")
    listed = mrq(*args, "runs")
    for proc in (watched, status, listed):
        assert not CONTROLS.search(proc.stdout.replace("\n", "")), proc.stdout
    lines = watched.stdout.splitlines()
    assert all(re.match(r"\d\d:\d\d:\d\d\.\d{3} d1 ", ln) for ln in lines), lines
    assert [ln for ln in lines if " d1 run succeeded: " in ln] == [lines[-1]]
    assert "\\x1b]0;pwned\\x07" in watched.stdout  # shown, escaped, not dropped
    exact = json.loads(mrq(*args, "status", "e1", "--json").stdout)
    assert exact["result"] == EVIL


# -- 21: doctor: scripts (above), memory headroom, replication -----------------------------


def _doctor(url: str) -> tuple[int, dict[str, dict[str, Any]], dict[str, Any]]:
    proc = mrq("--redis-url", url, "doctor", "--json")
    report = json.loads(proc.stdout)
    return proc.returncode, {c["name"]: c for c in report["checks"]}, report


def test_doctor_reports_memory_headroom(redis_server: RedisServer) -> None:
    code, checks, report = _doctor(redis_server.url)
    assert code == 0
    assert checks["memory"]["ok"] is False and checks["memory"]["severity"] == "warning"
    assert any(w.startswith("memory is ") for w in report["warnings"])
    client = redis_server.client()
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", int(used * 1.05))
    code, checks, report = _doctor(redis_server.url)
    assert code == 1
    assert checks["memory"]["ok"] is False and checks["memory"]["severity"] == "problem"
    assert [p.split(" ")[0] for p in report["problems"]] == ["memory"]
    client.config_set("maxmemory", used * 20)
    code, checks, _ = _doctor(redis_server.url)
    assert code == 0 and checks["memory"]["ok"] is True
    text = mrq("--redis-url", redis_server.url, "doctor")
    assert re.search(r"ok +memory = [\d.]+ MiB of [\d.]+ MiB \(\d+%\)", text.stdout), text.stdout


def test_doctor_warns_about_asynchronous_replicas(redis_server: RedisServer,
                                                  tmp_path: Path) -> None:
    with RedisServer.start(dir=tmp_path / "replica",
                           extra_args=["--replicaof", "127.0.0.1", str(redis_server.port)]
                           ) as replica:
        primary = redis_server.client()
        deadline = time.monotonic() + 30
        while int(primary.info("replication")["connected_slaves"]) < 1:
            assert time.monotonic() < deadline, "the replica never connected"
            time.sleep(0.05)
        code, checks, report = _doctor(redis_server.url)
        assert code == 0  # a warning, not a problem
        assert checks["replication"]["ok"] is False
        assert checks["replication"]["severity"] == "warning"
        assert "can lose writes the primary acknowledged" in " ".join(
            report["warnings"])
        primary.config_set("min-replicas-to-write", 1)
        code, checks, _ = _doctor(redis_server.url)
        assert code == 0 and checks["replication"]["ok"] is True
        code, checks, report = _doctor(replica.url)
        assert code == 1
        assert checks["replication"]["value"] == f"a replica of 127.0.0.1:{redis_server.port}"
        assert [p.split(" ")[0] for p in report["problems"]] == ["replication"]


# -- 24: the repository stands on its own ------------------------------------------------


def test_nothing_in_the_repository_points_outside_it() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    outside = []
    for name in files:
        path = REPO_ROOT / name
        if name == "tests/test_cli_hardening.py" or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if "../shared" in text:
            outside.append(name)
    assert outside == []


def test_an_empty_source_entry_is_refused_not_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "side.py").write_text("open('RAN', 'w').close()\n")
    chain = str(Path(__file__).parent.parent / CHAIN)
    for source in (f"{chain}:", f":{chain}", ":::", " "):
        proc = subprocess.run([sys.executable, "-m", "marbles_rq", "--source", source, "list"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
        assert proc.returncode == 2, (source, proc.stderr)
        assert "empty --source entry" in one_line_error(proc)
    assert not (tmp_path / "RAN").exists()  # nothing under the working directory ran
