"""A chunk of runs recorded with their first deliveries in one script call (claim_runs, on
one standalone Redis) writes what claim_run writes for each run alone, answers each run as
claim_run would (created, found, refused on a broken index), and is safe to resend."""

from __future__ import annotations

import msgspec
import pytest
import redis
from rq.job import Job

import marbles_rq as mr
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.ops import RunRequest, enqueue_record, enqueue_records, prepare
from marbles_rq.engine.runs import RunStore
from marbles_rq.errors import CorruptRecordError
from marbles_rq.store import open_store
from marbles_rq.store.records import RunRecord
from marbles_rq.transport import dispatch
from marbles_rq.transport.dispatch import rq_connection


@mr.workflow("chunk_item", max_deliveries=5)
def chunk_item(ctx: mr.RunContext, n: int) -> int:
    return n


def _records(prefix: str, count: int) -> list[RunRecord]:
    return [prepare(RunRequest("chunk_item", str(i).encode(), f"{prefix}-{i}"), REGISTRY)
            for i in range(count)]


def _setup(url: str) -> tuple[RunStore, redis.Redis, redis.Redis]:
    return RunStore(open_store(url)), rq_connection(url), redis.Redis.from_url(url)


def _run_fields(r: redis.Redis, runs: RunStore, run_id: str) -> dict[bytes, bytes]:
    fields = r.hgetall(runs.keys.run(run_id))
    for moving in (b"created_ms", b"req"):
        assert fields.pop(moving)
    return fields


def _job_fields(r: redis.Redis, run_id: str) -> dict[bytes, bytes]:
    fields = r.hgetall(f"rq:job:{dispatch.delivery_id('mrq', run_id, 1)}")
    for moving in (b"created_at", b"enqueued_at"):
        assert fields.pop(moving)
    return fields


def test_a_chunk_writes_what_claim_run_writes_for_each_run(redis_url: str) -> None:
    runs, rq, r = _setup(redis_url)
    alone = _records("alone", 1)[0]
    assert enqueue_record(runs, rq, alone).dispatched
    r.config_resetstat()
    chunk = _records("chunk", 3)
    done = enqueue_records(runs, rq, chunk)
    assert [(d.created, d.dispatched) for d in done] == [(True, True)] * 3
    # One script call for the chunk, no transaction of one call per run.
    stats = r.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 1 and "cmdstat_multi" not in stats

    def same(fields: dict[bytes, bytes], run_id: str) -> dict[bytes, bytes]:
        return {k: v.replace(run_id.encode(), b"ID") for k, v in fields.items()}

    expected = same(_run_fields(r, runs, "alone-0"), "alone-0")
    job = same(_job_fields(r, "alone-0"), "alone-0")
    for i, record in enumerate(chunk):
        fields = same(_run_fields(r, runs, record.id), record.id)
        # The input differs (0, 1, 2); everything else is the same as a run recorded alone.
        assert fields.pop(b"doc") != expected[b"doc"] or i == 0
        assert fields == {k: v for k, v in expected.items() if k != b"doc"}
        assert same(_job_fields(r, record.id), record.id) == job
        fetched = Job.fetch(dispatch.delivery_id("mrq", record.id, 1), connection=rq,
                            serializer=dispatch.JSONSerializer)
        assert fetched.args == [record.id, 1] and fetched.get_status() == "queued"
        entries = r.xrange(runs.keys.output(record.id))
        assert [e[1][b"t"] for e in entries] == [b"queued"]
    queue_key = f"rq:queue:{dispatch.rq_queue_name('mrq', 'default')}"
    assert r.lrange(queue_key, 0, -1) == [
        dispatch.delivery_id("mrq", rid, 1).encode()
        for rid in ["alone-0"] + [c.id for c in chunk]]


def test_a_resent_chunk_answers_created_again_and_writes_nothing_twice(
        redis_url: str) -> None:
    runs, _, r = _setup(redis_url)
    records = _records("resend", 4)
    from marbles_rq.transport.first_delivery import FirstDelivery

    pushes = FirstDelivery(rq_connection(redis_url), runs.keys, runs.client)
    assert pushes.shared is not None
    calls = [runs._claim_args(rec) | {"push": dispatch.delivery_push(
        pushes.shared, "mrq", "default", rec.id, 1)} for rec in records]
    first = runs.scripts.claim_runs(calls)
    again = runs.scripts.claim_runs(calls)  # a resend: the same request ids
    assert [x.status for x in first] == [x.status for x in again] == ["ok"] * 4
    assert [x.values for x in first] == [x.values for x in again]
    queue_key = f"rq:queue:{dispatch.rq_queue_name('mrq', 'default')}"
    assert r.llen(queue_key) == 4
    assert all(r.xlen(runs.keys.output(rec.id)) == 1 for rec in records)


def test_found_duplicate_and_broken_runs_are_answered_one_by_one(redis_url: str) -> None:
    runs, rq, r = _setup(redis_url)
    old = _records("mixed-old", 1)[0]
    enqueue_record(runs, rq, old)
    fresh = _records("mixed", 6)
    # A run whose delivery RQ holds already: recorded, its delivery left to the controller.
    held = fresh[1]
    r.hset(f"rq:job:{dispatch.delivery_id('mrq', held.id, 1)}", "status", "queued")
    # A run whose bucket's listing holds another type: refused, nothing of it written.
    broken = next(rec for rec in _records("broken", 50)
                  if runs.keys.bucket_of(rec.id) not in
                  {runs.keys.bucket_of(x.id) for x in [old, *fresh]})
    r.set(runs.keys.listing("run", runs.keys.bucket_of(broken.id)), "x")
    chunk = [fresh[0], held, old, fresh[2], fresh[2], broken, fresh[3]]
    # The broken run is raised (after the chunk was written, as claim_run's replies were).
    with pytest.raises(CorruptRecordError, match="holds a string"):
        enqueue_records(runs, rq, chunk)
    # Every other run of the chunk was recorded and enqueued (or left to the controller).
    for rec in (fresh[0], fresh[2], fresh[3]):
        assert r.hget(runs.keys.run(rec.id), "enq") == b"1"
    assert r.hget(runs.keys.run(held.id), "enq") is None
    assert r.zscore(runs.keys.run_dispatch(runs.keys.bucket_of(held.id)), held.id)
    assert r.exists(runs.keys.run(broken.id), runs.keys.output(broken.id)) == 0
    # The earlier run is found, not written again; the id given twice is recorded once.
    assert r.xlen(runs.keys.output(old.id)) == 1 and r.xlen(runs.keys.output(fresh[2].id)) == 1
    r.delete(runs.keys.listing("run", runs.keys.bucket_of(broken.id)))
    again = enqueue_records(runs, rq, [old, fresh[2], broken])
    assert [(d.created, d.status) for d in again] == [
        (False, "queued"), (False, "queued"), (True, "queued")]
    assert bytes(again[0].record.input) == bytes(old.input)
    assert msgspec.json.decode(r.hget(runs.keys.run(broken.id), "doc"))["id"] == broken.id


def test_a_chunk_of_large_records_is_sent_one_claim_run_each(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from marbles_rq.store import scripts

    runs, rq, r = _setup(redis_url)
    enqueue_record(runs, rq, _records("large-warm", 1)[0])  # claim_run in the script cache
    records = _records("large", 3)
    monkeypatch.setattr(scripts, "CHUNK_SCRIPT_BYTES", sum(len(x.id) for x in records))
    r.config_resetstat()
    done = enqueue_records(runs, rq, records)
    assert [(d.created, d.dispatched) for d in done] == [(True, True)] * 3
    stats = r.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 3 and stats["cmdstat_multi"]["calls"] == 1
    assert all(r.hget(runs.keys.run(x.id), "enq") == b"1" for x in records)
