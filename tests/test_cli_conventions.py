"""CLI conventions: connection options after the command name (every command), --version,
--json on every read command, shell completion, strict input and omitted input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click
import pytest
import redis

from tests.procs import REPO_ROOT
from tests.redis_procs import free_port

SOURCE = str(REPO_ROOT / "tests" / "cli_workflows.py")
CONNECTION = ("--redis-url", "--prefix", "--buckets", "--lane-count", "--source", "--rq-url")


def mrq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MARBLES_", "_MARBLES"))}
    return subprocess.run([sys.executable, "-m", "marbles_rq", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                          env={**clean, **(env or {})})


def one_error(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def _all_commands() -> list[tuple[str, click.Command]]:
    from marbles_rq.cli import _register, cli

    _register()
    out: list[tuple[str, click.Command]] = []

    def walk(prefix: str, command: click.Command) -> None:
        out.append((prefix, command))
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(f"{prefix} {name}", sub)

    for name, command in cli.commands.items():
        walk(name, command)
    return out


def test_every_command_accepts_the_connection_options_after_its_name() -> None:
    commands = _all_commands()
    assert len(commands) >= 25
    for path, command in commands:
        flags = {opt for p in command.params for opt in getattr(p, "opts", [])}
        missing = [f for f in (*CONNECTION, "--debug") if f not in flags]
        assert not missing, f"{path} lacks {missing}"


def test_connection_options_after_the_command_win(redis_url: str) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    made = mrq("enqueue", "greet", "--id", "p1", "--redis-url", redis_url, "--prefix", "p2",
               "--source", SOURCE)
    assert made.returncode == 0, made.stderr
    # Given after the command, they override the ones before it (a dead URL, another prefix).
    shown = mrq("--redis-url", dead, "--prefix", "mrq", "status", "p1", "--redis-url",
                redis_url, "--prefix", "p2", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["input"] == {"greeting": "hello", "times": 1}
    # Under the default prefix there is no such run.
    other = mrq("status", "p1", "--redis-url", redis_url)
    assert other.returncode == 2 and "no run with id 'p1'" in one_error(other)
    # Nested commands too; and a command with an argument called source keeps both apart.
    listed = mrq("events", "--json", "--redis-url", redis_url, "--prefix", "p2")
    assert listed.returncode == 0 and json.loads(listed.stdout) == []
    sent = mrq("events", "send", "github", "--id", "e1", "--redis-url", redis_url,
               "--source", SOURCE)
    assert sent.returncode == 0, sent.stderr
    assert "no trigger matches github, so no run" in sent.stdout
    # --debug after the command is accepted as well.
    assert mrq("runs", "--json", "--debug", "--redis-url", redis_url,
               "--prefix", "p2").returncode == 0
    # An unreachable URL given after the command is the one used.
    down = mrq("status", "p1", "--redis-url", dead)
    assert down.returncode == 3 and "cannot reach Redis" in one_error(down)


def test_version() -> None:
    from marbles_rq import __version__

    done = mrq("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"marbles-rq {__version__}"


def test_every_read_command_has_json(redis_url: str) -> None:
    base = ("--redis-url", redis_url, "--source", SOURCE)
    assert mrq(*base, "enqueue", "greet", "--id", "r1").returncode == 0
    reads: list[tuple[list[str], set[int]]] = [
        (["status", "r1", "--json"], {0}),
        (["runs", "--json"], {0}),
        (["watch", "r1", "--no-follow", "--json"], {1}),  # queued: not succeeded
        (["feed", "--json"], {0}),
        (["leader", "--json"], {1}),  # nobody leads: null
        (["list", "--json"], {0}),
        (["events", "--json"], {0}),
        (["schedules", "--json"], {0}),
        (["doctor", "--json"], {0, 1}),
        (["health", "worker", "--json"], {1}),
        (["health", "controller", "--json"], {1}),
    ]
    for args, codes in reads:
        done = mrq(*base, *args)
        assert done.returncode in codes, (args, done.stdout, done.stderr)
        if args[0] == "watch":
            events = [json.loads(line) for line in done.stdout.splitlines()]
            assert events[0]["type"] == "queued" and events[0]["data"]["name"] == "greet"
        else:
            json.loads(done.stdout)  # one JSON document
    assert json.loads(mrq(*base, "health", "worker", "--json").stdout)["ok"] is False


def test_shell_completion() -> None:
    script = mrq(env={"_MARBLES_RQ_COMPLETE": "bash_source"})
    assert script.returncode == 0 and "_marbles_rq_completion()" in script.stdout
    words = mrq(env={"_MARBLES_RQ_COMPLETE": "bash_complete", "COMP_WORDS": "marbles-rq sta",
                     "COMP_CWORD": "1"})
    assert "plain,status" in words.stdout.splitlines()
    flags = mrq(env={"_MARBLES_RQ_COMPLETE": "bash_complete",
                     "COMP_WORDS": "marbles-rq status x --redis", "COMP_CWORD": "3"})
    assert "plain,--redis-url" in flags.stdout.splitlines()


@pytest.mark.parametrize("command", [["enqueue"], ["roll"], ["run", "--dry-run"]])
def test_unknown_input_field_is_refused_naming_it(redis_url: str, command: list[str]) -> None:
    done = mrq("--redis-url", redis_url, "--source", SOURCE, command[0], "order",
               *command[1:], "--input", '{"sku": "a-1", "qty": 2, "colour": "red"}')
    assert done.returncode == 2, done.stdout + done.stderr
    assert ("input of workflow 'order' has an unknown field 'colour' (it takes: sku, qty)"
            in one_error(done))
    assert redis.Redis.from_url(redis_url).dbsize() == 0


@pytest.mark.parametrize("payload,path", [
    ({"lines": [{"sku": "a"}, {"sku": "b", "qtty": 2}]}, "lines[1].qtty"),
    ({"lines": [], "owner": {"greeting": "hi", "time": 3}}, "owner.time"),
])
def test_nested_unknown_field_is_named(redis_url: str, payload: object, path: str) -> None:
    done = mrq("--redis-url", redis_url, "--source", SOURCE, "enqueue", "basket", "--input",
               json.dumps(payload))
    assert done.returncode == 2
    assert f"unknown field {path!r}" in one_error(done)
    fine = mrq("--redis-url", redis_url, "--source", SOURCE, "enqueue", "basket", "--input",
               json.dumps({"lines": [{"sku": "a"}], "owner": None}))
    assert fine.returncode == 0, fine.stderr


def test_omitted_input(redis_url: str) -> None:
    base = ("--redis-url", redis_url, "--source", SOURCE)
    ok = mrq(*base, "enqueue", "greet", "--id", "d1", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["input"] == {"greeting": "hello", "times": 1}
    needs = mrq(*base, "enqueue", "order", "--id", "d2")
    assert needs.returncode == 2
    assert "workflow 'order' needs an input: sku has no default" in one_error(needs)
    assert mrq(*base, "status", "d2").returncode == 2  # nothing recorded
