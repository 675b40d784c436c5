"""`marbles-rq web` over HTTP (httpx): bind refusal, the token, CSRF, escaping, paging and
signed webhooks, against a real redis-server and a real `marbles-rq web` process (and a
real worker and controller where a run must execute)."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import subprocess
from typing import Any

import pytest
import redis

from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.paging import Cursor, Filters, RunPager
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from tests.procs import Procs
from tests.web_stack import SECRET, TOKEN, WEB_SOURCE, Web, dump_keys, start_web

PROCS_SOURCES = [WEB_SOURCE]
XSS = '<img src=x onerror=alert(1)><script>alert("xss")</script>'


def _runs(url: str, buckets: int = 64) -> RunStore:
    return RunStore(open_store(url, buckets=buckets))


def _status(procs: Procs, run_id: str) -> str | None:
    return procs.observer.status(run_id)


# -- starting ------------------------------------------------------------------------------

@pytest.mark.parametrize("token", [None, "short"])
def test_bind_beyond_loopback_without_a_good_token_is_refused(procs: Procs,
                                                               token: str | None) -> None:
    env = dict(procs.env)
    env.pop("MARBLES_WEB_TOKEN", None)
    if token is not None:
        env["MARBLES_WEB_TOKEN"] = token
    done = subprocess.run([*procs.base_argv(), "web", "--bind", "0.0.0.0", "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "MARBLES_WEB_TOKEN" in lines[0]
    assert dump_keys(procs.url) == {}  # nothing written


def test_public_bind_needs_the_token_for_reads_too(procs: Procs) -> None:
    web = start_web(procs, bind="0.0.0.0")
    with web.client() as anon:
        reply = anon.get("/runs")
        assert reply.status_code == 303 and reply.headers["location"].startswith("/login")
        assert anon.get("/sse/runs").status_code == 401
    with web.client(headers={"Authorization": f"Bearer {TOKEN}"}) as bearer:
        assert bearer.get("/runs").status_code == 200
    with web.client(headers={"Authorization": "Bearer wrong-token-wrong-token"}) as wrong:
        assert wrong.get("/runs").status_code == 303


# -- writes: token and CSRF ----------------------------------------------------------------

def test_writes_need_the_token_and_csrf(procs: Procs) -> None:
    web = start_web(procs)
    procs.enqueue("web_noop", {"n": 1}, "w-1")  # no worker: it stays queued
    with web.client() as anon:
        csrf = web.csrf(anon)
        assert anon.get("/runs/w-1").status_code == 200  # reads are open on loopback
        refused = anon.post("/runs/w-1/cancel", data={"csrf": csrf})
        assert refused.status_code == 403 and "sign in" in refused.text
    with web.client(headers={"Authorization": "Bearer not-the-token-at-all"}) as wrong:
        assert wrong.post("/runs/w-1/cancel").status_code == 403
    assert _status(procs, "w-1") == "queued"

    browser = web.signed_in()
    csrf = web.csrf(browser)
    # A session without the form's CSRF value, with another one, or from another origin.
    assert browser.post("/runs/w-1/cancel").status_code == 403
    assert browser.post("/runs/w-1/cancel", data={"csrf": "x" * 43}).status_code == 403
    assert browser.post("/runs/w-1/cancel", data={"csrf": csrf},
                        headers={"Origin": "http://evil.example"}).status_code == 403
    assert _status(procs, "w-1") == "queued"
    done = browser.post("/runs/w-1/cancel", data={"csrf": csrf, "next": "/runs/w-1"},
                        headers={"Origin": web.url})
    assert done.status_code == 303 and done.headers["location"] == "/runs/w-1"
    assert _status(procs, "w-1") == "cancelled"
    page = browser.get("/runs/w-1")
    assert "run w-1 cancelled" in page.text  # the flash, once
    assert "run w-1 cancelled" not in browser.get("/runs/w-1").text

    # A script: the bearer token, no cookies, no CSRF; JSON replies.
    procs.enqueue("web_noop", {"n": 2}, "w-2")
    with web.client(headers={"Authorization": f"Bearer {TOKEN}",
                             "Accept": "application/json"}) as script:
        reply = script.post("/runs/w-2/pause")
        assert reply.status_code == 200 and reply.json()["ok"], reply.text
        assert script.post("/runs/nope/cancel").status_code == 404
        # Rerun is the engine's: a run that has not finished is refused (tests/test_web_rerun.py).
        assert script.post("/runs/w-2/rerun").status_code == 400
        assert script.post("/runs/w-2/cancel").status_code == 200
        rerun = script.post("/runs/w-2/rerun")
        assert rerun.status_code == 200, rerun.text
        new_id = re.search(r"run (\S+) queued", rerun.json()["message"]).group(1)  # type: ignore[union-attr]
        view = procs.observer.view(new_id)
        assert view is not None and view.record.name == "web_noop"
        assert json.loads(bytes(view.record.input)) == {"n": 2} and new_id != "w-2"


def test_read_only_without_a_token(procs: Procs) -> None:
    web = start_web(procs, token=None)
    procs.enqueue("web_noop", None, "ro-1")
    with web.client() as anon:
        csrf = web.csrf(anon)
        reply = anon.post("/runs/ro-1/cancel", data={"csrf": csrf},
                          headers={"Origin": web.url})
        assert reply.status_code == 403 and "read-only" in reply.text
        bearer = anon.post("/runs/ro-1/cancel", headers={"Authorization": f"Bearer {TOKEN}"})
        assert bearer.status_code == 403
        assert "Cancel</button>" not in anon.get("/runs/ro-1").text
        assert anon.get("/feed").status_code == 200
    assert _status(procs, "ro-1") == "queued"


# -- escaping ------------------------------------------------------------------------------

def test_markup_in_questions_and_output_is_escaped(procs: Procs) -> None:
    procs.start(workers=1)
    web = start_web(procs)
    procs.enqueue("web_ask", {"title": XSS, "body": XSS}, "xss-1")
    procs.observer.wait_status("xss-1", "waiting")
    with web.client() as anon:
        pages = [anon.get("/runs/xss-1").text, anon.get("/feed").text,
                 anon.get("/runs").text]
        with anon.stream("GET", "/sse/feed") as sse:
            fragment = ""
            for line in sse.iter_lines():
                fragment += line + "\n"
                if line.startswith("data:") and "xss-1" in line:
                    break
        with anon.stream("GET", "/sse/run/xss-1/output") as out:
            lines = []
            for line in out.iter_lines():
                if line.startswith("data:"):
                    lines.append(json.loads(line[5:]))
                if any("asking" in d["text"] for d in lines):
                    break
    for text in [*pages, fragment]:
        assert "<script>" not in text.replace('<script src="/static/live.js" defer>', "")
        assert "<img src=x" not in text
    assert "&lt;script&gt;alert(&#34;xss&#34;)&lt;/script&gt;" in pages[0]
    assert "&lt;img src=x onerror=alert(1)&gt;" in pages[1]
    # The output stream carries text in JSON; live.js sets it as textContent, never markup.
    assert any(d["text"] == f"d1 asking: {XSS}" for d in lines)
    # A run id is checked before it is used anywhere.
    with web.client() as anon:
        assert anon.get("/runs/%3Cscript%3E").status_code == 400


# -- paging --------------------------------------------------------------------------------

def test_paging_visits_every_run_once_newest_first(procs: Procs) -> None:
    import tests.web_workflows  # noqa: F401  (registers the workflows in this process)

    runs = _runs(procs.url)
    # 260 runs recorded in a few chunks: many share a millisecond (ties at page edges).
    records = [prepare(RunRequest("web_noop", b"1", f"p-{i:04d}")) for i in range(260)]
    runs.record_many(records)
    web = start_web(procs)
    seen: list[str] = []
    with web.client() as anon:
        url = "/runs"
        while url:
            page = anon.get(url)
            assert page.status_code == 200
            seen += re.findall(r'<tr data-run="([^"]+)"', page.text)
            more = re.search(r'href="(/runs\?[^"]*after=[^"]+)" rel="next"', page.text)
            url = more.group(1).replace("&amp;", "&") if more else ""
    assert len(seen) == 260 and len(set(seen)) == 260
    newest_first = runs.list_runs(limit=1000)
    assert seen == [v.record.id for v in newest_first]


def test_pager_ties_and_filters(redis_url: str) -> None:
    import tests.web_workflows  # noqa: F401

    runs = _runs(redis_url, buckets=4)
    client = runs.client
    # Same millisecond for all: the cursor's id orders them, across 4 buckets.
    for i in range(90):
        rid = f"t-{i:03d}"
        client.hset(runs.keys.run(rid), mapping={
            "doc": json.dumps({"kind": "run", "version": 1, "id": rid,
                               "name": "web_noop" if i % 3 else "other", "queue": "default",
                               "input": None, "requested_at_ms": 1}),
            "status": "succeeded" if i % 2 else "failed", "queue": "default",
            "created_ms": 1000, "attempt": 1})
        client.zadd(runs.keys.listing("run", runs.keys.bucket_of(rid)), {rid: 1000})
    pager = RunPager(runs)
    got: list[str] = []
    cursor: Cursor | None = None
    while True:
        page = pager.page(limit=7, after=cursor)
        got += [r.id for r in page.rows]
        if page.next is None:
            break
        cursor = page.next
    assert got == sorted((f"t-{i:03d}" for i in range(90)), reverse=True)
    wanted = [f"t-{i:03d}" for i in range(89, -1, -1) if i % 2 and i % 3]
    got = []
    cursor = None
    while True:
        page = pager.page(limit=5, after=cursor,
                          filters=Filters(status="succeeded", workflow="web_noop"))
        got += [r.id for r in page.rows]
        if page.next is None:
            break
        cursor = page.next
    assert got == wanted
    # A filter that matches little stops at its scan budget and says how far it got.
    page = pager.page(limit=5, filters=Filters(workflow="nothing"), scan_budget=30)
    assert page.rows == [] and page.exhausted_budget and page.next is not None


# -- webhooks ------------------------------------------------------------------------------

def _sign(body: bytes, secret: str = SECRET) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def _post(web: Web, source: str, body: bytes, signature: str | None,
          **headers: str) -> Any:
    with web.client() as client:
        sent = {"Content-Type": "application/json", **headers}
        if signature is not None:
            sent["X-Marbles-Signature"] = signature
        return client.post(f"/events/{source}", content=body, headers=sent)


def test_signed_webhook_is_journaled_once(procs: Procs) -> None:
    web = start_web(procs, extra_env={"MARBLES_MAX_PAYLOAD": "2048"})
    body = json.dumps({"id": "delivery-1", "type": "push",
                       "payload": {"ref": "main"}}).encode()
    before = dump_keys(procs.url)
    refusals = [
        (_post(web, "gitlab", body, _sign(body)), 404),              # no secret: unknown
        (_post(web, "github", body, None), 401),                     # unsigned
        (_post(web, "github", body, _sign(body, "wrong")), 401),     # wrong secret
        (_post(web, "github", body + b" ", _sign(body)), 401),       # body changed
        (_post(web, "github", body, "sha1=" + "0" * 40), 401),
        (_post(web, "github", b"x" * 10_000, _sign(b"x" * 10_000)), 413),
        (_post(web, "github", b'{"id": "bad id", "payload": 1}',
               _sign(b'{"id": "bad id", "payload": 1}')), 400),      # invalid event id
        (_post(web, "github", b"[1]", _sign(b"[1]")), 400),          # not an envelope
    ]
    for reply, code in refusals:
        assert reply.status_code == code, (code, reply.status_code, reply.text)
    assert dump_keys(procs.url) == before  # nothing recorded by any refusal

    first = _post(web, "github", body, _sign(body))
    assert first.status_code == 202, first.text
    key = first.json()["event"]
    assert key.startswith("ev-") and first.json()["run"] == key
    assert first.json()["workflow"] == "web_on_push"
    view = procs.observer.view(key)
    assert view is not None and view.record.name == "web_on_push"
    after_first = dump_keys(procs.url)
    again = _post(web, "github", body, _sign(body))
    assert again.status_code == 200 and again.json()["event"] == key
    assert again.json()["created"] is False
    assert dump_keys(procs.url).keys() == after_first.keys()  # no new run, no new event
    # The same event as `marbles-rq events send` makes it: one event, the same key.
    cli = procs.cli("events", "send", "github", "--id", "delivery-1", "--type", "push",
                    "--payload", '{"ref": "main"}')
    assert cli.returncode == 0 and f"event {key} was received before" in cli.stdout
    events = json.loads(procs.cli("events", "--json").stdout)
    assert [e["key"] for e in events] == [key] and events[0]["type"] == "push"


# -- the system page -----------------------------------------------------------------------

def test_system_page_counts_a_redelivery(procs: Procs) -> None:
    first = procs.start(workers=1)[0]
    web = start_web(procs)
    procs.enqueue("web_ticker", None, "sys-1")
    procs.observer.wait_status("sys-1", "running")
    with web.client() as anon:
        page = anon.get("/system").text
        assert first.name in page and "sys-1" in page  # the worker and what it runs
        assert re.search(r"Leader</span><span class=\"v mono\">[^<]+:\d+", page), page
        assert re.search(r"Redeliveries, last hour</span><span class=\"v\">0<", page)
        first.kill9()
        second = procs.worker()
        procs.observer.wait_attempt("sys-1", 2)
        page = anon.get("/system").text
        assert re.search(r"Redeliveries, last hour</span><span class=\"v\">1<", page), page
    _gate_open(procs, "sys-1")
    procs.observer.wait_status("sys-1", "succeeded")
    assert second.alive()


def _gate_open(procs: Procs, run_id: str) -> None:
    client = redis.Redis.from_url(procs.url)
    client.rpush(f"web:gate:{run_id}", "go")
    client.close()


def test_reading_every_page_writes_nothing(procs: Procs) -> None:
    web = start_web(procs)
    with web.client() as anon:
        for path in ("/runs", "/runs?status=failed&window=1h", "/feed", "/schedules",
                     "/monitors", "/events", "/system", "/login"):
            assert anon.get(path).status_code == 200, path
        assert anon.get("/runs/nope").status_code == 404
    assert dump_keys(procs.url) == {}  # not even the deployment's meta
