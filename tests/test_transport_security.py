"""What RQ carries between deployments and workers: delivery ids and queue names that carry
the key prefix (two deployments on one Redis never touch each other's deliveries), and jobs
planted in Redis whose other fields would make RQ import, call, request or enqueue something
(callbacks, webhooks, dependencies, dependents, retries, repeats). Real redis-server, real
worker processes; a planted job is refused and the worker keeps running.

Each planted-job test ends with a barrier instead of a wait: a sentinel run enqueued after
the planted job finishes only after the worker has completely handled the planted one
(a worker takes jobs from a queue in order, one at a time).
"""

from __future__ import annotations

import http.server
import json
import os
import random
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import redis
from rq import Queue
from rq.command import send_stop_job_command
from rq.job import Dependency, Job

from marbles_rq.transport.dispatch import (
    ENTRY,
    FORBIDDEN_FIELDS,
    MarblesJob,
    delivery_id,
    parse_delivery_id,
    rq_queue_name,
)
from marbles_rq.transport.serializer import JSONSerializer
from tests.procs import Proc, Procs, wait_for

PREFIX = "mrq"  # the default prefix; the tests' processes run with it
QUEUE_KEY = f"rq:queue:{rq_queue_name(PREFIX, 'default')}"


# --------------------------------------------------------------------------------------------
# delivery ids: exact, prefix-carrying, invertible


@pytest.mark.parametrize("prefix,run_id,attempt,job_id", [
    ("mrq", "order-42", 1, "mrq-order-42-a1"),
    ("mrq", "a_b.c:d", 12, "mrq-a__b_dc_cd-a12"),
    ("p-a", "x", 1, "p_ha-x-a1"),
    ("p.a_b", "x-a1", 3, "p_da__b-x-a1-a3"),
    ("pa", "b-x", 1, "pa-b-x-a1"),
    ("pa-b", "x", 1, "pa_hb-x-a1"),
    ("_", "_", 1, "__-__-a1"),
    ("a", "-a-", 7, "a--a--a7"),
    ("Z9", "9" * 128, 10**9, f"Z9-{'9' * 128}-a{10**9}"),
])
def test_delivery_id_is_spelled_once_and_parsed_back(prefix: str, run_id: str, attempt: int,
                                                     job_id: str) -> None:
    assert delivery_id(prefix, run_id, attempt) == job_id
    assert parse_delivery_id(prefix, job_id) == (run_id, attempt)
    assert set(job_id) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@pytest.mark.parametrize("prefix,job_id", [
    ("pa", "pb-x-a1"),          # another deployment's delivery
    ("pa", "pa_hb-x-a1"),       # prefix pa-b's, not pa's
    ("pa-b", "pa-b-x-a1"),      # pa's delivery of run "b-x"
    ("mrq", "order-42-a1"),     # the old, unprefixed spelling
    ("mrq", "mrq-x-a0"),        # attempts start at 1
    ("mrq", "mrq-x-a01"),       # a second spelling of attempt 1
    ("mrq", "mrq-x-a"),
    ("mrq", "mrq-x"),
    ("mrq", "mrq--a1"),         # empty run id
    ("mrq", "mrq-a_hb-a1"),     # `-` is never escaped in a run id
    ("mrq", "mrq-a_x-a1"),      # unknown escape
    ("mrq", "mrq-a_-a1"),       # dangling escape
    ("mrq", "mrq-a.b-a1"),      # `.` only escaped
    ("mrq", f"mrq-{'x' * 129}-a1"),  # run ids are at most 128 characters
    ("mrq", "0123456789abcdef0123456789abcdef"),  # an RQ job id
])
def test_parse_delivery_id_refuses_everything_else(prefix: str, job_id: str) -> None:
    assert parse_delivery_id(prefix, job_id) is None


def test_delivery_ids_round_trip_and_never_collide_across_prefixes() -> None:
    """Many generated (prefix, run id, attempt), biased towards the characters that are
    escaped or separate the parts: each id parses back to exactly its delivery under its own
    prefix, to nothing under any other, and no two deliveries share an id."""
    rng = random.Random(20261130)
    prefix_chars, run_chars = "ab_.-9", "ab_.:-a9"
    seen: dict[str, tuple[str, str, int]] = {}
    prefixes = ["".join(rng.choice(prefix_chars) for _ in range(rng.randint(1, 5)))
                for _ in range(40)]
    for _ in range(4000):
        prefix = rng.choice(prefixes)
        run_id = "".join(rng.choice(run_chars) for _ in range(rng.randint(1, 8)))
        attempt = rng.choice([1, 2, 10, 11, 123])
        job_id = delivery_id(prefix, run_id, attempt)
        assert seen.setdefault(job_id, (prefix, run_id, attempt)) == (prefix, run_id, attempt)
        assert parse_delivery_id(prefix, job_id) == (run_id, attempt)
        for other in rng.sample(prefixes, 5):
            if other != prefix:
                assert parse_delivery_id(other, job_id) is None, (prefix, other, job_id)


def test_queue_names_carry_the_prefix() -> None:
    assert rq_queue_name("pa", "default") == "pa.default"
    assert rq_queue_name("p.a", "q-1") == "p.a.q-1"
    assert rq_queue_name("pa", "b") != rq_queue_name("pa.b", "default")


# --------------------------------------------------------------------------------------------
# two deployments on one Redis


@pytest.fixture
def deployments(redis_url: str, tmp_path: Path) -> Iterator[tuple[Procs, Procs]]:
    pa, pb = Procs(redis_url, tmp_path / "pa"), Procs(redis_url, tmp_path / "pb")
    pa.env["MARBLES_PREFIX"], pb.env["MARBLES_PREFIX"] = "pa", "pb"
    try:
        yield pa, pb
    finally:
        pa.stop_all()
        pb.stop_all()
        print(pa.report())
        print(pb.report())


def _view(procs: Procs, prefix: str, run_id: str) -> tuple[str | None, str | None]:
    from marbles_rq.engine.runs import RunStore
    from marbles_rq.store import open_store

    view = RunStore(open_store(procs.url, prefix=prefix)).get(run_id)
    return (None, None) if view is None else (view.status, view.worker)


def _wait_succeeded(procs: Procs, prefix: str, run_id: str) -> None:
    wait_for(lambda: _view(procs, prefix, run_id)[0] == "succeeded", timeout=30,
             what=f"{prefix}'s run {run_id} to succeed", context=procs.report)


def test_two_prefixes_on_one_redis_never_take_each_others_deliveries(
        deployments: tuple[Procs, Procs], redis_url: str) -> None:
    pa, pb = deployments
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    payload = {"steps": 1, "sleep_s": 0.0}
    # pb's runs first: with one shared queue, pa's worker would take them before its own.
    for run_id in ("shared", "only-b"):
        pb.enqueue("chain", payload, run_id)
    for run_id in ("shared", "only-a"):
        pa.enqueue("chain", payload, run_id)
    assert conn.lrange("rq:queue:pb.default", 0, -1) == ["pb-shared-a1", "pb-only-b-a1"]
    assert conn.lrange("rq:queue:pa.default", 0, -1) == ["pa-shared-a1", "pa-only-a-a1"]

    wa = pa.worker()
    for run_id in ("shared", "only-a"):
        _wait_succeeded(pa, "pa", run_id)
        assert _view(pa, "pa", run_id)[1] in wa.names()
    # pa's worker has emptied its queue; pb's runs were never touched.
    for run_id in ("shared", "only-b"):
        assert _view(pb, "pb", run_id) == ("queued", None)
    assert conn.llen("rq:queue:pb.default") == 2
    assert "pb-" not in wa.text()

    wb = pb.worker()
    for run_id in ("shared", "only-b"):
        _wait_succeeded(pb, "pb", run_id)
        assert _view(pb, "pb", run_id)[1] in wb.names()
        # A completed delivery leaves nothing in RQ (the worker cleans it up with its next pop).
        wait_for(lambda r=run_id: not conn.exists(f"rq:job:pb-{r}-a1"), timeout=10,
                 what=f"pb's delivery of {run_id} to be cleaned up", context=pb.report)
    assert "pb-" not in wa.text() and "pa-" not in wb.text()
    assert wa.alive() and wb.alive()


def test_a_delivery_of_another_prefix_planted_in_our_queue_is_refused(
        deployments: tuple[Procs, Procs], redis_url: str) -> None:
    """The worker checks the job id against its own prefix and the job's own arguments."""
    pa, _pb = deployments
    conn = redis.Redis.from_url(redis_url)
    pa.enqueue("chain", {"steps": 1}, "victim")
    conn.delete("rq:queue:pa.default")  # only the forged deliveries below reach the worker
    q = Queue("pa.default", connection=conn, serializer=JSONSerializer)
    forged = [q.enqueue_call(ENTRY, args=("victim", 1), job_id=job_id)
              for job_id in (delivery_id("pb", "victim", 1), delivery_id("pa", "victim", 2),
                             delivery_id("pa", "other", 1), "victim-a1")]
    pa.enqueue("chain", {"steps": 1}, "sentinel")
    worker = pa.worker()
    _wait_succeeded(pa, "pa", "sentinel")
    assert _view(pa, "pa", "victim") == ("queued", None)
    for job in forged:
        job = Job.fetch(job.id, connection=conn, serializer=JSONSerializer)
        assert job.get_status() == "failed", job.id
        result = job.latest_result()
        assert result is not None and "not the id of delivery 1 of run 'victim'" in (
            result.exc_string or ""), job.id
    assert worker.alive()


# --------------------------------------------------------------------------------------------
# planted job fields


MARKER_MODULE = """\
import pathlib
pathlib.Path({dir!r}, "imported").touch()

def hook(*args, **kwargs):
    pathlib.Path({dir!r}, "called").touch()
"""


class Hits(http.server.BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.hits.append(self.path)
        self.send_response(200)
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def planted(redis_url: str, tmp_path: Path) -> Iterator[tuple[Procs, Path, str]]:
    """Procs whose workers can import module `mrk_planted` (which leaves files in the
    returned marker dir when imported or called), and a URL that records webhook hits."""
    mods, markers = tmp_path / "mods", tmp_path / "markers"
    mods.mkdir()
    markers.mkdir()
    (mods / "mrk_planted.py").write_text(MARKER_MODULE.format(dir=str(markers)))
    procs = Procs(redis_url, tmp_path / "procs")
    procs.env["PYTHONPATH"] = os.pathsep.join([str(mods), procs.env.get("PYTHONPATH", "")])
    Hits.hits = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hits)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield procs, markers, f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        procs.stop_all()
        server.shutdown()
        print(procs.report())


def _field_value(field: str, url: str) -> str:
    return {
        "success_callback_name": "mrk_planted.hook",
        "failure_callback_name": "mrk_planted.hook",
        "stopped_callback_name": "mrk_planted.hook",
        "webhooks": json.dumps([{"url": url, "job_status": s, "method": "POST"}
                                for s in ("finished", "failed")]),
        "dependency_ids": json.dumps([delivery_id(PREFIX, "elsewhere", 1)]),
        "dependency_id": delivery_id(PREFIX, "elsewhere", 1),
        "retries_left": "3",
        "retry_intervals": "[0]",
        "repeats_left": "3",
        "repeat_intervals": "[0]",
        "group_id": "planted-group",
        "rate_limit_key": "planted-limit",
        "rate_limit_concurrency": "1",
    }[field]


def _run_through_sentinel(procs: Procs) -> Proc:
    procs.enqueue("chain", {"steps": 1}, "sentinel")
    worker = procs.worker()
    procs.observer.wait_final("sentinel")
    return worker


def _assert_refused(conn: redis.Redis, job_id: str, reason: str) -> None:
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    assert job.get_status() == "failed"
    result = job.latest_result()
    assert result is not None and "refusing job" in (result.exc_string or "")
    assert reason in (result.exc_string or ""), result.exc_string
    assert len(job.results()) == 1  # executed (refused) once: no retry, no repeat
    assert conn.lpos(QUEUE_KEY, job_id) is None


@pytest.mark.parametrize("field", FORBIDDEN_FIELDS)
def test_a_delivery_with_a_planted_field_is_refused(planted: tuple[Procs, Path, str],
                                                    redis_url: str, field: str) -> None:
    procs, markers, url = planted
    conn = redis.Redis.from_url(redis_url)
    procs.enqueue("chain", {"steps": 1}, "victim")
    job_id = delivery_id(PREFIX, "victim", 1)
    conn.hset(f"rq:job:{job_id}", field, _field_value(field, url))
    worker = _run_through_sentinel(procs)

    _assert_refused(conn, job_id, field)
    assert procs.observer.status("victim") == "queued"  # the planted job ran nothing
    assert "attempt_started" not in [e.type for e in procs.observer.events("victim")]
    assert sorted(p.name for p in markers.iterdir()) == []
    assert Hits.hits == []
    assert worker.alive()


def test_a_failing_job_never_imports_its_failure_callback(planted: tuple[Procs, Path, str],
                                                          redis_url: str) -> None:
    """The failure callback is what RQ resolves when a job is refused; it is never
    imported, even for a job that fails."""
    procs, markers, url = planted
    conn = redis.Redis.from_url(redis_url)
    q = Queue(rq_queue_name(PREFIX, "default"), connection=conn, serializer=JSONSerializer)
    job = q.enqueue("os.getcwd")
    conn.hset(job.key, mapping={"failure_callback_name": "mrk_planted.hook",
                                "webhooks": _field_value("webhooks", url)})
    worker = _run_through_sentinel(procs)
    _assert_refused(conn, job.id, "failure_callback_name")
    assert sorted(p.name for p in markers.iterdir()) == []
    assert Hits.hits == []
    assert worker.alive()


def test_an_abandoned_job_in_the_started_registry_never_imports_its_callback(
        planted: tuple[Procs, Path, str], redis_url: str) -> None:
    """RQ's registry cleanup (run by the worker) calls the failure callback of an expired
    job in the started registry, retries it and enqueues its dependents: outside
    MarblesJob._execute. None of that may happen."""
    procs, markers, _url = planted
    conn = redis.Redis.from_url(redis_url)
    q = Queue(rq_queue_name(PREFIX, "default"), connection=conn, serializer=JSONSerializer)
    job = q.enqueue_call("os.getcwd", job_id="abandoned")
    conn.lrem(QUEUE_KEY, 0, job.id)
    conn.hset(job.key, mapping={"failure_callback_name": "mrk_planted.hook",
                                "retries_left": "3", "status": "started"})
    conn.zadd(f"rq:wip:{rq_queue_name(PREFIX, 'default')}", {f"{job.id}:exec1": 1})
    elsewhere = Queue("elsewhere", connection=conn, serializer=JSONSerializer).enqueue_call(
        "os.getcwd", job_id="dependent", depends_on=Dependency(jobs=[job.id],
                                                               allow_failure=True))
    assert elsewhere.get_status() == "deferred"
    worker = _run_through_sentinel(procs)
    wait_for(lambda: conn.zcard(f"rq:wip:{rq_queue_name(PREFIX, 'default')}") == 0,
             timeout=30, what="the worker's registry cleanup", context=procs.report)
    assert sorted(p.name for p in markers.iterdir()) == []
    assert conn.lpos(QUEUE_KEY, job.id) is None  # not retried
    assert conn.llen("rq:queue:elsewhere") == 0  # dependents not enqueued
    assert worker.alive()


def test_dependents_of_a_delivery_are_never_enqueued(planted: tuple[Procs, Path, str],
                                                     redis_url: str) -> None:
    procs, _markers, _url = planted
    conn = redis.Redis.from_url(redis_url)
    procs.enqueue("chain", {"steps": 1}, "parent")
    parent = Job.fetch(delivery_id(PREFIX, "parent", 1), connection=conn,
                       serializer=JSONSerializer)
    dependent = Queue("elsewhere", connection=conn, serializer=JSONSerializer).enqueue_call(
        "os.getcwd", job_id="dependent", depends_on=parent)
    assert dependent.get_status() == "deferred"
    assert conn.smembers(parent.dependents_key) == {b"dependent"}
    worker = _run_through_sentinel(procs)
    assert procs.observer.status("parent") == "succeeded"  # a genuine delivery: it ran
    assert conn.llen("rq:queue:elsewhere") == 0
    assert dependent.get_status(refresh=True) == "deferred"
    assert worker.alive()


def test_stopping_a_delivery_never_imports_a_stopped_callback(
        planted: tuple[Procs, Path, str], redis_url: str) -> None:
    """RQ resolves the stopped callback in the worker when a running job is stopped."""
    procs, markers, _url = planted
    conn = redis.Redis.from_url(redis_url)
    procs.enqueue("chain", {"steps": 2, "sleep_s": 30.0}, "long")
    job_id = delivery_id(PREFIX, "long", 1)
    conn.hset(f"rq:job:{job_id}", "stopped_callback_name", "mrk_planted.hook")
    worker = procs.worker()

    def handled() -> bool:
        started = "attempt_started" in [e.type for e in procs.observer.events("long")]
        return started or conn.hget(f"rq:job:{job_id}", "status") == b"failed"

    wait_for(handled, timeout=30, what="the planted job to start or be refused",
             context=procs.report)
    send_stop_job_command(conn, job_id)
    wait_for(lambda: conn.hget(f"rq:job:{job_id}", "status") in (b"failed", b"stopped"),
             timeout=30, what="the job to end", context=procs.report)
    procs.enqueue("chain", {"steps": 1}, "sentinel")
    procs.observer.wait_final("sentinel")
    assert sorted(p.name for p in markers.iterdir()) == []
    assert worker.alive()


def test_marbles_job_never_resolves_callbacks(redis_url: str, tmp_path: Path) -> None:
    """Whatever path reads a planted job (worker, registries), its callbacks read as None
    without importing anything, and its retry/repeat/webhook/dependency fields are empty."""
    conn = redis.Redis.from_url(redis_url)
    q = Queue("q", connection=conn, serializer=JSONSerializer)
    job = q.enqueue_call("os.getcwd", job_id="planted")
    conn.hset(job.key, mapping={f: _field_value(f, "http://127.0.0.1:9/") for f in
                                FORBIDDEN_FIELDS})
    conn.hset(job.key, "success_callback_name", "no_such_module_xyz.hook")
    loaded = MarblesJob.fetch("planted", connection=conn, serializer=JSONSerializer)
    assert loaded.success_callback is None and loaded.failure_callback is None
    assert loaded.stopped_callback is None
    assert loaded.webhooks == [] and loaded._dependency_ids == []
    assert not loaded.should_retry and loaded.repeats_left is None
    assert not loaded.has_rate_limit and loaded.rate_limit_key is None
    assert set(loaded._marbles_planted) == set(FORBIDDEN_FIELDS)
    assert "no_such_module_xyz" not in sys.modules
