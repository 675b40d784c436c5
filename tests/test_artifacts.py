"""Artifacts: versions with compare-and-set from concurrent runs, a put recorded so that a
killed and redelivered step writes one version, contents stored once per sha256, reads from
the client, the CLI (byte-identical files) and the HTTP API. Real redis-server, real
`marbles-rq worker` / `controller` / `web` processes; workflows in
tests/artifact_workflows.py."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import marbles_rq as mr
from marbles_rq.artifacts import (
    ArtifactConflict,
    ArtifactNameError,
    UnknownArtifactError,
    UnknownArtifactVersionError,
)
from marbles_rq.artifacts.store import references_blob
from marbles_rq.payloads.holders import HOLDER_KINDS
from tests.artifact_workflows import BARRIER, EXEC_PREFIX, GATE_PREFIX, PUT_PREFIX
from tests.procs import REPO_ROOT, Procs
from tests.test_waiting_questions import kill9_groups, ok, one_line_error

PROCS_SOURCES = (REPO_ROOT / "tests" / "artifact_workflows.py",)
WRITERS = 8


def client_of(procs: Procs) -> mr.Client:
    return mr.connect(procs.url)


def blob_keys(procs: Procs) -> list[str]:
    """The blobs' content keys (not their holder sets) in the Redis blob store."""
    client = procs.observer.runs.client
    return sorted(k.decode() for k in client.scan_iter(match="*:blob:*")
                  if b":holders:" not in k)


def test_cas_from_concurrent_runs_gives_versions_without_gap_or_lost_write(
        procs: Procs) -> None:
    # One worker executing 8 runs at once: all 8 read the same latest version (a barrier),
    # then race their puts with it as expect_version; the losers read again and retry.
    procs.worker(extra=("--concurrency", str(WRITERS)))
    procs.controller()
    client = client_of(procs)
    # Declared at module level in the source: known before any version exists.
    listed = {i.name: i for i in client.artifacts()}
    assert listed["aw-shared"].latest == 0 and listed["aw-shared"].media_type == "text/plain"
    assert listed["aw-declared"].versions == 0
    handles = [client.start("aw_cas", {"writer": f"w{i}", "writers": WRITERS}, id=f"cas{i}")
               for i in range(WRITERS)]
    results = [h.result(timeout=120) for h in handles]
    versions = sorted(r["version"] for r in results)
    assert versions == list(range(1, WRITERS + 1)), results  # no gap, none twice
    assert sum(r["conflicts"] for r in results) >= WRITERS - 1, results  # they did race
    art = client.artifact("aw-shared")
    kept = art.versions()
    assert [v.version for v in kept] == list(range(1, WRITERS + 1))
    contents = sorted(art.get(v.version).decode() for v in kept)
    assert contents == sorted(f"written by w{i}\n" for i in range(WRITERS))  # each once
    for v in kept:
        assert v.run is not None and v.run.startswith("cas") and v.media_type == "text/plain"
        assert v.meta == {"writer": art.get(v.version).decode().split()[-1]}
        assert v.sha256 == hashlib.sha256(art.get(v.version)).hexdigest()
    # Each run's status lists the version it wrote.
    for i, result in enumerate(results):
        status = client.status(f"cas{i}")
        assert [(a["name"], a["version"]) for a in status.artifacts] == [
            ("aw-shared", result["version"])], status.artifacts
    procs.observer.client.delete(BARRIER)
    # An async body awaits its puts.
    assert client.start("aw_async", None, id="as1").result(timeout=60) == {
        "first": 1, "second": 2, "content": "two"}
    assert "artifact " in ok(procs.cli("status", "as1"))


def test_a_step_killed_after_its_put_and_redelivered_writes_one_version(procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    client = client_of(procs)
    client.start("aw_kill", None, id="k1")
    obs.wait_list(PUT_PREFIX + "k1", lambda items: len(items) == 1, what="the step's put")
    kill9_groups(procs.procs)  # after the put, before the step's success is written
    procs.start(workers=1)
    obs.wait_list(PUT_PREFIX + "k1", lambda items: len(items) == 2,
                  what="the redelivered step's put", timeout=90)
    assert obs.lrange(PUT_PREFIX + "k1") == ["1", "1"]  # the same version, both times
    obs.client.rpush(GATE_PREFIX + "k1", "go")
    obs.wait_final("k1")
    assert obs.status("k1") == "succeeded", obs.dump("k1")
    assert int(obs.client.hget(EXEC_PREFIX + "k1", "put") or 0) == 2  # it did run twice
    step_art = client.artifact("aw-kill-k1")
    assert [v.version for v in step_art.versions()] == [1]
    assert step_art.get() == b"\x00\x01 step content k1"
    assert client.start("aw_kill", None, id="k1").result(timeout=5) == {"step": 1, "body": 1}
    body = client.artifact("aw-body-k1").versions()
    assert [(v.version, v.meta, v.run) for v in body] == [(1, {"from": "body"}, "k1")]
    status = client.status("k1")
    assert sorted((a["name"], a["version"]) for a in status.artifacts) == [
        ("aw-body-k1", 1), ("aw-kill-k1", 1)]
    # The feed shows the versions as reports.
    feed = json.loads(ok(procs.cli("feed", "--json")))
    assert {(r["entry"]["name"], r["entry"]["version"]) for r in feed["reports"]
            if r["kind"] == "artifact"} == {("aw-body-k1", 1), ("aw-kill-k1", 1)}
    watched = ok(procs.cli("watch", "k1", "--no-follow"))
    assert "artifact aw-kill-k1 version 1 recorded" in watched, watched
    # The dashboard's run page lists them, with their downloads.
    from tests.web_stack import start_web

    web = start_web(procs)
    with web.client() as browser:
        page = browser.get("/runs/k1")
        assert page.status_code == 200, page.text
        assert "/artifacts/aw-kill-k1/versions/1/download" in page.text, page.text
        assert "/artifacts/aw-body-k1/versions/1/download" in page.text
        got = browser.get("/artifacts/aw-kill-k1/versions/1/download")
        assert got.status_code == 200 and got.content == b"\x00\x01 step content k1"


def test_identical_content_is_one_blob_and_reads_and_deletes(redis_url: str) -> None:
    client = mr.connect(redis_url, prefix=f"art{os.getpid()}")
    a, b = client.artifact("same-a"), client.artifact("same-b")
    data = os.urandom(4096)
    assert a.put(data) == 1 and a.put(data) == 2 and b.put(data) == 1
    store = client.runs_store
    sha = hashlib.sha256(data).hexdigest()
    blobs = [k for k in store.client.scan_iter(match=f"{{{store.keys.prefix}:blob:*")
             if b":holders:" not in k]
    assert blobs == [store.keys.blob(sha).encode()], blobs
    holders = store.client.hkeys(store.keys.blob_holders(sha))
    assert set(holders) == {b"art:same-a", b"art:same-b"}
    assert HOLDER_KINDS["art"] is references_blob
    assert references_blob(store, "same-a", sha) and references_blob(store, "same-b", sha)
    # get / versions / open / version
    assert a.get() == data and a.get(1) == data and a.latest() == 2
    with a.open(1) as reader:
        assert reader.read() == data
    assert [v.version for v in a.versions()] == [1, 2]
    assert a.version().sha256 == sha and a.version().size == 4096
    assert a.version().media_type == "application/octet-stream"
    # compare-and-set: 0 means "none yet"; a mismatch names both versions, writes nothing
    with pytest.raises(ArtifactConflict) as err:
        a.put(b"other", expect_version=1)
    assert err.value.expected == 1 and err.value.latest == 2 and "version 2, not 1" in str(
        err.value)
    assert a.latest() == 2
    c = client.artifact("fresh")
    assert c.latest() == 0  # nothing declared or written: none yet
    with pytest.raises(UnknownArtifactError):
        c.get()
    assert c.put("first", expect_version=0) == 1
    with pytest.raises(ArtifactConflict):
        c.put("again", expect_version=0)
    assert c.get() == b"first" and c.version().media_type == "text/plain; charset=utf-8"
    # unknown names and versions: typed errors
    with pytest.raises(UnknownArtifactVersionError):
        a.get(7)
    with pytest.raises(UnknownArtifactError):
        client.artifact("nope").get()
    with pytest.raises(ArtifactNameError):
        client.artifact("bad/name")
    # delete: one version, then every version; numbers are not reused; the blob is no
    # longer referenced by `same-a` (the controller's collection may take it)
    assert a.delete(1) == [1]
    assert [v.version for v in a.versions()] == [2] and a.latest() == 2
    assert a.delete(2) == [2] and a.latest() == 0
    assert not references_blob(store, "same-a", sha) and references_blob(store, "same-b", sha)
    assert a.put(b"later") == 3
    assert b.delete() == [1] and not references_blob(store, "same-b", sha)
    with pytest.raises(UnknownArtifactVersionError):
        b.get()
    # keep=N drops the oldest versions beyond N
    k = client.artifact("kept")
    for i in range(5):
        k.put(f"v{i}", keep=2)
    assert [v.version for v in k.versions()] == [4, 5]
    names = {i.name: i for i in client.artifacts()}
    assert names["kept"].latest == 5 and names["kept"].versions == 2
    client.close()


def test_async_client(redis_url: str) -> None:
    import asyncio

    async def main() -> None:
        client = mr.connect_async(redis_url, prefix=f"arta{os.getpid()}")
        art = client.artifact("async-art")
        assert await art.put(b"x" * 10, meta={"a": 1}) == 1
        assert await art.get() == b"x" * 10
        assert [v.meta for v in await art.versions()] == [{"a": 1}]
        assert b"".join([p async for p in art.chunks()]) == b"x" * 10
        with pytest.raises(ArtifactConflict):
            await art.put(b"y", expect_version=0)
        assert [i.name for i in await client.artifacts()] == ["async-art"]
        await client.aclose()

    asyncio.run(main())


def test_cli_put_get_byte_identical_and_unknown_names(procs: Procs, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(10 << 20))
    assert ok(procs.cli("artifacts", "put", "bigfile", str(big))).strip() == \
        "artifact bigfile version 1"
    out = tmp_path / "out.bin"
    ok(procs.cli("artifacts", "get", "bigfile", "-o", str(out)))
    assert out.read_bytes() == big.read_bytes()
    # to stdout, byte for byte (binary)
    import subprocess

    done = subprocess.run(procs.cli_argv("artifacts", "get", "bigfile", "--version", "1"),
                          env=procs.env, capture_output=True, timeout=60)
    assert done.returncode == 0 and done.stdout == big.read_bytes()
    small = tmp_path / "small.txt"
    small.write_text("hello\n")
    one_line_error(procs.cli("artifacts", "put", "bigfile", str(small), "--expect-version",
                             "0"), 2, "bigfile", "version 1, not 0")
    ok(procs.cli("artifacts", "put", "bigfile", str(small), "--expect-version", "1"))
    listed = json.loads(ok(procs.cli("artifacts", "--json")))
    assert {(a["name"], a["latest"]) for a in listed} >= {("bigfile", 2)}
    shown = json.loads(ok(procs.cli("artifacts", "bigfile", "--versions", "--json")))
    assert [v["version"] for v in shown["versions_kept"]] == [1, 2]
    assert shown["versions_kept"][1]["media_type"] == "text/plain"
    assert "v2" in ok(procs.cli("artifacts", "bigfile"))
    one_line_error(procs.cli("artifacts", "get", "nope"), 2, "unknown artifact 'nope'")
    one_line_error(procs.cli("artifacts", "nope"), 2, "unknown artifact 'nope'")
    one_line_error(procs.cli("artifacts", "get", "bigfile", "--version", "9"), 2,
                   "no version 9")
    one_line_error(procs.cli("artifacts", "delete", "bigfile", "--version", "9"), 2,
                   "no version 9")
    one_line_error(procs.cli("artifacts", "get", "bad/name"), 2, "invalid artifact name")
    assert "removed version 1" in ok(procs.cli("artifacts", "delete", "bigfile", "--version",
                                               "1"))


def test_http_api_lists_downloads_and_puts(procs: Procs) -> None:
    from tests.web_stack import TOKEN, start_web

    web = start_web(procs, extra_env={"MARBLES_API_TOKEN": TOKEN})
    client = client_of(procs)
    data = os.urandom(300_000)
    client.artifact("http-art").put(data, media_type="image/png")
    with web.client(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        listed = http.get("/api/artifacts")
        assert listed.status_code == 200, listed.text
        assert "http-art" in {a["name"] for a in listed.json()["artifacts"]}
        one = http.get("/api/artifacts/http-art")
        assert one.status_code == 200 and one.json()["versions"][0]["version"] == 1, one.text
        got = http.get("/api/artifacts/http-art/versions/1/content")
        assert got.status_code == 200 and got.content == data
        assert got.headers["content-type"] == "image/png"
        latest = http.get("/api/artifacts/http-art/content")
        assert latest.status_code == 200 and latest.content == data
        put = http.put("/api/artifacts/http-art/content?expect_version=1", content=b"two",
                       headers={"Content-Type": "text/plain"})
        assert put.status_code == 201 and put.json()["version"] == 2, put.text
        conflict = http.put("/api/artifacts/http-art/content?expect_version=1", content=b"3")
        assert conflict.status_code == 409
        assert conflict.json()["error"]["code"] == "artifact_conflict"
        missing = http.get("/api/artifacts/nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == \
            "unknown_artifact"
        gone = http.get("/api/artifacts/http-art/versions/9/content")
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "unknown_artifact_version"
    # The dashboard: the artifacts page lists it, with a download link per version.
    browser = web.signed_in()
    page = browser.get("/artifacts")
    assert page.status_code == 200 and "http-art" in page.text, page.text
    page = browser.get("/artifacts/http-art")
    assert page.status_code == 200 and "/artifacts/http-art/versions/1/download" in page.text
    download = browser.get("/artifacts/http-art/versions/1/download")
    assert download.status_code == 200 and download.content == data
    assert "attachment" in download.headers["content-disposition"]



def test_runs_in_memory_keep_their_artifacts_in_memory(procs: Procs) -> None:
    from marbles_rq.testing import Environment

    env = Environment()
    run = env.start("aw_async")
    env.run_until_idle()
    assert env.result(run) == {"first": 1, "second": 2, "content": "two"}
    art = env.artifact(f"aw-async-{run.id}")
    assert [v.version for v in art.versions()] == [1, 2] and art.get(1) == b"one"
    with pytest.raises(ArtifactConflict):
        art.put(b"x", expect_version=1)
    assert [a.name for a in env.artifacts()] == [f"aw-async-{run.id}"]
    # A dry run writes nothing to Redis.
    before = sorted(procs.observer.runs.client.keys("*"))
    out = ok(procs.cli("run", "aw_async", "--dry-run"))
    assert '"content": "two"' in out or "two" in out, out
    assert sorted(procs.observer.runs.client.keys("*")) == before


def test_latest_of_an_unknown_artifact_is_zero_and_cas_starts_there(redis_url: str) -> None:
    client = mr.connect(redis_url, prefix=f"lat{os.getpid()}")
    art = client.artifact("never-declared")
    assert art.latest() == 0
    assert art.put(b"first", expect_version=art.latest()) == 1
    assert art.latest() == 1
