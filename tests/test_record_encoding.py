"""Records leave out the fields that hold their defaults, and read back the texts written
before they did (every field spelled out): a deployment's stored runs, ledgers, questions
and receipts stay readable, and a run recorded in the earlier format runs to the end."""

from __future__ import annotations

import msgspec
import pytest
import redis

import marbles_rq as mr
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.execute import execute
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.store.records import (
    AskRecord,
    EffectReceipt,
    Record,
    ReportRecord,
    RunRecord,
    StepRecord,
    decode,
    encode,
)

# Written by the encoder before defaults were left out (every field, in declaration order).
EARLIER = {
    RunRecord: (
        b'{"kind":"run","version":1,"id":"r-1","name":"orders","queue":"default",'
        b'"input":{"n":1},"requested_at_ms":1796186270277,"timeout_s":0.0,'
        b'"max_deliveries":20,"retention_s":604800.0,"parent":"","origin":"","rerun_of":"",'
        b'"rerun_from_step":"","priority":0,"concurrency":0,"concurrency_label":"",'
        b'"not_before_ms":0,"traceparent":""}',
        RunRecord(version=1, id="r-1", name="orders", queue="default",
                  input=msgspec.Raw(b'{"n":1}'), requested_at_ms=1796186270277)),
    StepRecord: (
        b'{"kind":"step","version":1,"key":"orders.tick#0","name":"tick","status":"succeeded",'
        b'"attempts":1,"result":0,"error":null,"at_ms":1796186270873,"seq":0,"args":"",'
        b'"epoch":1,"wseq":1}',
        StepRecord(version=1, key="orders.tick#0", name="tick", status="succeeded",
                   attempts=1, result=msgspec.Raw(b"0"), at_ms=1796186270873, seq=0,
                   epoch=1, wseq=1)),
    AskRecord: (
        b'{"kind":"ask","version":1,"key":"ask:0","ask":"question","title":"Go on?",'
        b'"body":null,"choices":["yes","no"],"step":"orders","timeout_s":0.0,'
        b'"default":null,"has_default":false}',
        AskRecord(version=1, key="ask:0", ask="question", title="Go on?",
                  choices=["yes", "no"], step="orders")),
    EffectReceipt: (
        b'{"kind":"effect","version":1,"scope":"r-1","key":"charge","at_ms":1796186270873,'
        b'"meta":null}',
        EffectReceipt(version=1, scope="r-1", key="charge", at_ms=1796186270873)),
    ReportRecord: (
        b'{"kind":"report","version":1,"key":"m1","report":"milestone","entry":{"done":1},'
        b'"step":"","at_ms":5}',
        ReportRecord(version=1, key="m1", report="milestone",
                     entry=msgspec.Raw(b'{"done":1}'), at_ms=5)),
}


def _same(a: Record, b: Record) -> bool:
    # msgspec.Raw compares by identity; its bytes are what is stored.
    return {k: bytes(v) if isinstance(v, msgspec.Raw) else v
            for k, v in msgspec.structs.asdict(a).items()} == {
        k: bytes(v) if isinstance(v, msgspec.Raw) else v
        for k, v in msgspec.structs.asdict(b).items()}


@pytest.mark.parametrize("cls", list(EARLIER), ids=lambda c: c.__name__)
def test_a_record_in_the_earlier_format_reads_as_the_same_record(cls: type[Record]) -> None:
    text, record = EARLIER[cls]
    assert _same(decode(cls, text, "k"), record)
    # Written again it is shorter, and reads back the same.
    now = encode(record)
    assert len(now) < len(text)
    assert _same(decode(cls, now, "k"), record)


def test_defaults_are_left_out_and_the_kind_and_version_are_kept() -> None:
    text = encode(EARLIER[RunRecord][1])
    assert text == (b'{"kind":"run","version":1,"id":"r-1","name":"orders",'
                    b'"queue":"default","input":{"n":1},"requested_at_ms":1796186270277}')
    # A field set to anything but its default is written.
    other = msgspec.structs.replace(EARLIER[RunRecord][1], max_deliveries=3, parent="p")
    assert b'"max_deliveries":3' in encode(other) and b'"parent":"p"' in encode(other)
    # A float equal to its default is left out however it was made (msgspec compares
    # floats by identity): a workflow's settings are computed, not the default's object.
    computed = msgspec.structs.replace(EARLIER[RunRecord][1], timeout_s=float("0"),
                                       retention_s=float(7 * 86400))
    assert encode(computed) == text
    assert b'"result":null' not in encode(EARLIER[StepRecord][1])
    assert b'"result":0' in encode(EARLIER[StepRecord][1])


@mr.workflow("enc_earlier", max_deliveries=7)
def enc_earlier(ctx: mr.RunContext, n: int) -> int:
    return int(ctx.step(lambda: n + 1))


def test_a_run_recorded_in_the_earlier_format_executes_and_reads_back(redis_url: str) -> None:
    runs = RunStore(open_store(redis_url))
    client = redis.Redis.from_url(redis_url)
    run_id = "enc-earlier-1"
    record = prepare(RunRequest("enc_earlier", b"41", run_id), REGISTRY)
    # The run's hash as it was recorded before: its record with every field spelled out.
    earlier = msgspec.json.encode({"kind": "run"} | msgspec.structs.asdict(record))
    assert b'"parent":""' in earlier and b'"max_deliveries":7' in earlier
    args = runs._claim_args(record) | {"doc": earlier}
    assert runs.scripts.claim_run(**args).status == "ok"
    assert client.hget(runs.keys.run(run_id), "doc") == earlier

    status = execute(runs, REGISTRY, run_id, 1, worker="w", lease_ms=60_000, hard_exit=False)
    assert status == "succeeded"
    view = runs.get(run_id)
    assert view is not None and view.status == "succeeded"
    assert view.result is not None and bytes(view.result) == b"42"
    assert view.record.max_deliveries == 7 and view.record.parent == ""
    assert bytes(view.record.input) == b"41"
