"""The HTTP API of `marbles-rq web` (/api/), driven with plain `curl` as a service in another
language would, against a real redis-server, a real worker and the real `marbles-rq web`
process: start, long-poll the result, status, cancel, answer an approval, pages of runs,
the output as server-sent events; and every refusal (token, size, JSON, unknown workflow,
bad ids) with nothing recorded."""

from __future__ import annotations

import json
import re
import subprocess
import time
from typing import Any

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.deployment import Settings
from marbles_rq.engine.history import from_line
from marbles_rq.web.app import create_app
from marbles_rq.web.security import Guard
from tests.procs import REPO_ROOT, Procs, wait_for
from tests.web_stack import Web, dump_keys, start_web

CLIENT_SOURCE = REPO_ROOT / "tests" / "client_workflows.py"
PROCS_SOURCES = [CLIENT_SOURCE]
API_TOKEN = "api-token-0123456789abcdef-xyz"


class Reply:
    def __init__(self, status: int, body: bytes, headers: str) -> None:
        self.status, self.body, self.headers = status, body, headers

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self) -> dict[str, str]:
        """The refusal's one JSON object, checked for its shape."""
        doc = self.json()
        assert set(doc) == {"error"} and set(doc["error"]) == {"code", "message"}, doc
        assert doc["error"]["message"] and "\n" not in doc["error"]["message"]
        return dict(doc["error"])


def curl(web: Web, method: str, path: str, body: Any = None, *, token: str | None = API_TOKEN,
         raw: bytes | None = None, headers: dict[str, str] | None = None,
         timeout: float = 90, may_reset: bool = False) -> Reply:
    """One request with the curl binary: what a shell script or another language does.
    `may_reset`: the server may close the connection while curl still sends (a chunked
    body refused as it passes the limit), after its answer."""
    argv = ["curl", "-sS", "-X", method, "-D", "/dev/stderr", "-o", "-", "-w", "\n%{http_code}",
            "--max-time", str(timeout), web.url + path]
    if token is not None:
        argv += ["-H", f"Authorization: Bearer {token}"]
    for name, value in (headers or {}).items():
        argv += ["-H", f"{name}: {value}"]
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    if data is not None:
        argv += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
    done = subprocess.run(argv, input=data, capture_output=True, timeout=timeout + 10)
    assert done.returncode == 0 or (may_reset and done.returncode in (55, 56)), done.stderr
    payload, _, status = done.stdout.rpartition(b"\n")
    return Reply(int(status), payload, done.stderr.decode("latin-1"))


def sse_events(text: str) -> list[dict[str, str]]:
    events, current = [], {}
    for line in text.split("\n"):
        if not line:
            if current:
                events.append(current)
            current = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            current[name] = value
    return [e for e in events if "data" in e]


@pytest.fixture
def web(procs: Procs) -> Web:
    return start_web(procs, extra_env={"MARBLES_API_TOKEN": API_TOKEN})


def test_a_service_drives_the_api_with_curl(procs: Procs, web: Web) -> None:
    procs.worker(pool=2)
    procs.controller()
    start = {"workflow": "cl_order", "input": {"sku": "abc", "qty": 2}, "id": "http-1"}
    first = curl(web, "POST", "/api/runs", start)
    assert first.status == 201, first.body
    assert first.json()["created"] is True and first.json()["id"] == "http-1"
    again = curl(web, "POST", "/api/runs", {**start, "input": {"sku": "zzz"}})
    assert again.status == 200 and again.json()["created"] is False

    done = curl(web, "GET", "/api/runs/http-1/result?timeout=30")
    assert done.status == 200, done.body
    assert done.json() == {"id": "http-1", "status": "succeeded",
                           "result": {"sku": "abc", "total": 600}, "error": None,
                           "reason": None}
    status = curl(web, "GET", "/api/runs/http-1")
    assert status.status == 200
    with mr.connect(procs.url) as client:
        assert msgspec.convert(status.json(), mr.RunStatus) == client.status("http-1")

    # The output as server-sent events, to `final`; a reconnect resumes after Last-Event-ID.
    stream = curl(web, "GET", "/api/runs/http-1/output", headers={"Accept":
                                                                   "text/event-stream"})
    assert stream.status == 200 and "text/event-stream" in stream.headers
    events = sse_events(stream.body.decode())
    assert events[-1]["event"] == "final" and "step_succeeded" in [e["event"] for e in events]
    for event in events:
        entry = json.loads(event["data"])
        assert entry["id"] == event["id"] and entry["type"] == event["event"]
    resumed = sse_events(curl(web, "GET", "/api/runs/http-1/output",
                              headers={"Last-Event-ID": events[1]["id"]}).body.decode())
    assert resumed == events[2:]
    after_final = curl(web, "GET", "/api/runs/http-1/output",
                       headers={"Last-Event-ID": events[-1]["id"]})
    assert sse_events(after_final.body.decode()) == []  # ends at once, nothing repeated

    # A failed run: its error in a stable shape. A cancelled one: its reason.
    failed = curl(web, "POST", "/api/runs", {"workflow": "cl_fail",
                                             "input": {"message": "no stock"}})
    assert failed.status == 201
    got = curl(web, "GET", f"/api/runs/{failed.json()['id']}/result?timeout=30").json()
    assert got["status"] == "failed" and got["result"] is None
    assert got["error"]["type"] == "ValueError" and got["error"]["message"] == "no stock"
    slow = curl(web, "POST", "/api/runs", {"workflow": "cl_slow",
                                           "input": {"steps": 200, "sleep_s": 0.2},
                                           "id": "slow-1"})
    assert slow.status == 201
    cancel = curl(web, "POST", "/api/runs/slow-1/cancel")
    assert cancel.status == 200 and cancel.json()["outcome"] in ("cancelled", "requested")
    got = curl(web, "GET", "/api/runs/slow-1/result?timeout=30").json()
    assert got["status"] == "cancelled", got
    assert curl(web, "POST", "/api/runs/slow-1/pause").error()["code"] == "run_settled"

    # An approval: found in the feed, approved once, refused the second time.
    assert curl(web, "POST", "/api/runs", {"workflow": "cl_approval", "id": "appr-1"}
                ).status == 201
    wait_for(lambda: any(q["run"] == "appr-1" for q in
                         curl(web, "GET", "/api/feed").json()["questions"]),
             timeout=30, what="the approval in the feed")
    assert curl(web, "POST", "/api/runs/appr-1/pause").json()["outcome"] == "paused"
    assert curl(web, "POST", "/api/runs/appr-1/resume").json()["outcome"] == "woken"
    wait_for(lambda: curl(web, "GET", "/api/runs/appr-1").json()["status"] == "waiting"
             or None, timeout=30, what="the run waiting again")
    not_paused = curl(web, "POST", "/api/runs/appr-1/resume")
    assert not_paused.status == 409 and not_paused.error()["code"] == "not_paused"
    missing = curl(web, "POST", "/api/runs/appr-1/questions/nope/approve")
    assert missing.status == 404 and missing.error()["code"] == "unknown_question"
    approved = curl(web, "POST", "/api/runs/appr-1/questions/ship/approve", {"note": "go"})
    assert approved.status == 200 and approved.json()["outcome"] == "answered"
    twice = curl(web, "POST", "/api/runs/appr-1/questions/ship/reject", {})
    assert twice.status == 409 and twice.error()["code"] == "already_answered"
    got = curl(web, "GET", "/api/runs/appr-1/result?timeout=30").json()
    assert got["result"] == {"approved": True, "note": "go"}

    # A batch, then the runs a page at a time with the cursor.
    batch = curl(web, "POST", "/api/runs:batch", {"runs": [
        {"workflow": "cl_order", "input": {"sku": f"s{i}"}, "id": f"b-{i}"} for i in range(5)]})
    assert batch.status == 200, batch.body
    assert [r["id"] for r in batch.json()["runs"]] == [f"b-{i}" for i in range(5)]
    seen: list[str] = []
    cursor = ""
    for _ in range(10):
        page = curl(web, "GET", f"/api/runs?workflow=cl_order&limit=2&cursor={cursor}").json()
        assert len(page["runs"]) <= 2
        seen += [r["id"] for r in page["runs"]]
        if page["cursor"] is None:
            break
        cursor = page["cursor"]
    assert sorted(seen) == sorted(["http-1", *(f"b-{i}" for i in range(5))])
    bad_cursor = curl(web, "GET", "/api/runs?cursor=garbage")
    assert bad_cursor.status == 400 and bad_cursor.error()["code"] == "invalid_id"

    # An inbound event: new once, the same (source, id) again records nothing new.
    event = {"source": "shop", "id": "ev-1", "type": "order", "payload": {"n": 1}}
    sent = curl(web, "POST", "/api/events", event)
    assert sent.status == 202 and sent.json()["created"] is True, sent.body
    assert curl(web, "POST", "/api/events", event).json()["created"] is False


def test_the_result_long_poll_returns_as_the_run_finishes(procs: Procs, web: Web) -> None:
    """Not at its timeout: the reply comes as the final entry is written."""
    queued = curl(web, "POST", "/api/runs", {"workflow": "cl_slow", "id": "lp-0",
                                             "input": {"steps": 1, "sleep_s": 0}})
    assert queued.status == 201
    began = time.monotonic()
    late = curl(web, "GET", "/api/runs/lp-0/result?timeout=1")  # no worker: it waits
    assert late.status == 408 and late.error()["code"] == "timeout"
    assert 0.9 <= time.monotonic() - began < 10
    capped = curl(web, "GET", "/api/runs/lp-0/result?timeout=-1")
    assert capped.status == 400 and capped.error()["code"] == "invalid_request"

    procs.worker()
    assert curl(web, "GET", "/api/runs/lp-0/result?timeout=60").json()["result"] == 0
    assert curl(web, "POST", "/api/runs", {"workflow": "cl_slow", "id": "lp-1",
                                           "input": {"steps": 2, "sleep_s": 1.5}}).status == 201
    began = time.monotonic()
    done = curl(web, "GET", "/api/runs/lp-1/result?timeout=60")
    replied_ms = time.time() * 1000
    took = time.monotonic() - began
    assert done.status == 200 and done.json()["result"] == 1
    with mr.connect(procs.url) as client:
        final = client.output("lp-1")[-1]
    assert final.type == "final"
    # The reply came within a second of the final entry (the read blocks on the output
    # stream and is woken by it), far before the 60 s timeout.
    assert replied_ms - final.at_ms < 1000, replied_ms - final.at_ms
    assert 2.5 <= took < 30


def test_refusals_are_json_and_record_nothing(procs: Procs, web: Web) -> None:
    # The deployment's own meta is recorded by the first write to a fresh server (as by
    # `marbles-rq cancel`); that is the deployment, not a record of a request.
    curl(web, "POST", "/api/runs/never/cancel")
    before = dump_keys(procs.url)
    assert list(before) == ["{mrq}:meta"]
    start = {"workflow": "cl_order", "input": {"sku": "abc"}, "id": "never"}

    def refused(reply: Reply, status: int, code: str) -> None:
        assert reply.status == status, (reply.status, reply.body)
        assert reply.error()["code"] == code, reply.body

    refused(curl(web, "POST", "/api/runs", start, token=None), 401, "unauthorized")
    refused(curl(web, "POST", "/api/runs", start, token="wrong-token-wrong-token"), 401,
            "unauthorized")
    refused(curl(web, "GET", "/api/runs/never", token=None), 401, "unauthorized")
    # The dashboard's token is not the API's.
    from tests.web_stack import TOKEN
    refused(curl(web, "GET", "/api/runs", token=TOKEN), 401, "unauthorized")

    huge = json.dumps({**start, "input": {"sku": "x" * (3 << 20)}}).encode()
    refused(curl(web, "POST", "/api/runs", raw=huge), 413, "payload_too_large")
    # Without a Content-Length (chunked): refused as it passes the limit. The connection
    # is closed while curl still sends, so its reset may drop the body after the status.
    chunked = curl(web, "POST", "/api/runs", raw=huge, may_reset=True,
                   headers={"Transfer-Encoding": "chunked"})
    assert chunked.status == 413
    if chunked.body:
        assert chunked.error()["code"] == "payload_too_large"
    # Within the body limit but over the input limit: the engine's refusal, same code.
    refused(curl(web, "POST", "/api/runs", {**start, "input": {"sku": "x" * (1 << 20)}}),
            413, "payload_too_large")
    refused(curl(web, "POST", "/api/runs", raw=b'{"workflow": "cl_order", "input": {'),
            400, "malformed_json")
    refused(curl(web, "POST", "/api/runs", {"workflow": 5}), 400, "invalid_request")
    refused(curl(web, "POST", "/api/runs", {**start, "colour": "red"}), 400,
            "invalid_request")
    refused(curl(web, "POST", "/api/runs", {**start, "workflow": "no_such_workflow"}), 422,
            "unknown_workflow")
    refused(curl(web, "POST", "/api/runs", {**start, "input": {"qty": 2}}), 422,
            "invalid_input")
    refused(curl(web, "POST", "/api/runs", {**start, "id": "bad id|x"}), 400, "invalid_id")
    refused(curl(web, "POST", "/api/runs:batch", {"runs": [
        {"workflow": "cl_order", "input": {"sku": "ok"}, "id": "ok-1"},
        {"workflow": "cl_order", "input": {"qty": 1}, "id": "bad-1"}]}), 422, "invalid_input")
    refused(curl(web, "GET", "/api/runs/bad%20id"), 400, "invalid_id")
    refused(curl(web, "GET", "/api/runs/never"), 404, "run_not_found")
    refused(curl(web, "GET", "/api/runs/never/result?timeout=1"), 404, "run_not_found")
    refused(curl(web, "GET", "/api/runs/never/output"), 404, "run_not_found")
    refused(curl(web, "POST", "/api/runs/never/cancel"), 404, "run_not_found")
    refused(curl(web, "POST", "/api/runs/never/questions/q/answer", {"value": 1}), 404,
            "run_not_found")
    refused(curl(web, "POST", "/api/runs/never/questions/q/answer", raw=b"[1,"), 400,
            "malformed_json")
    refused(curl(web, "GET", "/api/runs?limit=0"), 400, "invalid_request")
    refused(curl(web, "GET", "/api/runs?status=finished"), 400, "invalid_request")
    refused(curl(web, "POST", "/api/runs", raw=b""), 400, "malformed_json")
    refused(curl(web, "GET", "/api/nothing-here"), 404, "not_found")
    refused(curl(web, "DELETE", "/api/runs"), 405, "method_not_allowed")
    refused(curl(web, "POST", "/api/events", {"source": "bad source", "id": "e"}), 422,
            "invalid_event")
    assert dump_keys(procs.url) == before


def test_without_a_token_only_loopback_and_no_browser(procs: Procs) -> None:
    web = start_web(procs)  # MARBLES_API_TOKEN unset, bound to 127.0.0.1
    assert curl(web, "GET", "/api/runs", token=None).status == 200
    port = web.url.rsplit(":", 1)[1]
    rebound = curl(web, "GET", "/api/runs", token=None, headers={"Host": f"evil.example:{port}"})
    assert rebound.status == 403 and rebound.error()["code"] == "forbidden"
    # A page's cross-site form or fetch carries an Origin: refused, nothing started.
    before = dump_keys(procs.url)
    browser = curl(web, "POST", "/api/runs", {"workflow": "cl_order", "input": {"sku": "a"}},
                   token=None, headers={"Origin": "http://evil.example"})
    assert browser.status == 403 and browser.error()["code"] == "forbidden"
    assert dump_keys(procs.url) == before

    public = start_web(procs, bind="0.0.0.0")  # the dashboard's token only
    off = curl(public, "GET", "/api/runs", token=None)
    assert off.status == 403 and off.error()["code"] == "api_disabled"
    assert "MARBLES_API_TOKEN" in off.error()["message"]
    with_token = start_web(procs, bind="0.0.0.0", extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    assert curl(with_token, "GET", "/api/runs").status == 200
    assert curl(with_token, "GET", "/api/runs", token=None).status == 401

    env = {**procs.env, "MARBLES_API_TOKEN": "short"}
    short = subprocess.run([*procs.base_argv(), "web", "--port", "0"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert short.returncode == 2 and "MARBLES_API_TOKEN is too short" in short.stderr


def test_openapi_document_lists_every_api_route(procs: Procs, web: Web) -> None:
    doc = curl(web, "GET", "/api/openapi.json", token=None)
    assert doc.status == 200
    spec = doc.json()
    assert spec["openapi"].startswith("3.1")
    app = create_app(Settings.from_env(procs.url), Guard("x" * 20, public=False))
    found = set()
    for route in app.app.app.routes:  # LoopbackHosts -> Throttled -> Starlette
        if getattr(route, "path", None) == "/api":
            for inner in route.app.app.routes:  # Guarded -> the API's Starlette
                for method in inner.methods - {"HEAD"}:
                    # A converter ({key:path}: keys may hold '/') is no part of the document.
                    path = re.sub(r"\{(\w+):\w+\}", r"{\1}", inner.path)
                    found.add(("/api" + path, method.lower()))
    assert len(found) >= 14
    for path, method in found:
        assert method in spec["paths"].get(path, {}), (path, method)
        op = spec["paths"][path][method]
        for status, answer in op["responses"].items():
            for media in answer["content"].values():
                ref = media["schema"].get("$ref")
                if ref:
                    assert ref.rsplit("/", 1)[1] in spec["components"]["schemas"], (path, status)
    assert "RunStatus" in spec["components"]["schemas"]
    assert "ErrorBody" in spec["components"]["schemas"]


def test_a_kept_alive_connection_answers_without_the_delayed_ack(procs: Procs,
                                                                  web: Web) -> None:
    """The listening socket's proto once kept asyncio from setting TCP_NODELAY: every reply
    on a kept-alive connection (headers and body, two writes) then waited for the client's
    delayed ACK, 40 ms or more a request, whatever the load."""
    import httpx

    with httpx.Client(base_url=web.url, timeout=10) as http:
        took = []
        for _ in range(21):
            began = time.perf_counter()
            assert http.get("/api/openapi.json").status_code == 200
            took.append(time.perf_counter() - began)
    assert sorted(took)[10] < 0.030, sorted(took)


def test_waiting_requests_hold_no_thread(procs: Procs, web: Web) -> None:
    """60 long-polls at once (more than the server's 40 worker threads): a request that
    needs a thread is still answered meanwhile, and every long-poll returns its result once
    a worker runs the run."""
    import asyncio

    import httpx

    assert curl(web, "POST", "/api/runs", {"workflow": "cl_order", "id": "many",
                                           "input": {"sku": "ab"}}).status == 201

    def blocked_reads() -> int:
        clients = procs.observer.runs.client.execute_command("CLIENT", "LIST")
        return int(clients.count(b"cmd=xread"))

    async def main() -> tuple[list[httpx.Response], float]:
        headers = {"Authorization": f"Bearer {API_TOKEN}"}
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=web.url, headers=headers, timeout=90,
                                     limits=limits) as http:
            polls = [asyncio.ensure_future(http.get("/api/runs/many/result?timeout=60"))
                     for _ in range(60)]
            deadline = time.monotonic() + 60
            while blocked_reads() < 60:  # each long-poll blocked in XREAD on its stream
                assert time.monotonic() < deadline, blocked_reads()
                await asyncio.sleep(0.1)
            began = time.monotonic()
            status = await http.get("/api/runs/many")  # a thread-pool call
            took = time.monotonic() - began
            assert status.status_code == 200 and status.json()["status"] == "queued"
            procs.worker()
            return list(await asyncio.gather(*polls)), took

    replies, took = asyncio.run(main())
    assert took < 10, took
    assert all(r.status_code == 200 for r in replies)
    assert {r.json()["result"]["total"] for r in replies} == {200}


def test_published_state_over_http(procs: Procs, web: Web) -> None:
    started = curl(web, "POST", "/api/runs", {"workflow": "cl_publish", "id": "pub-1",
                                               "input": {"sleep_s": 0.3}})
    assert started.status == 201, started.body
    waited = curl(web, "GET", "/api/runs/pub-1/state/stage?wait=0.2")  # no worker yet
    assert waited.status == 408 and waited.error()["code"] == "published_wait_timeout"
    procs.worker()
    waited = curl(web, "GET", "/api/runs/pub-1/state/stage?wait=30")
    assert waited.status == 200 and waited.json()["value"] in ("started", "done")
    assert curl(web, "GET", "/api/runs/pub-1/result?timeout=30").status == 200
    got = curl(web, "GET", "/api/runs/pub-1/state/stage")
    assert got.json() == {"id": "pub-1", "key": "stage", "value": "done"}
    missing = curl(web, "GET", "/api/runs/pub-1/state/other")
    assert missing.status == 404 and missing.error()["code"] == "not_published"
    assert curl(web, "GET", "/api/runs/nope/state/stage").error()["code"] == "run_not_found"
    # Its history, as `export` writes it: what `replay --check --from` reads.
    history = curl(web, "GET", "/api/runs/pub-1/history")
    assert history.status == 200, history.body
    line = from_line(history.body, "GET /api/runs/pub-1/history")
    assert line.run_id == "pub-1" and line.status == "succeeded"
    assert any(entry.name == "|publish" for entry in line.ledger)
    assert curl(web, "GET", "/api/runs/nope/history").error()["code"] == "run_not_found"


def test_signals_over_http(procs: Procs, web: Web) -> None:
    procs.worker()
    start = {"workflow": "cl_signal", "id": "hsig-1", "signal": {"name": "go", "payload": 1}}
    first = curl(web, "POST", "/api/runs", start)
    assert first.status == 201 and first.json()["created"] is True, first.body
    again = curl(web, "POST", "/api/runs", {**start, "signal": {"name": "go", "payload": 2}})
    assert again.status == 200 and again.json()["created"] is False
    done = curl(web, "GET", "/api/runs/hsig-1/result?timeout=30")
    assert done.json()["result"] == [1, 2], done.body

    run = curl(web, "POST", "/api/runs", {"workflow": "cl_signal", "id": "hsig-2"})
    assert run.status == 201
    sent = curl(web, "POST", "/api/runs/hsig-2/signals/go", {"payload": {"x": 1}})
    assert sent.status == 200 and sent.json()["seq"] == 1, sent.body
    assert curl(web, "POST", "/api/runs/hsig-2/signals/go").json()["seq"] == 2  # empty body
    assert curl(web, "GET", "/api/runs/hsig-2/result?timeout=30").json()["result"] == [
        {"x": 1}, None]
    settled = curl(web, "POST", "/api/runs/hsig-2/signals/go", {"payload": 3})
    assert settled.status == 409 and settled.error()["code"] == "run_settled"
    bad = curl(web, "POST", "/api/runs/hsig-2/signals/a%7Cb", {"payload": 3})
    assert bad.status == 422 and bad.error()["code"] == "invalid_signal", bad.body
    missing = curl(web, "POST", "/api/runs/nope/signals/go", {})
    assert missing.status == 404 and missing.error()["code"] == "run_not_found"
    no_id = curl(web, "POST", "/api/runs", {"workflow": "cl_signal",
                                             "signal": {"name": "go"}})
    assert no_id.status == 400 and no_id.error()["code"] == "invalid_request"


def test_names_and_keys_holding_a_slash_are_reachable(procs: Procs, web: Web) -> None:
    procs.worker()
    assert curl(web, "POST", "/api/runs", {"workflow": "cl_slashed", "id": "sl-1"}).status \
        == 201
    sent = curl(web, "POST", "/api/runs/sl-1/signals/orders%2Fpaid", {"payload": 7})
    assert sent.status == 200 and sent.json()["seq"] == 1, sent.body
    published = curl(web, "GET", "/api/runs/sl-1/state/orders%2Flast?wait=30")
    assert published.json() == {"id": "sl-1", "key": "orders/last", "value": 7}
    wait_for(lambda: any(q["run"] == "sl-1" for q in
                         curl(web, "GET", "/api/feed").json()["questions"]),
             timeout=30, what="the approval in the feed")
    approved = curl(web, "POST", "/api/runs/sl-1/questions/ship%2Feu/approve", {})
    assert approved.status == 200 and approved.json()["outcome"] == "answered", approved.body
    done = curl(web, "GET", "/api/runs/sl-1/result?timeout=30").json()
    assert done["result"] == {"approved": True, "note": None, "paid": 7}, done


def test_an_output_stream_resumed_beyond_its_entries_is_refused(procs: Procs, web: Web
                                                                ) -> None:
    queued = curl(web, "POST", "/api/runs", {"workflow": "cl_slow", "id": "far-1", "input": {}})
    assert queued.status == 201  # no worker: the run stays queued, its output one entry long
    ahead = curl(web, "GET", "/api/runs/far-1/output",
                 headers={"Last-Event-ID": "99999999999999-0"})
    assert ahead.status == 400 and ahead.error()["code"] == "invalid_id", ahead.body
    assert "beyond the run's output" in ahead.error()["message"]
