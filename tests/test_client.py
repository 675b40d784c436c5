"""The public client (`mr.connect`, `mr.connect_async`) against a real redis-server, real
workers and a real controller: start, idempotent start, result (blocking on the output
stream), typed errors, status, runs, answers, and the asyncio twin inside a Starlette app."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.engine.authoring import InputError, UnknownWorkflowError
from marbles_rq.engine.execution import RunNotFoundError
from marbles_rq.engine.ops import PayloadTooLargeError
from marbles_rq.engine.waits import AlreadyAnsweredError
from marbles_rq.errors import InvalidIdError, RunSettledError
from tests.procs import CHAIN_SOURCE, REPO_ROOT, Procs, wait_for

CLIENT_SOURCE = REPO_ROOT / "tests" / "client_workflows.py"
PROCS_SOURCES = (CLIENT_SOURCE, CHAIN_SOURCE)


@pytest.fixture
def client(procs: Procs) -> mr.Client:
    c = mr.connect(procs.url, source=str(CLIENT_SOURCE))
    yield c
    c.close()


def _keys(procs: Procs) -> set[bytes]:
    return set(procs.observer.runs.client.keys("*"))


def test_start_and_result_of_a_workflow_known_here(procs: Procs, client: mr.Client) -> None:
    from tests.client_workflows import Order, cl_order

    procs.worker()
    run = client.start(cl_order, Order("abc", 2), id="order-1")
    assert run.id == "order-1" and run.created is True
    assert run.result(timeout=30) == {"sku": "abc", "total": 600}
    status = run.status()
    assert isinstance(status, mr.RunStatus)
    assert status.status == "succeeded" and status.finished and status.attempt == 1
    assert [s.name for s in status.steps] == ["cl_price"]
    # The same id again: the first run, said so, nothing started.
    again = client.start("cl_order", {"sku": "zzz"}, id="order-1")
    assert again.created is False and again.result(timeout=5) == {"sku": "abc", "total": 600}
    # status() is `status --json`'s data.
    cli = json.loads(procs.cli("status", "order-1", "--json").stdout)
    assert msgspec.convert(cli, mr.RunStatus) == status


def test_a_caller_without_the_workflow_code_starts_it_by_name(procs: Procs) -> None:
    """Another service: no source imported; the workers' declarations give the run its
    defaults, and the input goes as JSON for the worker to check."""
    procs.worker()
    script = ("import marbles_rq as mr, sys\n"
              "c = mr.connect()\n"
              "run = c.start('cl_order', {'sku': 'abcd'}, id='by-name')\n"
              "print(run.result(timeout=30)['total'])\n"
              "try:\n"
              "    c.start('nope', {})\n"
              "except mr.MarblesError as exc:\n"
              "    print(type(exc).__name__, exc.code)\n"
              # Omitted inputs take the defaults the workers declared (a string, an object).
              "print(c.start('cl_greet').result(timeout=30))\n"
              "print(c.start('cl_settings').result(timeout=30))\n"
              "print(c.start('cl_greet', 'you').result(timeout=30))\n")
    env = {k: v for k, v in procs.env.items() if k != "MARBLES_SOURCE"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:5] == ["400", "UnknownWorkflowError unknown_workflow",
                                            "hello world", "{'n': 2}", "hello you"]
    assert procs.observer.view("by-name").record.queue == "default"


def test_result_raises_the_runs_error_typed(procs: Procs, client: mr.Client) -> None:
    procs.worker()
    run = client.start("cl_fail", {"message": "no stock"})
    with pytest.raises(mr.RunFailedError) as caught:
        run.result(timeout=30)
    assert caught.value.error["type"] == "ValueError"
    assert caught.value.error["message"] == "no stock"
    assert caught.value.run_id == run.id and caught.value.code == "run_failed"


def test_result_timeout_cancel_and_missing(procs: Procs, client: mr.Client) -> None:
    run = client.start("cl_slow", {"steps": 2, "sleep_s": 0.1})  # no worker yet
    with pytest.raises(mr.ResultTimeoutError):
        run.result(timeout=0.3)
    assert run.cancel().outcome == "cancelled"
    with pytest.raises(mr.RunCancelledError):
        run.result(timeout=5)
    with pytest.raises(RunSettledError):
        run.pause()
    with pytest.raises(RunNotFoundError):
        client.handle("no-such-run").result(timeout=1)
    with pytest.raises(RunNotFoundError):
        client.status("no-such-run")
    with pytest.raises(InvalidIdError):
        client.handle("bad id with spaces")


def test_bad_input_is_refused_with_nothing_written(procs: Procs, client: mr.Client) -> None:
    before = _keys(procs)
    with pytest.raises(InputError):
        client.start("cl_order", {"sku": "a", "colour": "red"})  # an unknown field
    with pytest.raises(InputError):
        client.start("cl_order", {"qty": 2})  # a required field missing
    with pytest.raises(InputError):
        client.start("cl_order", input_json=b"{not json")
    with pytest.raises(PayloadTooLargeError):
        client.start("cl_order", {"sku": "x" * (2 << 20)})
    with pytest.raises(UnknownWorkflowError):
        client.start("no_such_workflow", {})
    with pytest.raises(InvalidIdError):
        client.start("cl_order", {"sku": "a"}, id="")
    with pytest.raises(InputError):
        client.start("cl_order", {"sku": "a"}, priority=1000)
    assert _keys(procs) == before


def test_result_returns_for_a_run_redelivered_twice(procs: Procs, client: mr.Client) -> None:
    """kill -9 the worker twice while the run executes; `result()` (already waiting)
    returns its result once a third delivery finishes it."""
    procs.controller(lease_ms=2000)
    run = client.start("cl_slow", {"steps": 40, "sleep_s": 0.2}, id="twice")
    got: list[object] = []

    import threading

    waiter = threading.Thread(target=lambda: got.append(run.result(timeout=120)))
    waiter.start()
    for attempt in (1, 2):
        worker = procs.worker(lease_ms=2000)
        procs.observer.wait_event("twice", lambda e, a=attempt: e.type == "step_succeeded"
                                  and e.attempt == a, what=f"a step of attempt {attempt}",
                                  timeout=60)
        worker.kill9()
    procs.worker(lease_ms=2000)
    waiter.join(timeout=150)
    assert got == [sum(range(40))]
    assert client.status("twice").attempt == 3


def test_answers_pause_and_resume_through_the_client(procs: Procs, client: mr.Client) -> None:
    procs.worker()
    run = client.start("cl_approval", id="appr")
    wait_for(lambda: any(q.run == "appr" for q in client.feed()), timeout=30,
             what="the approval in the feed")
    assert run.pause().outcome == "paused"
    assert run.resume().outcome == "woken"
    wait_for(lambda: client.status("appr").status == "waiting" or None, timeout=30,
             what="the run waiting again")
    done = run.approve("ship", note="go")
    assert done.outcome == "answered" and "approved" in done.message
    with pytest.raises(AlreadyAnsweredError):
        run.reject("ship")
    assert run.result(timeout=30) == {"approved": True, "note": "go"}


def test_start_many_and_the_runs_pages(procs: Procs, client: mr.Client) -> None:
    handles = client.start_many([mr.StartRequest("cl_order", {"sku": f"s{i}"}, id=f"m-{i}")
                                 for i in range(7)])
    assert [h.id for h in handles] == [f"m-{i}" for i in range(7)]
    assert all(h.created for h in handles)
    with pytest.raises(InputError):  # one bad request starts none
        client.start_many([mr.StartRequest("cl_order", {"sku": "ok"}, id="m-new"),
                           mr.StartRequest("cl_order", {"qty": 1}, id="m-bad")])
    assert procs.observer.view("m-new") is None
    seen: list[str] = []
    cursor = None
    while True:
        page = client.runs(workflow="cl_order", limit=3, cursor=cursor)
        seen += [r.id for r in page.runs]
        if page.cursor is None:
            break
        cursor = page.cursor
    assert sorted(seen) == sorted(h.id for h in handles)
    with pytest.raises(InvalidIdError):
        client.runs(cursor="garbage")


def test_watch_yields_the_output_to_the_final_entry(procs: Procs, client: mr.Client) -> None:
    procs.worker()
    run = client.start("cl_slow", {"steps": 3, "sleep_s": 0.05})
    types = [e.type for e in run.watch()]
    assert types[-1] == "final" and types.count("step_succeeded") == 3


def test_the_asyncio_client_in_a_starlette_app(procs: Procs) -> None:
    """Concurrent requests, each starting a run and awaiting its result, on one event loop."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    procs.worker(pool=2)
    aclient = mr.connect_async(procs.url, source=str(CLIENT_SOURCE))

    async def order(request: Request) -> JSONResponse:
        body = await request.json()
        run = await aclient.start("cl_order", body, id=f"web-{body['sku']}")
        return JSONResponse({"id": run.id, "result": await run.result(timeout=60)})

    app = Starlette(routes=[Route("/order", order, methods=["POST"])])

    async def main() -> list[dict[str, object]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            replies = await asyncio.gather(*[http.post("/order", json={"sku": "x" * i})
                                             for i in range(1, 21)])
        await aclient.aclose()
        return [r.json() for r in replies]

    results = asyncio.run(main())
    assert [r["result"]["total"] for r in results] == [i * 100 for i in range(1, 21)]


def test_the_asyncio_client_raises_the_same_errors(procs: Procs) -> None:
    async def main() -> None:
        async with mr.connect_async(procs.url, source=str(CLIENT_SOURCE)) as aclient:
            run = await aclient.start("cl_slow", {"steps": 1})
            with pytest.raises(mr.ResultTimeoutError):
                await run.result(timeout=0.2)
            assert (await run.cancel()).outcome == "cancelled"
            with pytest.raises(mr.RunCancelledError):
                await run.result(timeout=5)
            with pytest.raises(RunNotFoundError):
                await aclient.handle("nope").result(timeout=1)
            with pytest.raises(InputError):
                await aclient.start("cl_order", {"qty": 1})

    asyncio.run(main())


def test_connect_reads_the_clis_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARBLES_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("MARBLES_PREFIX", "other")
    client = mr.connect()
    assert client.settings.redis_url == "redis://127.0.0.1:1/0"
    assert client.settings.prefix == "other"
    monkeypatch.setenv("MARBLES_BUCKETS", "many")
    with pytest.raises(mr.MarblesError, match="MARBLES_BUCKETS"):
        mr.connect()
    assert os.environ["MARBLES_PREFIX"] == "other"


def test_start_at_records_now_and_starts_then(procs: Procs, client: mr.Client) -> None:
    import datetime as dt

    procs.worker()
    procs.controller()
    when = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
    run = client.start("cl_order", {"sku": "later"}, start_at=when)
    assert run.dispatched is False
    status = run.status()
    assert status.status == "queued" and status.start_at is not None
    assert run.result(timeout=30) == {"sku": "later", "total": 500}
    view = procs.observer.view(run.id)
    assert view is not None and view.started_ms is not None
    assert view.started_ms >= int(when.timestamp() * 1000)  # never before its start
    with pytest.raises(InputError, match="timezone-aware"):
        client.start("cl_order", {"sku": "a"}, start_at=dt.datetime(2030, 1, 1))
    with pytest.raises(InputError, match="ten years"):
        client.start("cl_order", {"sku": "a"}, start_at=when + dt.timedelta(days=4000))
    done = procs.cli("enqueue", "cl_order", "--input", '{"sku": "b"}', "--start-at", "+1h",
                     "--id", "cli-later")
    assert done.returncode == 0 and "it starts at" in done.stdout, done.stderr
    bad = procs.cli("enqueue", "cl_order", "--input", '{"sku": "b"}', "--start-at",
                    "tomorrow")
    assert bad.returncode == 2 and "invalid start time" in bad.stderr


def test_events_and_reruns_through_the_client(procs: Procs, client: mr.Client) -> None:
    procs.worker()
    sent = client.send_event("cl-shop", "order-77", "paid", {"amount": 12})
    assert sent.created and sent.workflow == "cl_on_paid"
    assert client.handle(sent.run_id).result(timeout=30) == {"paid": {"amount": 12}}
    again = client.send_event("cl-shop", "order-77", "paid", {"amount": 99})
    assert not again.created and again.run_id == sent.run_id
    with pytest.raises(InputError):
        client.send_event("cl-shop", "order-78", "paid", payload_json=b"{nope")
    first = client.start("cl_order", {"sku": "re"}, id="to-rerun")
    first.result(timeout=30)
    rerun = client.rerun("to-rerun", new_id="rerun-1")
    assert rerun.run_id == "rerun-1" and rerun.created
    assert client.handle("rerun-1").result(timeout=30) == {"sku": "re", "total": 200}
    assert client.status("rerun-1").rerun_of == "to-rerun"


def test_published_state_through_the_client(procs: Procs, client: mr.Client) -> None:
    from marbles_rq.engine.published import NotPublishedError, PublishedWaitTimeoutError

    run = client.start("cl_publish", {"sleep_s": 0.5})
    with pytest.raises(PublishedWaitTimeoutError):  # no worker yet: nothing published
        run.wait_for("stage", timeout=0.3)
    procs.worker()
    assert run.wait_for("stage", timeout=30) in ("started", "done")
    assert run.result(timeout=30) == "ok"
    assert run.get("stage") == "done" and run.status().published == {"stage": "done"}
    with pytest.raises(NotPublishedError):
        run.get("other")
    with pytest.raises(NotPublishedError):  # finished without it: at once, not at the timeout
        run.wait_for("other", timeout=30)

    async def main() -> None:
        async with mr.connect_async(procs.url) as aclient:
            handle = aclient.handle(run.id)
            assert await handle.get("stage") == "done"
            assert await handle.wait_for("stage", timeout=5) == "done"
            with pytest.raises(NotPublishedError):
                await handle.wait_for("other", timeout=30)

    asyncio.run(main())


def test_signals_and_signal_with_start_through_the_client(procs: Procs,
                                                          client: mr.Client) -> None:
    from marbles_rq.engine.signals import InvalidSignalError

    procs.worker()
    run = client.start("cl_signal", id="sig-1")
    first = run.signal("go", {"n": 1})
    assert first.seq == 1
    run.signal("go", {"n": 2})
    assert run.result(timeout=30) == [{"n": 1}, {"n": 2}]
    with pytest.raises(RunSettledError):
        run.signal("go", 3)
    with pytest.raises(RunNotFoundError):
        client.signal("no-such-run", "go")
    with pytest.raises(InvalidSignalError):
        client.signal("sig-1", "bad|name")
    # Signal-with-start: the first call creates the run with its signal, the second finds it.
    a = client.start("cl_signal", id="sig-2", signal=("go", "a"))
    b = client.start("cl_signal", id="sig-2", signal=("go", "b"))
    assert (a.created, b.created) == (True, False)
    assert a.result(timeout=30) == ["a", "b"]
    with pytest.raises(InputError):
        client.start("cl_signal", signal=("go", 1))  # no id: nothing makes it idempotent

    async def main() -> None:
        async with mr.connect_async(procs.url) as aclient:
            handle = await aclient.start("cl_signal", id="sig-3", signal=("go", 1))
            await handle.signal("go", 2)
            assert await handle.result(timeout=30) == [1, 2]

    asyncio.run(main())
