"""The client used carelessly or unluckily: Python values JSON has no form for, NaN and
infinite numbers, Redis killed while a call waits, one asyncio client driven from two event
loops. Each is a typed MarblesError (or simply works) and writes nothing; never a
redis-py exception, a ValueError from int(), or "Event loop is closed"."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.engine.authoring import InputError
from marbles_rq.engine.ops import InputTooDeepError, PayloadTooLargeError
from marbles_rq.engine.signals import InvalidSignalError
from marbles_rq.engine.waits import AnswerRefusedError
from marbles_rq.errors import ConfigError, InvalidIdError, RedisUnavailableError
from tests.procs import CHAIN_SOURCE, REPO_ROOT, Procs, db_contents, wait_for
from tests.redis_procs import RedisServer

CLIENT_SOURCE = REPO_ROOT / "tests" / "client_workflows.py"
PROCS_SOURCES = (CLIENT_SOURCE, CHAIN_SOURCE)


def _deep(levels: int) -> list[Any]:
    top: list[Any] = []
    cur = top
    for _ in range(levels):
        cur.append([])
        cur = cur[0]
    return top


def _blocked(server: RedisServer) -> bool:
    return int(server.client().info("clients")["blocked_clients"]) >= 1


def test_values_json_cannot_hold_are_refused_typed_with_nothing_written(
        redis_server: RedisServer) -> None:
    client = mr.connect(redis_server.url, source=str(CLIENT_SOURCE))
    run = client.start("cl_slow", {"steps": 1})  # no worker: it stays queued
    keys = redis_server.client(decode_responses=False)
    before = db_contents(keys)
    with pytest.raises(InputError):
        client.start("cl_fail", {"when": object()})
    with pytest.raises(InputTooDeepError):
        client.start("cl_fail", {"deep": _deep(5000)})
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(InputError):
            client.start("cl_slow", {"steps": 1}, start_at=bad)
        with pytest.raises(InputError):
            client.runs(since=bad)
        with pytest.raises(InputError):
            run.wait_for("k", timeout=bad)
    with pytest.raises(InputError):
        run.result(timeout=float("nan"))
    with pytest.raises(InputError):
        run.result(timeout="3")  # type: ignore[arg-type]
    with pytest.raises(InputError):
        client.runs(limit="5")  # type: ignore[arg-type]
    with pytest.raises(InvalidIdError):
        client.output(run.id, after="junk")
    with pytest.raises(InputError):  # a typo listed no run at all, as if none had failed
        client.runs(status="faild")
    with pytest.raises(InputError):
        client.start(5, {})  # type: ignore[arg-type]
    with pytest.raises(InvalidSignalError):
        run.signal("go", _deep(5000))
    # NaN and infinities: msgspec would write null, and the value would change on its way.
    for bad in (float("nan"), float("inf")):
        with pytest.raises(InputError, match="NaN or an infinity"):
            client.start("cl_fail", {"rate": [1.0, bad]})
        with pytest.raises(InvalidSignalError, match="NaN or an infinity"):
            run.signal("go", {"x": bad})
        with pytest.raises(InputError, match="NaN or an infinity"):
            client.send_event("cl-shop", "e-nan", type="paid", payload={"amount": bad})
    for limit in (-1, 0, 1001):
        with pytest.raises(InputError, match="limit must be 1 to 1000"):
            client.feed(limit)
        with pytest.raises(InputError, match="limit must be 1 to 1000"):
            client.reports(limit)
    # One bad request of a batch: none starts, and the error says which one.
    batch = [mr.StartRequest("cl_slow", {"steps": 1}) for _ in range(3)]
    batch.insert(2, mr.StartRequest("cl_slow", {"steps": float("nan")}))
    with pytest.raises(InputError, match=r"^request 2: input cannot be sent as JSON"):
        client.start_many(batch)
    assert db_contents(keys) == before
    assert client.start("cl_fail", {"rate": [1.0, None]}).created  # a real null is fine
    # An infinite timeout waits without end, as None does: here until the run is cancelled.
    threading.Thread(target=lambda: wait_for(lambda: _blocked(redis_server), timeout=30,
                                             what="result() blocked") and run.cancel()).start()
    with pytest.raises(mr.RunCancelledError):
        run.result(timeout=float("inf"))

    async def main() -> None:
        async with mr.connect_async(redis_server.url, source=str(CLIENT_SOURCE)) as aclient:
            with pytest.raises(InputError):
                await aclient.result(run.id, timeout=float("nan"))
            with pytest.raises(InputError):
                await aclient.wait_for(run.id, "k", timeout=float("inf"))

    asyncio.run(main())


def test_redis_killed_while_a_call_waits_is_a_typed_error(redis_server: RedisServer) -> None:
    client = mr.connect(redis_server.url, source=str(CLIENT_SOURCE))
    run = client.start("cl_slow", {"steps": 1})

    def kill_when_blocked() -> None:
        wait_for(lambda: _blocked(redis_server), timeout=30, what="result() blocked")
        os.kill(redis_server.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_blocked)
    killer.start()
    with pytest.raises(RedisUnavailableError):
        run.result(timeout=60)
    killer.join()
    for call in (run.status, lambda: run.signal("go", 1), lambda: run.get("k"), run.cancel,
                 lambda: client.start("cl_slow", {"steps": 1}), client.runs,
                 lambda: list(run.watch(follow=False))):
        with pytest.raises(RedisUnavailableError) as caught:
            call()
        assert "\n" not in str(caught.value) and redis_server.url.split("//")[1].split(
            "/")[0] in str(caught.value)

    async def main() -> None:
        aclient = mr.connect_async(redis_server.url, source=str(CLIENT_SOURCE))
        for call in (lambda: aclient.result(run.id, timeout=1), lambda: aclient.status(run.id),
                     lambda: aclient.output(run.id)):
            with pytest.raises(RedisUnavailableError):
                await call()

    asyncio.run(main())


def test_the_asyncio_client_from_two_event_loops(redis_server: RedisServer) -> None:
    """asyncio.run twice (a script, a test suite) and a loop in another thread share one
    AsyncClient: each loop gets its own redis.asyncio connections."""
    aclient = mr.connect_async(redis_server.url, source=str(CLIENT_SOURCE))

    async def once() -> str:
        run = await aclient.start("cl_slow", {"steps": 1})
        with pytest.raises(mr.ResultTimeoutError):
            await run.result(timeout=0.2)
        types = [e.type async for e in run.watch(follow=False)]
        return types[0]

    assert asyncio.run(once()) == "queued"
    assert asyncio.run(once()) == "queued"
    seen: list[Any] = []
    thread = threading.Thread(target=lambda: seen.append(asyncio.run(once())))
    thread.start()
    thread.join()
    assert seen == ["queued"]


def test_answers_of_the_wrong_kind_are_refused_typed_with_nothing_written(
        procs: Procs) -> None:
    """A note that is not text, or larger than MARBLES_MAX_PAYLOAD, is refused as an input
    would be (it was stored whatever its size, or failed with TypeError/RecursionError)."""
    procs.worker()
    client = mr.connect(procs.url, source=str(CLIENT_SOURCE))
    run = client.start("cl_approval", id="appr")
    wait_for(lambda: any(q.run == "appr" for q in client.feed()), timeout=30,
             what="the approval in the feed")
    keys = procs.observer.runs.client
    # The park is written before the worker drops its RQ job: wait for that too, or the
    # snapshot catches the transport mid-cleanup (seen in CI).
    wait_for(lambda: not keys.keys("rq:*job*") and not keys.keys("rq:*intermediate*"),
             timeout=30, what="the worker done with the delivery")
    before = db_contents(keys)
    with pytest.raises(InputError):
        run.approve("ship", note=object())  # type: ignore[arg-type]
    with pytest.raises(InputError):
        run.reject("ship", note=_deep(5000))  # type: ignore[arg-type]
    with pytest.raises(PayloadTooLargeError):
        run.approve("ship", note="x" * (2 << 20))
    with pytest.raises(AnswerRefusedError):
        run.answer("ship", _deep(5000))  # an approval: approve or reject it
    assert db_contents(keys) == before
    run.approve("ship", note="ok")
    assert run.result(timeout=30) == {"approved": True, "note": "ok"}


def test_run_status_holds_everything_status_json_shows(redis_server: RedisServer) -> None:
    """`client.status()` (and GET /api/runs/{id}, which encodes it) is documented as the
    data of `status --json`: no field of that document may be dropped (signals were)."""
    client = mr.connect(redis_server.url, source=str(CLIENT_SOURCE))
    run = client.start("cl_slow", {"steps": 1})
    run.signal("go", 1)
    run.signal("go", 2)
    document = client.status_json(run.id)
    typed = msgspec.to_builtins(client.status(run.id))
    assert set(document) <= set(typed), set(document) - set(typed)
    assert typed["signals"] == document["signals"] == {
        "go": {"sent": 2, "taken": 0, "buffered": 2}}


def test_start_many_answers_each_request_of_a_repeated_id(redis_server: RedisServer) -> None:
    """One id twice in a batch, once to start now and once later: one run, and the request
    that recorded it says created (both said False: the answers were kept by id)."""
    client = mr.connect(redis_server.url, source=str(CLIENT_SOURCE))
    later = time.time() + 3600
    handles = client.start_many([
        mr.StartRequest("cl_slow", {"steps": 1}, id="twice"),
        mr.StartRequest("cl_slow", {"steps": 1}, id="twice", start_at=later),
        mr.StartRequest("cl_slow", {"steps": 1}, id="later-once", start_at=later)])
    assert [(h.id, h.created) for h in handles] == [
        ("twice", True), ("twice", False), ("later-once", True)]
    assert client.status("twice").start_at is None


def test_connect_refuses_a_malformed_url_at_once() -> None:
    """docs/client.md: a malformed setting raises ConfigError at once (it did at the first
    call); nothing touches the network."""
    for url in ("http://127.0.0.1:6379/0", "redis://", "redis://:pa#ss@127.0.0.1/0"):
        with pytest.raises(ConfigError):
            mr.connect(url)
        with pytest.raises(ConfigError):
            mr.connect("redis://127.0.0.1:1/0", rq_url=url)
    mr.connect("redis://127.0.0.1:1/0")  # well formed: nothing is reached yet
