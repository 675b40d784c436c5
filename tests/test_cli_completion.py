"""Shell completion over click's protocol (_MARBLES_RQ_COMPLETE, COMP_WORDS, COMP_CWORD):
workflow names from the workers' catalog and from --source, run ids, schedule keys, and
`marbles-rq completion SHELL`. With Redis down a completion answers what it knows without
Redis, exits 0 and writes nothing to stderr."""

from __future__ import annotations

import pytest

from tests.procs import REPO_ROOT
from tests.redis_procs import free_port
from tests.test_cli_conventions import SOURCE, mrq

WEB_SOURCE = str(REPO_ROOT / "tests" / "web_workflows.py")


def complete(*words: str, env: dict[str, str] | None = None) -> list[str]:
    """The values bash would be offered for the last word of `marbles-rq WORDS...`."""
    line = " ".join(["marbles-rq", *words])
    done = mrq(env={"_MARBLES_RQ_COMPLETE": "bash_complete", "COMP_WORDS": line,
                    "COMP_CWORD": str(len(words)), **(env or {})})
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # nothing may land in the user's command line
    rows = [row for row in done.stdout.splitlines() if row]  # none: one empty line
    assert all("," in row for row in rows), done.stdout
    return [row.split(",", 1)[1] for row in rows]


@pytest.mark.parametrize("shell,marker", [("bash", "_marbles_rq_completion()"),
                                          ("zsh", "#compdef marbles-rq"),
                                          ("fish", "complete --no-files --command marbles-rq")])
def test_completion_prints_the_script(shell: str, marker: str) -> None:
    done = mrq("completion", shell)
    assert done.returncode == 0 and marker in done.stdout
    assert "_MARBLES_RQ_COMPLETE" in done.stdout
    bad = mrq("completion", "tcsh")
    assert bad.returncode == 2 and "tcsh" in bad.stderr


def test_completion_without_a_shell_is_one_readable_line() -> None:
    done = mrq("completion")
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "\\n" not in done.stderr and "\\t" not in done.stderr, done.stderr
    assert "Choose from: bash, zsh, fish" in done.stderr, done.stderr


def test_command_names_complete_from_the_static_table() -> None:
    assert complete("in") == ["info"]
    assert complete("sch") == ["schedules"]


def test_workflow_names_from_the_catalog_and_from_source(redis_url: str) -> None:
    # Nothing declared yet, no --source: nothing to offer.
    assert complete("--redis-url", redis_url, "enqueue", "") == []
    # A worker declares its workflows in the catalog when it starts.
    done = mrq("--redis-url", redis_url, "--source", SOURCE, "worker", "--burst")
    assert done.returncode == 0, done.stderr
    assert complete("--redis-url", redis_url, "enqueue", "b") == ["basket", "bulk_item"]
    assert complete("--redis-url", redis_url, "run", "gr") == ["greet"]
    assert complete("--redis-url", redis_url, "runs", "--name", "or") == ["order"]
    # --source adds what it declares, also with Redis down.
    dead = f"redis://127.0.0.1:{free_port()}"
    assert complete("--redis-url", dead, "--source", WEB_SOURCE, "roll", "web_a") == [
        "web_approve", "web_ask"]
    assert complete("--redis-url", dead, "--source", SOURCE, "enqueue", "gr") == ["greet"]


def test_run_ids_complete(redis_url: str) -> None:
    for rid in ("cmp-1", "cmp-2", "other-1"):
        made = mrq("--redis-url", redis_url, "--source", SOURCE, "enqueue", "greet", "--id", rid)
        assert made.returncode == 0, made.stderr
    assert complete("--redis-url", redis_url, "status", "cmp-") == ["cmp-1", "cmp-2"]
    assert complete("--redis-url", redis_url, "watch", "oth") == ["other-1"]
    assert complete("--redis-url", redis_url, "answer", "cmp-2") == ["cmp-2"]
    # The environment's URL is the one used when no --redis-url is given.
    assert complete("cancel", "cmp-1", env={"MARBLES_REDIS_URL": redis_url}) == ["cmp-1"]


def test_schedule_keys_complete_with_or_without_redis(redis_url: str) -> None:
    dead = f"redis://127.0.0.1:{free_port()}"
    for url in (redis_url, dead):
        assert complete("--redis-url", url, "--source", WEB_SOURCE, "schedules", "pause",
                        "web-") == ["web-hourly"]
        assert complete("--redis-url", url, "--source", WEB_SOURCE, "schedules", "resume",
                        "") == ["web-hourly"]


def test_redis_down_completes_nothing_quietly() -> None:
    dead = f"redis://127.0.0.1:{free_port()}"
    assert complete("--redis-url", dead, "status", "") == []
    assert complete("--redis-url", dead, "enqueue", "") == []
    # A malformed URL is no traceback either.
    assert complete("--redis-url", "nonsense://x", "status", "r") == []
    # Options still complete.
    assert "--json" in complete("--redis-url", dead, "status", "r1", "--j")
