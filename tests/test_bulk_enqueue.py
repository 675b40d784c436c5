"""`marbles-rq enqueue NAME --batch FILE.jsonl`: interrupted by SIGKILL and run again, every
line is enqueued exactly once; bad lines are refused with their line numbers while the rest
go in; duplicate ids; stdin; the progress bar only on a terminal. No worker runs here: what
is checked is what was recorded and what RQ holds."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
from pathlib import Path

import redis

from marbles_rq.engine.bulk import derived_id
from marbles_rq.store.keys import Keyspace
from marbles_rq.transport.dispatch import rq_queue_name
from tests.procs import REPO_ROOT, wait_for
from tests.redis_procs import RedisServer

SOURCE = str(REPO_ROOT / "tests" / "cli_workflows.py")
QUEUE_KEY = "rq:queue:" + rq_queue_name("mrq", "default")


def argv(url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "marbles_rq", "--redis-url", url, "--source", SOURCE, *args]


def run(url: str, *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv(url, *args), input=None if stdin is None else stdin.decode(),
                          capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
                          env={**os.environ, **(env or {})},
                          stdin=subprocess.DEVNULL if stdin is None else None)
    return done


def recorded_ids(r: redis.Redis) -> list[str]:
    keys = Keyspace()
    ids: list[str] = []
    for b in range(keys.buckets):
        ids += [m.decode() for m in r.zrange(keys.listing("run", b), 0, -1)]
    return ids


def queued_job_ids(r: redis.Redis) -> list[str]:
    return [j.decode() for j in r.lrange(QUEUE_KEY, 0, -1)]


def test_sigkill_mid_file_then_rerun_enqueues_every_line_once(redis_url: str,
                                                              tmp_path: Path) -> None:
    n = 12_000
    path = tmp_path / "batch.jsonl"
    expected: list[str] = []
    with path.open("w") as fh:
        for i in range(n):
            if i % 3 == 0:  # a third of the lines carry their own id
                line = json.dumps({"id": f"item-{i}", "input": {"n": i}})
                expected.append(f"item-{i}")
            else:
                line = json.dumps({"n": i, "note": "derived"})
                expected.append(derived_id("bulk_item", line.encode()))
            fh.write(line + "\n")
    r = redis.Redis.from_url(redis_url)
    proc = subprocess.Popen(argv(redis_url, "enqueue", "bulk_item", "--batch", str(path)),
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    try:
        # Some chunks are in, not all: kill it there.
        wait_for(lambda: r.llen(QUEUE_KEY) >= 2_000 or None, timeout=120,
                 what="the first chunks of the batch in RQ")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    first_pass = r.llen(QUEUE_KEY)
    assert 2_000 <= first_pass < n, "the kill must land mid-file"
    # Whole chunks only: each chunk is one transaction.
    assert len(recorded_ids(r)) == first_pass

    again = run(redis_url, "enqueue", "bulk_item", "--batch", str(path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip() == (f"{n - first_pass} enqueued, {first_pass} already "
                                    f"existing, 0 refused ({n} lines)")
    ids = recorded_ids(r)
    jobs = queued_job_ids(r)
    assert sorted(ids) == sorted(expected)  # every line once, under its id
    assert len(jobs) == n and len(set(jobs)) == n  # one delivery per run in RQ
    # A third pass finds everything there and writes nothing.
    before = r.dbsize()
    third = run(redis_url, "enqueue", "bulk_item", "--batch", str(path))
    assert third.returncode == 0
    assert third.stdout.strip() == f"0 enqueued, {n} already existing, 0 refused ({n} lines)"
    assert r.dbsize() == before and r.llen(QUEUE_KEY) == n


def test_bad_lines_are_refused_by_number_and_the_rest_go_in(redis_url: str,
                                                           tmp_path: Path) -> None:
    lines = [
        json.dumps({"n": 1}),                                  # 1 ok (derived id)
        json.dumps({"id": "keep-2", "input": {"n": 2}}),       # 2 ok
        "{not json",                                           # 3 invalid JSON
        json.dumps({"n": "three"}),                            # 4 schema-invalid
        json.dumps({"n": 4, "colour": "red"}),                 # 5 unknown field
        "",                                                    # 6 blank: skipped
        json.dumps({"id": "keep-2", "input": {"n": 7}}),       # 7 duplicate id
        json.dumps({"n": 8, "note": "x" * 3000}),              # 8 oversized input
        json.dumps({"id": "bad id!", "input": {"n": 9}}),      # 9 invalid id
        json.dumps({"id": 10, "input": {"n": 10}}),            # 10 id not a string
        json.dumps({"n": 1}),                                  # 11 same line as 1: duplicate
        "[" * 100 + "]" * 100,                                 # 12 nested too deep
        "x" * 9000,                                            # 13 a line over the limit
        json.dumps({"id": "keep-14", "input": {"n": 14}}),     # 14 ok
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\r\n".join(lines) + "\r\n")  # CRLF, as a Windows editor saves it
    env = {"MARBLES_MAX_PAYLOAD": "2048"}
    done = run(redis_url, "enqueue", "bulk_item", "--batch", str(path), env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.strip() == "3 enqueued, 0 already existing, 10 refused (14 lines)"
    refusals = done.stderr.strip().splitlines()
    numbers = [int(line.split(":", 1)[0].removeprefix("line ")) for line in refusals]
    assert numbers == [3, 4, 5, 7, 8, 9, 10, 11, 12, 13]
    by_line = dict(zip(numbers, refusals, strict=True))
    assert "not valid JSON" in by_line[3]
    assert "Expected `int`, got `str`" in by_line[4]
    assert "unknown field 'colour'" in by_line[5]
    assert "duplicate run id 'keep-2' (line 2 names it too)" in by_line[7]
    assert "the limit is 2048" in by_line[8]
    assert "invalid run id" in by_line[9]
    assert "id must be a string" in by_line[10]
    assert "(line 1 names it too)" in by_line[11]
    assert "deeper than 64" in by_line[12]
    assert "longer than the limit" in by_line[13]
    r = redis.Redis.from_url(redis_url)
    assert sorted(recorded_ids(r)) == sorted(
        ["keep-2", "keep-14", derived_id("bulk_item", lines[0].encode())])
    assert r.llen(QUEUE_KEY) == 3

    # --json: the same, as one object; the runs exist now.
    again = run(redis_url, "enqueue", "bulk_item", "--batch", str(path), "--json", env=env)
    assert again.returncode == 2
    data = json.loads(again.stdout)
    assert (data["enqueued"], data["existing"], data["refused"]) == (0, 3, 10)
    assert [x["line"] for x in data["refusals"]] == numbers


def test_stdin_chunks_and_one_script_call_per_chunk(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)

    def calls(body: str) -> tuple[int, int]:
        """(script calls, transactions) of one `enqueue --batch -` of `body`."""
        r.config_resetstat()
        done = run(redis_url, "enqueue", "bulk_item", "--batch", "-", stdin=body.encode())
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""  # no progress bar when stderr is not a terminal
        stats = r.info("commandstats")
        return (int(stats.get("cmdstat_evalsha", {}).get("calls", 0)),
                int(stats.get("cmdstat_multi", {}).get("calls", 0)))

    # A batch costs one script call per chunk (every run of it recorded and enqueued in
    # that call), no transaction, and nothing else but what a process does once (a chunk
    # of two lines: that and one chunk).
    once, _ = calls("".join(json.dumps({"id": f"t-{i}", "input": {"n": i}}) + "\n"
                            for i in range(2)))
    body = "".join(json.dumps({"id": f"s-{i}", "input": {"n": i}}) + "\n" for i in range(1200))
    assert calls(body) == (once - 1 + 3, 0)  # 1,200 lines in chunks of 500, one call each
    assert r.llen(QUEUE_KEY) == 1202


def test_progress_bar_on_a_terminal(redis_url: str, tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(600)))
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv(redis_url, "enqueue", "bulk_item", "--batch", str(path)),
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=follower,
                            stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "120"})
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        seen += chunk
    out, _ = proc.communicate(timeout=120)
    os.close(leader)
    assert proc.returncode == 0
    assert out.decode().strip() == "600 enqueued, 0 already existing, 0 refused (600 lines)"
    text = seen.decode(errors="replace")
    assert "enqueue" in text and "600 new" in text, text


def test_unknown_workflow_and_usage_are_one_line_exit_2(redis_url: str,
                                                        tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps({"n": 1}) + "\n")
    for args, expected in (
            (["enqueue", "nope", "--batch", str(path)], "unknown workflow 'nope'"),
            (["enqueue", "bulk_item", "--batch", str(path), "--id", "x"],
             "--batch takes no --input, --id, --priority, --start-at or --wait"),
            (["enqueue", "bulk_item", "--batch", str(tmp_path / "missing")],
             "cannot read the batch file"),
            (["enqueue", "bulk_item", "--batch", str(path), "--queue", "bad queue"],
             "queue")):
        done = run(redis_url, *args)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.count("\n") == 1 and expected in done.stderr, done.stderr
    assert redis.Redis.from_url(redis_url).llen(QUEUE_KEY) == 0


def test_redis_killed_mid_file_then_rerun(redis_server: RedisServer, tmp_path: Path) -> None:
    """redis-server SIGKILLed while chunks are being sent: the command stops with one error
    line (exit 3) and says after which line; once Redis is back (from its AOF), the same
    command enqueues the rest, every line exactly once."""
    n = 12_000
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps({"id": f"k-{i}", "input": {"n": i}}) + "\n"
                            for i in range(n)))
    url = redis_server.url
    r = redis.Redis.from_url(url)
    proc = subprocess.Popen(argv(url, "enqueue", "bulk_item", "--batch", str(path)),
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True,
                            env={**os.environ, "MARBLES_SOCKET_TIMEOUT": "2"})
    try:
        wait_for(lambda: r.llen(QUEUE_KEY) >= 1_000 or None, timeout=120,
                 what="the first chunks of the batch in RQ")
        redis_server.kill9()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, out + err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Redis" in lines[-1], err
    assert "the same command again enqueues the rest" in err
    redis_server.restart()
    r = redis.Redis.from_url(url)
    kept = r.llen(QUEUE_KEY)
    assert 1_000 <= kept < n
    assert len(recorded_ids(r)) == kept  # whole chunks: every recorded run has its job
    again = run(url, "enqueue", "bulk_item", "--batch", str(path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip() == (f"{n - kept} enqueued, {kept} already existing, "
                                    f"0 refused ({n} lines)")
    assert sorted(recorded_ids(r)) == sorted(f"k-{i}" for i in range(n))
    jobs = queued_job_ids(r)
    assert len(jobs) == n and len(set(jobs)) == n


def test_batch_and_rerun_on_three_lanes(redis_url: str, tmp_path: Path) -> None:
    """With lanes, each run's delivery goes to its own lane's queue (`--lane-count` given after
    the command name), for a batch and for a rerun."""
    from marbles_rq.engine.runs import RunStore
    from marbles_rq.store import open_store

    n = 900
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps({"id": f"l-{i}", "input": {"n": i}}) + "\n"
                            for i in range(n)))
    done = run(redis_url, "enqueue", "bulk_item", "--batch", str(path), "--lane-count", "3")
    assert done.returncode == 0, done.stderr
    r = redis.Redis.from_url(redis_url)
    lane_keys = Keyspace("mrq", lanes=3)  # the default layout a fresh deployment records
    queues = [f"{lane_keys.lane_rq_prefix(k)}:queue:mrq.default" for k in range(3)]
    assert sum(r.llen(q) for q in queues) == n and min(r.llen(q) for q in queues) > 0
    assert r.llen(QUEUE_KEY) == 0  # nothing in RQ's own keyspace
    runs = RunStore(open_store(redis_url, lanes=3))
    for i in range(0, n, 97):
        rid = f"l-{i}"
        lane = int(r.hget(runs.keys.run(rid), "lane") or b"0")
        jobs = [j.decode() for j in r.lrange(queues[lane], 0, -1)]
        assert any(j.endswith(f"-{rid}-a1") for j in jobs), (rid, lane)

    # A rerun (of a cancelled run: a finished one) goes to the new run's lane too.
    assert run(redis_url, "cancel", "l-5", "--lane-count", "3").returncode == 0
    again = run(redis_url, "rerun", "l-5", "--id", "l-5-again", "--lane-count", "3")
    assert again.returncode == 0, again.stderr
    lane = int(r.hget(runs.keys.run("l-5-again"), "lane") or b"0")
    jobs = [j.decode() for j in r.lrange(queues[lane], 0, -1)]
    assert any(j.endswith("-l-5-again-a1") for j in jobs)
