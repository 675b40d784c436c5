"""The run CLI with bad input, and RQ payloads that are not marbles-rq deliveries."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.job import Job

from marbles_rq.transport.dispatch import ENTRY
from marbles_rq.transport.serializer import JSONSerializer
from tests.redis_procs import free_port

CHAIN = "examples/chain.py"


def cli(url: str, *args: str, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "marbles_rq", "--redis-url", url,
                           "--source", CHAIN, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize("args,expected", [
    (["enqueue", "no_such_workflow"], "unknown workflow 'no_such_workflow' (known: chain"),
    (["enqueue", "chain", "--input", '{"steps": "three"}'], "Expected `int`, got `str`"),
    (["enqueue", "chain", "--input", "{steps: 3}"], "input is not valid JSON"),
    (["enqueue", "chain", "--input", '{"steps": 1}', "--id", "bad id!"], "invalid run id"),
    (["enqueue", "chain", "--input", '{"steps": 1}', "--id", "x" * 129], "invalid run id"),
    (["enqueue", "chain", "--input", "@/no/such/file"], "No such file"),
    (["status", "bad|id"], "invalid run id"),
    (["status", "no-such-run"], "no run with id 'no-such-run'"),
    (["watch", "no-such-run"], "no run with id 'no-such-run'"),
    (["cancel", "no-such-run"], "no run with id 'no-such-run'"),
])
def test_bad_input_is_refused_and_nothing_is_recorded(redis_url: str, args: list[str],
                                                      expected: str) -> None:
    proc = cli(redis_url, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in error_line(proc)
    keys = redis.Redis.from_url(redis_url).keys("*")
    assert [k for k in keys if b":run:" in k or b"rq:" in k] == []


def test_oversized_input_is_refused(redis_url: str) -> None:
    big = json.dumps({"steps": 1, "pad": "x" * 5000})
    proc = cli(redis_url, "enqueue", "chain", "--input", big,
               env={"MARBLES_MAX_PAYLOAD": "4096"})
    assert proc.returncode == 2
    assert "the limit is 4096" in error_line(proc)
    assert redis.Redis.from_url(redis_url).dbsize() == 0


def test_enqueue_with_redis_down_is_one_line_and_exit_3() -> None:
    proc = cli(f"redis://127.0.0.1:{free_port()}/0", "enqueue", "chain", "--input",
               '{"steps": 1}')
    assert proc.returncode == 3
    assert "cannot reach Redis" in error_line(proc)


def test_same_id_twice_returns_the_existing_run(redis_url: str) -> None:
    first = cli(redis_url, "enqueue", "chain", "--input", '{"steps": 1}', "--id", "once")
    again = cli(redis_url, "enqueue", "chain", "--input", '{"steps": 9}', "--id", "once",
                "--json")
    assert first.returncode == 0 and again.returncode == 0, again.stderr
    assert "run once queued" in first.stdout
    shown = json.loads(again.stdout)
    assert shown["created"] is False and shown["input"] == {"steps": 1, "sleep_s": 0.0}
    rq = redis.Redis.from_url(redis_url)
    assert rq.lrange("rq:queue:mrq.default", 0, -1) == [b"mrq-once-a1"]


def _run_worker_burst(url: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return cli(url, "worker", "--burst", timeout=120)


def test_a_pickled_payload_is_refused_not_executed(redis_url: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    conn = redis.Redis.from_url(redis_url)
    # What an attacker with write access to Redis could plant: RQ's default (pickle) job.
    job = Queue("mrq.default", connection=conn).enqueue("os.mkdir", str(marker))
    data = zlib.decompress(conn.hget(job.key, "data") or b"")
    assert pickle.loads(data)[0] == "os.mkdir"  # it really is a pickle
    proc = _run_worker_burst(redis_url, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    assert Job.fetch(job.id, connection=conn, serializer=JSONSerializer).get_status() == "failed"


def test_a_json_job_for_another_function_is_refused(redis_url: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned-json"
    conn = redis.Redis.from_url(redis_url)
    job = Queue("mrq.default", connection=conn, serializer=JSONSerializer).enqueue(
        "os.mkdir", str(marker))
    proc = _run_worker_burst(redis_url, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    failed = Job.fetch(job.id, connection=conn, serializer=JSONSerializer)
    assert failed.get_status() == "failed"
    result = failed.latest_result()
    assert result is not None and "is not a marbles-rq delivery" in (result.exc_string or "")


def test_a_delivery_job_with_forged_arguments_is_refused(redis_url: str,
                                                         tmp_path: Path) -> None:
    conn = redis.Redis.from_url(redis_url)
    job = Queue("mrq.default", connection=conn, serializer=JSONSerializer).enqueue(
        ENTRY, {"evil": True}, 1)
    _run_worker_burst(redis_url, tmp_path)
    failed = Job.fetch(job.id, connection=conn, serializer=JSONSerializer)
    assert failed.get_status() == "failed"
    result = failed.latest_result()
    assert result is not None and "is not a marbles-rq delivery" in (result.exc_string or "")
