"""Sessions (conversation transcripts): concurrent appenders from many processes (also
killed -9 mid-append and restarted), idempotent resends, create-or-get, a corrupt record
skipped by listings and refused on append, `mr.session` in run bodies (sync and async,
replay-safe across a kill -9 of the worker) and retention with the owning runs.

Real redis-server, real writer processes (tests/session_writer.py), real `marbles-rq worker`
and `controller` processes (workflows in tests/session_workflows.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import marbles_rq as mr
from marbles_rq.sessions import SessionCorruptError, SessionNotFoundError, SessionStore
from marbles_rq.sessions.errors import InvalidMessageError
from marbles_rq.store.records import StepRecord, decode
from tests.procs import REPO_ROOT, Proc, Procs, wait_for
from tests.redis_procs import RedisServer
from tests.session_workflows import EXEC_PREFIX, GATE_PREFIX
from tests.test_waiting_questions import kill9_groups, ok, one_line_error

PROCS_SOURCES = (REPO_ROOT / "tests" / "session_workflows.py",)
WRITERS = 8
PER_WRITER = 1000


def _writer(url: str, session: str, w: int, progress: Path, log_dir: Path) -> Proc:
    argv = [sys.executable, "-m", "tests.session_writer", url, session, str(w),
            str(PER_WRITER), str(progress)]
    return Proc(f"writer{w}", argv, log_dir / f"writer-{w}.log",
                {**os.environ, "PYTHONUNBUFFERED": "1"})


def _confirmed(progress: Path) -> int:
    try:
        return progress.read_text().count("\n")
    except FileNotFoundError:
        return 0


def _check_transcript(client: mr.Client, session: str) -> None:
    """8,000 messages at positions 1..8,000, each (writer, j) once, each writer's in order."""
    messages = client.session(session).read()
    assert [m.position for m in messages] == list(range(1, WRITERS * PER_WRITER + 1))
    seen = [(m.data["w"], m.data["j"]) for m in messages]
    assert len(set(seen)) == len(seen) == WRITERS * PER_WRITER
    by_writer: dict[int, list[int]] = defaultdict(list)
    for w, j in seen:
        by_writer[w].append(j)
    assert {w: js for w, js in by_writer.items()} == {
        w: list(range(PER_WRITER)) for w in range(WRITERS)}
    assert client.session_info(session).messages == WRITERS * PER_WRITER


@pytest.mark.parametrize("kill", [False, True], ids=["plain", "kill9"])
def test_eight_writers_keep_every_message_once_in_order(redis_server: RedisServer,
                                                        tmp_path: Path, kill: bool) -> None:
    url = redis_server.url
    progress = [tmp_path / f"progress-{w}" for w in range(WRITERS)]
    writers = [_writer(url, "shared", w, progress[w], tmp_path) for w in range(WRITERS)]
    try:
        if kill:
            # Each writer is killed -9 mid-run (its last append may or may not have been
            # applied, unconfirmed), then started again: it resends from its first
            # unconfirmed message with the same keys.
            for w, proc in enumerate(writers):
                wait_for(lambda w=w: _confirmed(progress[w]) >= 100 * (1 + w % 4) or None,
                         timeout=60, what=f"writer {w} to confirm some appends",
                         context=proc.tail)
                proc.signal(signal.SIGKILL)
                proc.popen.wait(timeout=10)
                assert proc.returncode == -signal.SIGKILL, proc.tail()
                writers[w] = _writer(url, "shared", w, progress[w], tmp_path)
        for proc in writers:
            assert proc.wait_exit(timeout=120) == 0, proc.tail()
    finally:
        for proc in writers:
            if proc.alive():
                proc.kill9()
    client = mr.connect(url)
    _check_transcript(client, "shared")
    if kill:
        # every writer restarted: each wrote its progress file to the end, once per j
        assert all(_confirmed(p) == PER_WRITER for p in progress)


def test_idempotent_append_create_or_get_and_bad_messages(redis_url: str) -> None:
    client = mr.connect(redis_url)
    first = client.session("conv-1")
    assert first.created and first.parent == ""
    assert first.append({"role": "user", "text": "hi"}) == 1
    assert first.append({"role": "assistant", "text": "hello"}, key="k-2") == 2
    again = client.session("conv-1")  # create-or-get: the existing one, unchanged
    assert not again.created
    assert again.append({"role": "assistant", "text": "ignored"}, key="k-2") == 2
    assert [m.data for m in again.read()] == [{"role": "user", "text": "hi"},
                                             {"role": "assistant", "text": "hello"}]
    assert [m.position for m in again.read(after=1)] == [2]
    before = client.session_info("conv-1")
    for bad in ([1, 2], "text", None, {"x": float("nan")}):
        with pytest.raises(InvalidMessageError):
            again.append(bad)  # type: ignore[arg-type]
    assert client.session_info("conv-1") == before  # nothing written on refusal
    with pytest.raises(SessionNotFoundError):
        client.session_messages("never")
    assert client.delete_session("conv-1") == 2
    with pytest.raises(SessionNotFoundError):
        again.append({"late": True})
    assert client.sessions().sessions == []


def test_follow_yields_new_messages_as_they_arrive(redis_url: str) -> None:
    import threading

    client = mr.connect(redis_url)
    session = client.session("live")
    session.append({"n": 0})
    got: list[int] = []
    done = threading.Event()

    def follow() -> None:
        for m in session.follow(timeout=30):
            got.append(m.data["n"])
            if len(got) == 3:
                break
        done.set()

    reader = threading.Thread(target=follow)
    reader.start()
    wait_for(lambda: got == [0] or None, timeout=10, what="the first message")
    session.append({"n": 1})
    session.append({"n": 2})
    assert done.wait(30) and got == [0, 1, 2]
    reader.join(10)


def test_asyncio_client_sessions(redis_url: str) -> None:
    import asyncio

    async def main() -> list[int]:
        aclient = mr.connect_async(redis_url)
        session = await aclient.session("aio")
        assert session.created
        assert await session.append({"n": 1}) == 1
        assert await session.append({"n": 2}, key="two") == 2
        assert await session.append({"n": 2}, key="two") == 2
        got = []
        async for m in session.follow(timeout=0.5):
            got.append(m.position)
        assert [s.id for s in (await aclient.sessions()).sessions] == ["aio"]
        await aclient.aclose()
        return got

    assert asyncio.run(main()) == [1, 2]


def test_corrupt_record_skipped_in_listing_refused_on_append(procs: Procs) -> None:
    client = mr.connect(procs.url)
    client.session("good").append({"ok": True})
    client.session("bad").append({"ok": True})
    store = SessionStore(client.runs_store)
    key = store.keys.session("bad")
    store.client.hset(key, "doc", b"\x00garbage{")
    snapshot = store.client.hgetall(key), store.client.xlen(store.keys.session_messages("bad"))

    listing = client.sessions()
    assert [s.id for s in listing.sessions] == ["good"] and listing.corrupt == [key]
    done = procs.cli("sessions")
    assert done.returncode == 0 and done.stdout.startswith("good  1 messages"), done
    assert done.stderr.count("\n") == 1 and key in done.stderr and "warning" in done.stderr
    assert [s["id"] for s in json.loads(ok(procs.cli("sessions", "--json")))] == ["good"]

    assert [m.data for m in client.session_messages("good")] == [{"ok": True}]
    with pytest.raises(SessionCorruptError) as err:
        client.session("bad")
    assert key in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SessionCorruptError):
        store.append("bad", {"more": 1}, key="x")
    one_line_error(procs.cli("sessions", "append", "bad", '{"more": 1}'), 2, key)
    one_line_error(procs.cli("sessions", "show", "bad"), 2, key)
    # never overwritten: the record and its messages are as they were
    assert (store.client.hgetall(key),
            store.client.xlen(store.keys.session_messages("bad"))) == snapshot
    ok(procs.cli("sessions", "delete", "bad"))  # deleting is how it is repaired
    assert client.sessions().corrupt == []


def _session_entries(procs: Procs, run_id: str) -> list[StepRecord]:
    raw = procs.observer.runs.client.hgetall(procs.observer.runs.keys.steps(run_id))
    records = [decode(StepRecord, v, "ledger") for v in raw.values()]
    return sorted((r for r in records if r.name == "|session"), key=lambda r: r.key)


def test_run_session_appends_once_across_a_kill9_redelivery(procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    procs.enqueue("sw_chat", "notes-1", "chat1")
    obs.wait_step_started("chat1", "sw_chat.sw_append_and_gate#0", attempt=1)
    client = mr.connect(procs.url)
    wait_for(lambda: client.session_info("chat1").messages == 2 or None, timeout=30,
             what="the body's and the step's appends")
    # kill -9 while the step that appended waits at its gate: the redelivery re-executes
    # the body (its append) and the step (its append): both find their keys.
    kill9_groups(procs.procs)
    procs.start(workers=1)
    wait_for(lambda: int(obs.client.hget(EXEC_PREFIX + "chat1", "gate") or 0) == 2,
             timeout=60, what="the gated step to run again after the redelivery",
             context=lambda: obs.dump("chat1"))
    obs.client.rpush(GATE_PREFIX + "chat1", "go")
    obs.wait_final("chat1")
    assert obs.status("chat1") == "succeeded", obs.dump("chat1")
    result = client.result("chat1")
    assert result == {"own": "chat1", "child": "notes-1", "parent": "chat1",
                      "positions": [1, 2, 1]}
    assert [m.data for m in client.session("chat1").read()] == [{"from": "body"},
                                                                {"from": "step"}]
    assert [m.data for m in client.session_messages("notes-1")] == [{"from": "child"}]
    info = client.session_info("notes-1")
    assert info.parent == "chat1" and info.owners == ["chat1"] and not info.kept
    assert client.run_sessions("chat1") == ["chat1", "notes-1"]
    assert [(r.key, json.loads(bytes(r.result))) for r in _session_entries(procs, "chat1")] \
        == [("sw_chat.sw_append_and_gate#0.|session#0", {"session": "chat1", "parent": ""}),
            ("sw_chat.|session#0", {"session": "chat1", "parent": ""}),
            ("sw_chat.|session#1", {"session": "notes-1", "parent": "chat1"})]
    status = ok(procs.cli("status", "chat1"))
    assert "sessions: chat1, notes-1" in status, status

    procs.enqueue("sw_chat_async", "notes-2", "chat2")
    obs.wait_final("chat2")
    assert client.result("chat2") == {"own": "chat2", "positions": [1, 1],
                                      "read": [{"from": "async body"}]}


def test_sessions_go_with_their_last_owner_run(procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    client = mr.connect(procs.url)
    client.session("kept").append({"by": "client"})
    store = SessionStore(client.runs_store)
    # j1 (retention 0 s) and j2 (an hour) share "shared"; j3 (0 s) uses the client's "kept".
    procs.enqueue("sw_join", "shared", "j1")
    procs.enqueue("sw_join_long", "shared", "j2")
    procs.enqueue("sw_join", "kept", "j3")
    obs.wait_final("j2")
    # j1 and j3 are pruned as soon as they finish (their sessions hold their appends)
    wait_for(lambda: (obs.view("j1") is None and obs.view("j3") is None and
                      client.session_info("shared").messages == 2) or None,
             timeout=60, what="the runs of 0 s retention to be pruned",
             context=lambda: obs.dump("j1"))
    assert not store.client.exists(store.keys.run_sessions("j1"))
    shared = client.session_info("shared")  # j2 still uses it
    assert shared.owners == ["j2"] and shared.messages == 2
    kept = client.session_info("kept")  # created by a client: kept until deleted
    assert kept.messages == 2 and kept.owners == [] and kept.kept
    # j2's retention ends (its due time moved to now): the session goes with it.
    finished = store.keys.run_finished(store.keys.bucket_of("j2"))
    store.client.zadd(finished, {"j2": 0})
    wait_for(lambda: not store.client.exists(store.keys.session("shared")) or None,
             timeout=30, what="the shared session to go with its last owner")
    assert obs.view("j2") is None
    for family in (store.keys.session_messages, store.keys.session_idem,
                   store.keys.session_owners):
        assert not store.client.exists(family("shared"))
    assert [s.id for s in client.sessions().sessions] == ["kept"]


API_TOKEN = "api-token-0123456789abcdef-xyz"


def test_http_api_and_dashboard_pages(procs: Procs) -> None:
    from tests.web_stack import start_web

    procs.start(workers=1)
    procs.enqueue("sw_chat_async", "web-notes", "wchat")
    procs.observer.wait_final("wchat")
    web = start_web(procs, token=None, extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    api = web.client(headers={"Authorization": f"Bearer {API_TOKEN}"})
    added = api.post("/api/sessions/api-1/messages", json={"message": {"text": "hi"},
                                                           "key": "m1"})
    assert added.status_code == 201 and added.json()["position"] == 1, added.text
    again = api.post("/api/sessions/api-1/messages", json={"message": {"text": "hi"},
                                                           "key": "m1"})
    assert again.status_code == 200 and again.json()["duplicate"] is True
    bad = api.post("/api/sessions/api-1/messages", json={"message": [1]})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_message"
    listed = api.get("/api/sessions").json()
    assert sorted(s["id"] for s in listed["sessions"]) == ["api-1", "wchat", "web-notes"]
    detail = api.get("/api/sessions/wchat", params={"after": 0}).json()
    assert [m["message"] for m in detail["messages"]] == [{"from": "async body"}]
    assert detail["session"]["owners"] == ["wchat"]
    assert api.get("/api/sessions/nope").json()["error"]["code"] == "session_not_found"
    assert api.get("/api/sessions/nope").status_code == 404
    store = SessionStore(mr.connect(procs.url).runs_store)
    store.client.hset(store.keys.session("api-1"), "doc", b"garbage")
    refused = api.post("/api/sessions/api-1/messages", json={"message": {"x": 1}})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_corrupt"
    assert store.keys.session("api-1") in refused.json()["error"]["message"]
    assert api.get("/api/sessions").json()["skipped"] == [store.keys.session("api-1")]
    paths = api.get("/api/openapi.json").json()["paths"]
    assert {"/api/sessions", "/api/sessions/{id}", "/api/sessions/{id}/messages"} <= set(paths)

    page = web.client()
    listing = page.get("/sessions")
    assert listing.status_code == 200 and "web-notes" in listing.text
    assert "cannot be decoded" in listing.text
    transcript = page.get("/sessions/wchat")
    assert transcript.status_code == 200 and "async body" in transcript.text
    run = page.get("/runs/wchat")
    assert 'href="/sessions/web-notes"' in run.text and 'href="/sessions/wchat"' in run.text
