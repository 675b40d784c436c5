"""`marbles-rq run NAME --dry-run`: executed in this process on memory. Redis is untouched
(a dump of every key before and after is identical, and no connection is even opened), and
it works with Redis down; questions are asked on a terminal, or cancel the run without one;
timers do not wait; children run here."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time

import redis

from tests.procs import REPO_ROOT, db_contents
from tests.redis_procs import free_port

SOURCE = str(REPO_ROOT / "tests" / "cli_workflows.py")


def argv(url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "marbles_rq", "--redis-url", url, "--source", SOURCE, *args]


def run(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv(url, *args), capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT, stdin=subprocess.DEVNULL)


def snapshot(r: redis.Redis) -> dict[str, object]:
    return db_contents(r)


def test_dry_run_writes_nothing_and_opens_no_connection(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    # A deployment with some state: a recorded run, its bucket meta, RQ's keys.
    enq = subprocess.run(argv(redis_url, "enqueue", "greet", "--id", "real"),
                         capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert enq.returncode == 0, enq.stderr
    before = snapshot(r)
    connections = int(r.info("stats")["total_connections_received"])

    done = run(redis_url, "run", "parent", "--input", '{"n": 4}', "--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert sum(1 for line in lines if "started (bulk_item)" in line) == 2  # the children
    assert "[\n  4,\n  5\n]" in done.stdout  # the result, pretty JSON
    assert lines[-1].startswith("[run] parent succeeded dry-")

    again = run(redis_url, "run", "greet", "--input", '{"times": 2}', "--dry-run", "--json")
    assert again.returncode == 0, again.stderr
    data = json.loads(again.stdout)
    assert data["status"] == "succeeded" and data["result"] == "hello hello"
    assert data["dry_run"] is True
    assert [e["data"] for e in data["output"] if e["type"] == "output"] == [
        {"text": "hello hello"}]

    assert snapshot(r) == before
    # Our own INFO call is the only connection since (nothing of the dry run reached Redis).
    assert int(r.info("stats")["total_connections_received"]) == connections


def test_dry_run_with_redis_down() -> None:
    done = run(f"redis://127.0.0.1:{free_port()}/0", "run", "greet", "--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"hello"' in done.stdout
    assert "succeeded" in done.stdout.splitlines()[-1]


def test_question_without_a_terminal_cancels_the_run() -> None:
    done = run(f"redis://127.0.0.1:{free_port()}/0", "run", "asker", "--input", '{"n": 3}',
               "--dry-run")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "doubled: 6" in done.stdout
    assert "parked: waiting for an answer to ship" in done.stdout
    assert ("run cancelled: question 'ship' was asked and stdin is not a terminal to answer "
            "it") in done.stdout
    assert done.stdout.splitlines()[-1].startswith("[run] asker cancelled")


def test_questions_on_a_terminal_and_a_timer_that_does_not_wait() -> None:
    """stdin and stderr on a pseudo-terminal: the approval and the question are asked and
    answered there; the hour-long timer is skipped by the dry run's clock."""
    leader, follower = pty.openpty()
    started = time.monotonic()
    proc = subprocess.Popen(argv(f"redis://127.0.0.1:{free_port()}/0", "run", "asker",
                                 "--input", '{"n": 3}', "--dry-run"),
                            cwd=REPO_ROOT, stdin=follower, stderr=follower,
                            stdout=subprocess.PIPE, text=True)
    os.close(follower)
    seen = b""

    def until(needle: bytes) -> None:
        nonlocal seen
        while needle not in seen:
            chunk = os.read(leader, 1024)
            assert chunk, seen
            seen += chunk

    until(b"approve? [y/N]")
    assert b"question ship: Ship 6?" in seen
    os.write(leader, b"y\n")
    until(b"note (empty for none)")
    os.write(leader, b"looks good\n")
    until(b"answer:")
    assert b"1) red" in seen and b"2) blue" in seen
    os.write(leader, b"7\n")  # not a choice: asked again
    until(b"one of 1 to 2")
    os.write(leader, b"2\n")
    out, _ = proc.communicate(timeout=60)
    os.close(leader)
    assert proc.returncode == 0, out
    assert time.monotonic() - started < 60  # the 3600 s timer did not wait
    assert "question ship answered" in out and "question colour answered: \"blue\"" in out
    assert "dry run: timer due" in out
    pretty = out[out.rindex("\n{\n") + 1:out.rindex("\n[run] ")]  # the result, printed last
    result = json.loads(pretty)
    assert result == {"doubled": 6, "approved": True, "colour": "blue"}


def test_bad_input_is_refused_before_anything_runs() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    for args, expected in (
            (["run", "order", "--dry-run"], "workflow 'order' needs an input: sku has no "
                                            "default"),
            (["run", "greet", "--input", '{"greting": "x"}', "--dry-run"],
             "unknown field 'greting'"),
            (["run", "nope", "--dry-run"], "unknown workflow 'nope'")):
        done = run(url, *args)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stdout == "" and done.stderr.count("\n") == 1 and expected in done.stderr
