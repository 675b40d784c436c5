"""`marbles-rq web` attacked: DNS rebinding on loopback, Redis down when it starts, a crowd of
idle live (SSE) connections, a webhook secret whose variable names no source. Real
redis-server, real `marbles-rq web` processes, httpx."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
from redis.crc import key_slot

from marbles_rq.store.keys import Keyspace
from tests.procs import Procs
from tests.redis_procs import RedisCluster, RedisServer, free_port
from tests.web_stack import TOKEN, WEB_SOURCE, dump_keys, signed, start_web

PROCS_SOURCES = [WEB_SOURCE]


# -- DNS rebinding ---------------------------------------------------------------------------

def test_loopback_dashboard_refuses_a_foreign_host_name(procs: Procs) -> None:
    """Bound to loopback, reads need nothing. A page of evil.example whose name the attacker
    re-points at 127.0.0.1 (DNS rebinding) is same-origin with the dashboard in the browser:
    without a Host check it read every run's input and output. It must be refused; the
    loopback names still work, and a signed webhook (forwarded by a proxy under its public
    name) still gets through."""
    procs.enqueue("web_noop", {"secret": "s3cr3t-input"}, "rebind-1")
    web = start_web(procs)
    port = web.url.rsplit(":", 1)[1]
    with web.client() as c:
        for path in ("/runs", "/runs/rebind-1", "/system", "/sse/runs", "/feed", "/login"):
            reply = c.get(path, headers={"Host": f"evil.example:{port}"})
            assert reply.status_code == 403, (path, reply.status_code)
            assert "s3cr3t" not in reply.text
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
            reply = c.get("/runs/rebind-1", headers={"Host": host})
            assert reply.status_code == 200 and "s3cr3t-input" in reply.text, host
        body = json.dumps({"id": "rebind-ev-1", "payload": {"ref": "main"}}).encode()
        reply = c.post("/events/github", content=body,
                       headers={**signed(body), "Host": "hooks.example.com"})
        assert reply.status_code == 202, reply.text


def test_public_bind_serves_any_host_name_with_the_token(procs: Procs) -> None:
    """Beyond loopback every read needs the token, so the Host check does not apply (a
    proxy may forward any name)."""
    web = start_web(procs, bind="0.0.0.0")
    with web.client(headers={"Authorization": f"Bearer {TOKEN}",
                             "Host": "dash.example.com"}) as c:
        assert c.get("/runs").status_code == 200


# -- Redis down when `web` starts ------------------------------------------------------------

def test_pages_answer_503_when_redis_was_down_at_start(tmp_path: Path) -> None:
    """Started while Redis was down, every page answered a bare 500 "Internal Server Error"
    (the store's RedisUnavailableError is not a redis.ConnectionError) and a webhook 500
    too. Each must be a clear 503, with no traceback, the process staying up; once Redis is
    back the same process serves the pages."""
    port = free_port()
    procs = Procs(f"redis://127.0.0.1:{port}/0", tmp_path / "procs", sources=[WEB_SOURCE])
    try:
        web = start_web(procs)
        with web.client() as c:
            for path in ("/runs", "/runs/abc", "/feed", "/schedules", "/monitors", "/events",
                         "/system", "/runs?id=abc"):
                reply = c.get(path)
                assert reply.status_code == 503, (path, reply.status_code, reply.text[:200])
                assert "not answering" in reply.text or "cannot reach" in reply.text, path
                assert "Traceback" not in reply.text
            body = json.dumps({"id": "down-ev-1", "payload": 1}).encode()
            reply = c.post("/events/github", content=body, headers=signed(body))
            assert reply.status_code == 503, reply.text
            assert "cannot reach Redis" in reply.json()["error"]
            reply = c.post("/runs/abc/cancel", headers={"Authorization": f"Bearer {TOKEN}"})
            assert reply.status_code == 503, reply.text
            with c.stream("GET", "/sse/runs") as stream:
                text = ""
                for chunk in stream.iter_text():
                    text += chunk
                    if "event: problem" in text:
                        break
                assert "cannot reach Redis" in text
        assert web.proc.alive()
        server = RedisServer.start(dir=tmp_path / "redis", port=port)
        try:
            with web.client() as c:
                assert c.get("/runs").status_code == 200
                assert c.get("/system").status_code == 200
        finally:
            server.stop()
    finally:
        procs.stop_all()


# -- a crowd of idle live connections ---------------------------------------------------------

def _time_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_time", {}).get("calls", 0))


def test_idle_sse_crowd_costs_one_render_a_second_and_is_capped(procs: Procs) -> None:
    """200 idle clients on /sse/system each made the server render the System page (64
    bucket counters, a TIME, RQ's queues) every second: 60 % of a core on an empty
    deployment, growing with every client. Now identical streams share one render a
    second (counted here by the page's TIME calls), at most 128 streams are served (the
    rest: 503 Retry-After), pages stay fast, and closed streams give their slots back."""
    web = start_web(procs)
    client = redis.Redis.from_url(procs.url)

    async def crowd() -> tuple[list[int], float, int]:
        statuses: list[int] = []
        opened = asyncio.Event()

        async def one(c: httpx.AsyncClient) -> None:
            async with c.stream("GET", "/sse/system") as r:
                statuses.append(r.status_code)
                if len(statuses) == 200:
                    opened.set()
                async for _ in r.aiter_raw():
                    pass

        limits = httpx.Limits(max_connections=260, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=web.url, limits=limits, timeout=None) as c:
            tasks = [asyncio.create_task(one(c)) for _ in range(200)]
            await asyncio.wait_for(opened.wait(), 60)
            await asyncio.sleep(1.0)
            before = _time_calls(client)
            window = 5.0
            await asyncio.sleep(window)
            renders = _time_calls(client) - before
            t0 = time.perf_counter()
            assert (await c.get("/runs")).status_code == 200
            page_s = time.perf_counter() - t0
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return statuses, page_s, renders

    statuses, page_s, renders = asyncio.run(crowd())
    assert statuses.count(200) == 128 and statuses.count(503) == 72, statuses
    assert renders <= 12, renders  # about one a second, not 128 a second
    assert page_s < 5.0, page_s
    # Every slot came back: a new stream is served.
    deadline = time.monotonic() + 20
    while True:
        with web.client() as c, c.stream("GET", "/sse/runs") as r:
            if r.status_code == 200:
                break
        assert time.monotonic() < deadline, "the closed streams kept their slots"
        time.sleep(0.1)
    assert web.proc.alive()
    client.close()


# -- webhook secrets -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["MARBLES_WEBHOOK_SECRET_github",
                                  "MARBLES_WEBHOOK_SECRET_",
                                  "MARBLES_WEBHOOK_SECRET_Git-Hub"])
def test_a_secret_variable_that_names_no_source_is_refused(procs: Procs, name: str) -> None:
    """`MARBLES_WEBHOOK_SECRET_github` (lower case) was listed on the Events page as a
    source with a secret, while POST /events/github answered 404: no source maps to a
    lower-case name. `web` now refuses to start: one line, exit 2, nothing written."""
    env = dict(procs.env)
    env.pop("MARBLES_WEBHOOK_SECRET_GITHUB", None)
    env[name] = "a-secret-value"
    done = subprocess.run([*procs.base_argv(), "web", "--port", "0"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0], done.stderr
    assert dump_keys(procs.url) == {}


# -- slowloris -------------------------------------------------------------------------------

def _held_open(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(still open after `seconds`, what the server sent meanwhile)."""
    sock.settimeout(0.5)
    got = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        if not chunk:
            return False, got
        got += chunk
    return True, got


def test_slow_headers_and_slow_bodies_are_cut_off(procs: Procs) -> None:
    """A client trickling its headers, or a webhook body that never completes (a short
    Content-Length body, an unterminated chunked one), held a connection and its file
    descriptor forever (uvicorn has no such deadline): enough of them stop `web` from
    accepting anyone. Headers now have 10 s, a webhook body 15 s (then 408, and nothing
    recorded), and the server keeps serving meanwhile."""
    web = start_web(procs)
    host, port = web.url.removeprefix("http://").split(":")
    before = dump_keys(procs.url)
    partial = {
        "headers": b"GET /runs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1\r\n",
        "body": b"POST /events/github HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n"
                b"Content-Type: application/json\r\n\r\n{\"id\": ",
        "chunked": b"POST /events/github HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n7\r\n{\"id\": \r\n",
    }
    socks = {name: socket.create_connection((host, int(port))) for name in partial}
    for name, data in partial.items():
        socks[name].sendall(data)
    with web.client() as c:  # meanwhile, others are served
        assert c.get("/healthz").status_code == 200
    results: dict[str, tuple[bool, bytes]] = {}
    threads = [threading.Thread(target=lambda n=n: results.__setitem__(
        n, _held_open(socks[n], 30.0))) for n in partial]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, (still_open, _) in results.items():
        assert not still_open, f"{name}: still open after 30 s"
    assert results["headers"][1] == b""
    for name in ("body", "chunked"):
        assert results[name][1].startswith(b"HTTP/1.1 408"), results[name][1][:200]
    for s in socks.values():
        s.close()
    assert dump_keys(procs.url) == before
    assert web.proc.alive()


@pytest.mark.parametrize("token", ["sixteen chars ok!", "ab\tcdefghijklmnopq",
                                   "0123456789abcdéf0"])
def test_a_token_no_authorization_header_can_carry_is_refused(procs: Procs,
                                                                token: str) -> None:
    """A token with a space, a tab or a non-ASCII character was accepted, yet `Authorization:
    Bearer <token>` could never match it (the value is trimmed, headers are latin-1).
    Refused at start: one line, exit 2."""
    env = dict(procs.env)
    env["MARBLES_WEB_TOKEN"] = token
    done = subprocess.run([*procs.base_argv(), "web", "--port", "0"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "MARBLES_WEB_TOKEN" in lines[0], done.stderr


# -- a cluster deployment, one of its masters killed ------------------------------------------

def test_dashboard_on_a_cluster_with_a_lane_master_killed(redis_cluster: RedisCluster,
                                                          cluster_url: str,
                                                          tmp_path: Path) -> None:
    """A 3-lane deployment on a 3-master cluster (no replicas): every page reads. Then the
    master serving lane 1's slot is killed (-9, no failover): every page must still answer,
    as a clear 503 page (no bare 500, no traceback), the live streams say "problem", and the
    process stays up."""
    procs = Procs(cluster_url, tmp_path / "procs", sources=[WEB_SOURCE])
    procs.env.update(MARBLES_LANE_COUNT="3", RQ_KEY_PREFIX="{mrq:rq}")
    try:
        for i in range(6):
            procs.enqueue("web_noop", {"n": i}, f"cl-web-{i}")
        web = start_web(procs)
        pages = ("/runs", "/runs/cl-web-0", "/feed", "/schedules", "/monitors", "/events",
                 "/system")
        with web.client() as c:
            for path in pages:
                assert c.get(path).status_code == 200, path
            assert "cl-web-5" in c.get("/runs").text
        lane1 = Keyspace("mrq", 64, 3).lane_rq_prefix(1)
        assert lane1 is not None
        victim = redis_cluster.master_of_slot(key_slot(lane1.encode() + b":queues"))
        victim.kill9()
        with web.client() as c:
            for path in pages:
                reply = c.get(path, timeout=60)
                assert reply.status_code in (200, 503), (path, reply.status_code,
                                                         reply.text[:300])
                assert "Traceback" not in reply.text and "Internal Server Error" not in \
                    reply.text, path
            assert c.get("/system", timeout=60).status_code == 503  # it reads every master
            assert c.get("/healthz").status_code == 200
        assert web.proc.alive()
    finally:
        procs.stop_all()
        print(procs.report(lines=40))


# -- one secret, many spellings of a source --------------------------------------------------

def test_a_signed_request_cannot_be_replayed_under_another_spelling(procs: Procs) -> None:
    """MARBLES_WEBHOOK_SECRET_GITHUB answered for `github`, `GitHub`, `GITHUB`, `git_hub`...:
    the signature covers the body, not the URL, so one captured request was accepted again
    as a new event (202, created) under each spelling. Only `github` (the variable's
    suffix in lower case, also the declared trigger's source) is accepted now."""
    web = start_web(procs)
    body = json.dumps({"id": "spell-1", "type": "push", "payload": {"ref": "main"}}).encode()
    with web.client() as c:
        reply = c.post("/events/github", content=body, headers=signed(body))
        assert reply.status_code == 202 and reply.json()["created"] is True, reply.text
        after = dump_keys(procs.url)
        for spelling in ("GitHub", "GITHUB", "gitHub", "Github"):
            reply = c.post(f"/events/{spelling}", content=body, headers=signed(body))
            assert reply.status_code == 404, (spelling, reply.text)
        reply = c.post("/events/github", content=body, headers=signed(body))
        assert reply.status_code == 200 and reply.json()["created"] is False
    assert dump_keys(procs.url).keys() == after.keys()


def test_two_declared_sources_sharing_a_secret_are_refused(procs: Procs,
                                                           tmp_path: Path) -> None:
    source = tmp_path / "clash.py"
    source.write_text(
        "import marbles_rq as mr\n\n\n"
        "@mr.on_event('a-b')\n@mr.workflow\n"
        "def clash_one(ctx: mr.RunContext, event: mr.Event) -> None:\n"
        "    return None\n\n\n"
        "@mr.on_event('a.b')\n@mr.workflow\n"
        "def clash_two(ctx: mr.RunContext, event: mr.Event) -> None:\n"
        "    return None\n")
    env = dict(procs.env, MARBLES_WEBHOOK_SECRET_A_B="a-shared-secret")
    done = subprocess.run([*procs.base_argv()[:-2], "--source", str(source), "web", "--port",
                           "0"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "MARBLES_WEBHOOK_SECRET_A_B" in lines[0], done.stderr
    assert dump_keys(procs.url) == {}


# -- line breaks in what a live fragment carries ----------------------------------------------

def _sse_events(raw: str) -> list[tuple[str, str]]:
    """(event, data) of an event stream, parsed as a browser does: CR LF, CR and LF each
    end a line."""
    events: list[tuple[str, str]] = []
    name, data = "message", []
    for line in re.split(r"\r\n|\r|\n", raw):
        if line == "":
            if data:
                events.append((name, "\n".join(data)))
            name, data = "message", []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line.startswith("event:"):
            name = line[6:].strip()
    return events


def test_a_carriage_return_in_a_question_cannot_forge_stream_fields(procs: Procs) -> None:
    """A question's title or choice comes from a run's input (a webhook's payload, say). A
    bare CR in it went into the live fragment unchanged: the browser's event-stream parser
    ends a line at CR, so the rest became a field of its own: `event: problem` turned the
    Feed's refresh into a "problem" for every viewer (the Feed stopped updating) and
    `retry: 999999` set its reconnection delay. Each CR now starts another data line."""
    procs.start(workers=1)
    web = start_web(procs)
    procs.enqueue("web_ask", {"title": "Pick\revent: problem\rdata: INJECTED",
                              "choices": ["a\rretry: 999999", "b"]}, "cr-1")
    procs.observer.wait_status("cr-1", "waiting")
    with web.client() as anon, anon.stream("GET", "/sse/feed") as sse:
        raw = ""
        for chunk in sse.iter_text():
            raw += chunk
            if "cr-1" in raw and raw.endswith("\n\n"):
                break
    events = _sse_events(raw)
    assert [name for name, _ in events] == ["refresh"], events
    assert not re.search(r"(^|[\r\n])retry: 999999", raw)
    html = events[0][1]
    assert "cr-1" in html and "INJECTED" in html and "retry: 999999" in html


def test_output_stream_refuses_a_malformed_resume_id(procs: Procs) -> None:
    """`?after=` / `Last-Event-ID` went to XRANGE as given: a malformed one made Redis refuse
    every poll, a "problem" event four times a second for as long as the client stayed."""
    procs.enqueue("web_noop", {"n": 1}, "after-1")
    web = start_web(procs)
    with web.client() as c:
        assert c.get("/sse/run/after-1/output?after=garbage").status_code == 400
        assert c.get("/sse/run/after-1/output",
                     headers={"Last-Event-ID": "99999999999999999999-0"}).status_code == 400
        with c.stream("GET", "/sse/run/after-1/output?after=0-0") as ok:
            assert ok.status_code == 200


def test_a_short_webhook_secret_is_refused(procs: Procs) -> None:
    """A webhook secret of a few characters was accepted: one captured request (body and
    signature) is enough to find it offline, then to sign anything. At least 16, like the
    token; refused at start: one line, exit 2."""
    env = dict(procs.env, MARBLES_WEBHOOK_SECRET_GITHUB="hunter2")
    done = subprocess.run([*procs.base_argv(), "web", "--port", "0"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "MARBLES_WEBHOOK_SECRET_GITHUB is too short" in lines[0]


def test_a_bad_tag_filter_is_shown_and_never_widens_a_batch(procs: Procs) -> None:
    """A tag the runs list cannot parse (`customer = acme`) was dropped without a word: the
    page listed every run, and "all matching" with that filter cancelled runs the tag would
    have left alone. The page says what is wrong and lists nothing; the batch refuses."""
    for i in range(3):
        procs.enqueue("web_noop", {"order": i}, f"wide-{i}")  # no worker: they stay queued
    web = start_web(procs)
    c = web.signed_in()
    try:
        page = c.get("/runs", params={"workflow": "web_noop", "tag": "bad key=x"})
        assert page.status_code == 200
        assert "invalid tag key" in page.text
        assert "wide-0" not in page.text
        assert 'value="bad key=x"' in page.text  # the filter as typed, to be corrected
        done = c.post("/runs/batch", data={
            "csrf": web.csrf(c), "scope": "all", "action": "cancel", "status": "queued",
            "workflow": "web_noop", "tag": "bad key=x", "next": "/runs"},
            headers={"Origin": web.url})
        assert done.status_code == 303
        flash = c.get(done.headers["location"])
        assert "invalid tag key" in flash.text, flash.text
        for field, value in (("status", "queuedd"), ("window", "forever")):
            done = c.post("/runs/batch", data={
                "csrf": web.csrf(c), "scope": "all", "action": "cancel",
                "workflow": "web_noop", field: value, "next": "/runs"},
                headers={"Origin": web.url})
            flash = c.get(done.headers["location"])
            assert f"unknown {field}" in flash.text, flash.text
    finally:
        c.close()
    assert {procs.observer.status(f"wide-{i}") for i in range(3)} == {"queued"}
