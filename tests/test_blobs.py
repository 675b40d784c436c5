"""The blob store (marbles_rq/payloads/blobs.py): each backend's put/get/idempotence and
holders against real servers (Redis, a directory, a moto_server process speaking S3),
offloading through the codec, and the controller's collection run by a real controller
process: an orphaned blob is collected, a referenced one never is, a collection a killed
controller left half done is finished."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from marbles_rq.payloads import blobs as blobs_mod
from marbles_rq.payloads.blobs import BlobMissing, BlobRef, BlobTooLarge, open_blob_store
from marbles_rq.payloads.codec import decode_payload, encode_payload
from marbles_rq.payloads.offload import is_ref, ref_of
from marbles_rq.store import open_store
from marbles_rq.store.replies import as_text
from tests.procs import Procs, wait_for
from tests.redis_procs import free_port

MOTO_SERVER = Path(sys.executable).with_name("moto_server")
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(autouse=True)
def _every_blob_in_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests put small blobs to exercise each backend: none stays in Redis (the
    default keeps blobs under 64 KiB there: test_small_blobs_stay_in_redis)."""
    monkeypatch.setenv("MARBLES_BLOB_INLINE_MAX", "1")


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3-compatible server process (moto_server, from the dev extras) with a bucket
    `blobs`; skipped when moto is not installed."""
    if not MOTO_SERVER.exists():
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"

    def listening() -> bool | None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            assert proc.poll() is None, log.read_text()
            return None
        return True

    try:
        wait_for(listening, timeout=60, what="moto_server listening")
        import boto3
        boto3.client("s3", endpoint_url=endpoint, **_boto_creds()).create_bucket(Bucket="blobs")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)


def _boto_creds() -> dict[str, str]:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing",
            "region_name": "us-east-1"}


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MARBLES_S3_ENDPOINT", s3_endpoint)
    return s3_endpoint


def _url(kind: str, tmp_path: Path) -> str:
    return {"redis": "redis", "file": f"file://{tmp_path}/blobs", "s3": "s3://blobs/t"}[kind]


@pytest.fixture(params=["redis", "file", "s3"])
def backend(request: pytest.FixtureRequest, redis_url: str, tmp_path: Path) -> Any:
    if request.param == "s3":
        request.getfixturevalue("s3_env")
    store = open_store(redis_url)
    return open_blob_store(store, _url(request.param, tmp_path))


def test_put_get_idempotent_with_holders(backend: Any) -> None:
    store = backend.store
    data = os.urandom(300_000)
    first = backend.put(data, holder="run:a")
    again = backend.put(data, holder="run:b")
    assert first == again == BlobRef(blobs_mod.sha256_hex(data), len(data), backend.name)
    assert backend.get(first) == data
    assert backend.open(first).read() == data
    assert backend.exists(first)
    holders = store.client.hgetall(store.keys.blob_holders(first.sha256))
    assert set(holders) == {b"run:a", b"run:b"}
    assert store.client.zcard(store.keys.blobs_index) == 1
    stats = store.client.hgetall(store.keys.blobs_stats)
    assert stats[b"blobs"] == b"1" and stats[b"bytes"] == str(len(data)).encode()
    # Only the Redis backend keeps the bytes in Redis.
    assert bool(store.client.exists(store.keys.blob(first.sha256))) == (backend.name == "redis")
    missing = BlobRef("0" * 64, 1, backend.name)
    assert not backend.exists(missing)
    with pytest.raises(BlobMissing, match="0000"):
        backend.get(missing)


def test_file_backend_writes_atomically_sharded(redis_url: str, tmp_path: Path) -> None:
    store = open_store(redis_url)
    blobs = open_blob_store(store, f"file://{tmp_path}/b")
    ref = blobs.put(b"x" * 10, holder="run:a")
    path = tmp_path / "b" / ref.sha256[:2] / ref.sha256[2:4] / ref.sha256
    assert path.read_bytes() == b"x" * 10
    assert [p.name for p in path.parent.iterdir()] == [ref.sha256]  # no temp file left
    path.unlink()  # lost behind the store's back: the next put writes it again
    assert blobs.put(b"x" * 10, holder="run:c") == ref and path.read_bytes() == b"x" * 10


def test_redis_cap_refuses_in_one_line_writing_nothing(redis_url: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARBLES_BLOB_REDIS_MAX", "1000")
    store = open_store(redis_url)
    with pytest.raises(BlobTooLarge) as err:
        open_blob_store(store, "redis").put(b"y" * 2000, holder="run:a")
    message = str(err.value)
    assert "\n" not in message and "MARBLES_BLOB_REDIS_MAX" in message
    assert "file://" in message and "s3://" in message
    assert store.client.dbsize() == 1  # the deployment's metadata only


def test_bad_store_urls_are_config_errors(redis_url: str) -> None:
    from marbles_rq.errors import ConfigError

    store = open_store(redis_url)
    for url in ("ftp://x", "file://host/p", "s3://", "file:"):
        with pytest.raises(ConfigError, match="MARBLES_BLOB_STORE"):
            open_blob_store(store, url)


@pytest.mark.parametrize("kind", ["redis", "file"])
def test_offload_through_the_codec(kind: str, redis_url: str, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARBLES_BLOB_STORE", _url(kind, tmp_path))
    monkeypatch.setenv("MARBLES_OFFLOAD_BYTES", "1000")
    store = open_store(redis_url)
    big = b'{"v":"' + b"z" * 5000 + b'"}'
    stored = encode_payload(store, big, holder="run:r1")
    assert is_ref(stored) and len(stored) < 200
    ref = ref_of(stored)
    assert (ref.size, ref.backend) == (len(big), kind)
    assert decode_payload(store, stored) == big
    small = b'{"v":1}'
    assert encode_payload(store, small, holder="run:r1") == small
    assert encode_payload(store, big, holder="") == big  # no holder: never offloaded
    # A value that itself looks like an envelope is escaped, then offloaded, and reads back.
    tricky = b'{"$mr":"ref","sha":"' + b"0" * 5000 + b'"}'
    assert decode_payload(store, encode_payload(store, tricky, holder="run:r1")) == tricky


def _blob_gone(store: Any, blobs: Any, ref: BlobRef) -> bool:
    return (store.client.zscore(store.keys.blobs_index, ref.sha256) is None
            and not blobs.exists(ref)
            and not store.client.exists(store.keys.blob_holders(ref.sha256)))


@pytest.mark.parametrize("kind", ["redis", "file", "s3"])
def test_controller_collects_orphans_never_referenced_blobs(
        kind: str, redis_url: str, tmp_path: Path, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "s3":
        request.getfixturevalue("s3_env")
    url = _url(kind, tmp_path)
    monkeypatch.setenv("MARBLES_BLOB_GRACE_S", "1")
    store = open_store(redis_url)
    blobs = open_blob_store(store, url)
    procs = Procs(redis_url, tmp_path / "procs")
    procs.env.update(MARBLES_BLOB_STORE=url, MARBLES_BLOB_GRACE_S="1")
    try:
        procs.start(workers=1)
        procs.enqueue("chain", {"steps": 1}, "kept1")
        procs.observer.wait_final("kept1")
        referenced = blobs.put(b"held by a run that exists" * 100, holder="run:kept1")
        # Orphans: a holder whose record never got written, and an index entry whose blob
        # never got written (the writer died between the two).
        orphan = blobs.put(b"never referenced" * 100, holder="run:ghost")
        store.scripts.index_blob(index=store.keys.blobs_index, sizes=store.keys.blobs_sizes,
                                 stats=store.keys.blobs_stats, sha="f" * 64, size=7,
                                 look_ms=0)
        # A collection a killed controller left half done: marked `$del`, object still there.
        half = blobs.put(b"half collected" * 100, holder="run:ghost2")
        # (its step 1 run as the killed controller ran it; the Redis backend has no step 2)
        if not blobs.inline:
            holders = store.keys.blob_holders(half.sha256)
            assert store.scripts.collect_blob(
                holders=holders, blob=None,
                dead=[("run:ghost2", store.client.hget(holders, "run:ghost2"))]
            ).status == "delete"
        first_look = store.client.zscore(store.keys.blobs_index, referenced.sha256)

        wait_for(lambda: _blob_gone(store, blobs, orphan) or None, timeout=30,
                 what="the orphaned blob collected")
        wait_for(lambda: _blob_gone(store, blobs, half) or None, timeout=30,
                 what="the half-collected blob finished")
        wait_for(lambda: store.client.zscore(store.keys.blobs_index, "f" * 64) is None or None,
                 timeout=30, what="the index entry without a blob dropped")
        # The referenced blob was looked at (its next look moved on) and kept, twice over.
        for _ in range(2):
            seen = store.client.zscore(store.keys.blobs_index, referenced.sha256)
            wait_for(lambda s=seen: (store.client.zscore(store.keys.blobs_index,
                                                          referenced.sha256) or 0) > s or None,
                     timeout=30, what="the referenced blob looked at again")
        assert store.client.zscore(store.keys.blobs_index, referenced.sha256) > first_look
        assert blobs.get(referenced) == b"held by a run that exists" * 100
        stats = store.client.hgetall(store.keys.blobs_stats)
        assert int(stats[b"collected"]) == 3 and int(stats[b"blobs"]) == 1
    finally:
        procs.stop_all()
        print(procs.report())


def test_put_waits_for_a_deletion_under_way_then_rewrites(redis_url: str,
                                                          tmp_path: Path) -> None:
    """A put while a collection deletes the same bytes (`$del`) waits for it to finish and
    writes the object again: never a reference to a blob deleted after the put."""
    import threading

    store = open_store(redis_url)
    blobs = open_blob_store(store, f"file://{tmp_path}/b")
    data = b"contended" * 100
    ref = blobs.put(data, holder="run:old")
    holders = store.keys.blob_holders(ref.sha256)
    assert store.scripts.collect_blob(holders=holders, blob=None,
                                      dead=[("run:old", store.client.hget(holders, "run:old"))]
                                      ).status == "delete"
    done = threading.Event()
    threading.Thread(target=lambda: (blobs.put(data, holder="run:new"), done.set()),
                     daemon=True).start()
    wait_for(lambda: store.client.hget(holders, "$del") is not None or None, timeout=5,
             what="the mark in place")
    assert not done.wait(0.3)  # it waits while the deletion is under way
    blobs.delete_object(ref.sha256)
    assert store.scripts.finish_blob(holders=holders) == "ok"
    assert done.wait(10)
    assert blobs.get(ref) == data
    assert set(store.client.hgetall(holders)) == {b"run:new"}


BLOB_WORKFLOWS = Path(__file__).with_name("blob_workflows.py")


def _run_memory(store: Any, run_id: str) -> int:
    """Bytes Redis holds for the run's own keys (MEMORY USAGE of each, samples 0: exact)."""
    rk = store.keys.run_keys(run_id)
    own = [rk.run, rk.steps, rk.output, rk.asks, rk.reports, rk.published, rk.signals,
           rk.event_inbox, rk.effects]
    return sum(store.client.memory_usage(k, samples=0) or 0 for k in own)


def test_50mb_step_results_are_offloaded_and_collected_after_retention(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose step returns 50 MB (and whose result is those 50 MB): Redis keeps
    references only (the run's keys stay under 1 MB), the result reads back byte-identical
    through the client, and after the run's retention (2 s) the controller prunes the run
    and collects its blobs."""
    import marbles_rq as mr
    from tests.blob_workflows import big_text

    size = 50 * 1000 * 1000
    url = f"file://{tmp_path}/blobs"
    procs = Procs(redis_url, tmp_path / "procs", sources=(BLOB_WORKFLOWS,))
    # The caps on one value (1 MiB by default) are raised: offloading is what makes that
    # safe for Redis.
    procs.env.update(MARBLES_BLOB_STORE=url, MARBLES_BLOB_GRACE_S="1",
                     MARBLES_MAX_STEP_RESULT=str(64 << 20), MARBLES_MAX_RESULT=str(64 << 20))
    monkeypatch.setenv("MARBLES_BLOB_STORE", url)  # this process reads the run too
    store = open_store(redis_url)
    try:
        # No controller yet: nothing prunes the run (retention 2 s) while it is read.
        procs.worker()
        before = store.client.info("memory")["used_memory"]
        procs.enqueue("bw_big", {"size": size, "steps": 1}, "big1")
        procs.observer.wait_final("big1", timeout=120)
        assert procs.observer.status("big1") == "succeeded", procs.observer.dump("big1")
        run_bytes = _run_memory(store, "big1")
        grown = store.client.info("memory")["used_memory"] - before
        print(f"50 MB run: its keys hold {run_bytes} bytes; Redis grew by {grown} bytes")
        assert run_bytes < 1_000_000
        assert grown < 8_000_000
        assert store.client.zcard(store.keys.blobs_index) >= 1
        with mr.connect(redis_url) as client:
            result = client.handle("big1").result(timeout=30)
        assert result == big_text(0, size)
        del result
        # Retention 2 s: the controller's pruning purges the run, then its collection
        # deletes the run's blobs.
        procs.controller()
        wait_for(lambda: not store.client.exists(store.keys.run("big1")) or None, timeout=60,
                 what="the run pruned after its retention")
        wait_for(lambda: store.client.zcard(store.keys.blobs_index) == 0 or None, timeout=60,
                 what="the run's blobs collected")
        assert [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()] == []
        assert int(store.client.hget(store.keys.blobs_stats, "bytes")) == 0
    finally:
        procs.stop_all()
        print(procs.report())


def test_blobs_on_a_redis_cluster(cluster_url: str, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every blob key is hash-tagged: puts, reads and the controller's collection work on a
    Cluster (the index under {P:blobs}, each blob and its holders under its own tag)."""
    monkeypatch.setenv("MARBLES_BLOB_GRACE_S", "1")
    store = open_store(cluster_url)
    refs = []
    for kind in ("redis", "file"):
        blobs = open_blob_store(store, _url(kind, tmp_path))
        for i in range(5):
            data = f"{kind}-{i}-".encode() * 1000
            ref = blobs.put(data, holder=f"run:gone-{i}")
            assert blobs.get(ref) == data
            refs.append((blobs, ref))
    assert store.client.zcard(store.keys.blobs_index) == 10
    procs = Procs(cluster_url, tmp_path / "procs")
    # The file store configured: its blobs' objects are deleted, and the bytes of blobs put
    # in Redis before (a deployment that moved) go with their Redis key.
    procs.env.update(MARBLES_BLOB_STORE=_url("file", tmp_path), MARBLES_BLOB_GRACE_S="1",
                     RQ_KEY_PREFIX="{rq}")
    try:
        procs.controller()
        wait_for(lambda: store.client.zcard(store.keys.blobs_index) == 0 or None, timeout=60,
                 what="every orphan collected")
        assert all(not blobs.exists(ref) for blobs, ref in refs)
        assert int(store.client.hget(store.keys.blobs_stats, "collected")) == 10
    finally:
        procs.stop_all()
        print(procs.report())


def test_kill9_of_the_controller_mid_collection_loses_and_leaks_nothing(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """300 orphans in a file store (3 passes of 100) and 20 referenced blobs: the collecting
    controller is killed -9 in its first pass, a second one takes over. Every orphan ends
    collected exactly once (counts, index and files agree) and no referenced blob is
    touched."""
    url = _url("file", tmp_path)
    monkeypatch.setenv("MARBLES_BLOB_GRACE_S", "1")
    store = open_store(redis_url)
    blobs = open_blob_store(store, url)
    procs = Procs(redis_url, tmp_path / "procs")
    procs.env.update(MARBLES_BLOB_STORE=url, MARBLES_BLOB_GRACE_S="1")
    try:
        procs.worker()
        procs.enqueue("chain", {"steps": 1}, "keeper")
        procs.observer.wait_final("keeper")
        kept = [blobs.put(f"kept {i}".encode() * 50, holder="run:keeper") for i in range(20)]
        orphans = [blobs.put(f"orphan {i}".encode() * 50, holder=f"run:ghost{i}")
                   for i in range(300)]
        first = procs.controller(lease_ms=2000)
        # Killed within its first pass: once it removed a few index entries of its batch.
        wait_for(lambda: store.client.zcard(store.keys.blobs_index) < 315 or None,
                 timeout=60, interval=0.002, what="the first collection under way")
        first.kill9()
        mid = store.client.zcard(store.keys.blobs_index)
        port = free_port()
        procs.controller(lease_ms=2000, extra=["--metrics-port", str(port)])
        wait_for(lambda: all(not blobs.exists(r) for r in orphans) or None, timeout=90,
                 what="every orphan collected")
        wait_for(lambda: store.client.zcard(store.keys.blobs_index) == 20 or None, timeout=30,
                 what="the index down to the referenced blobs")
        stats = store.client.hgetall(store.keys.blobs_stats)
        assert (int(stats[b"blobs"]), int(stats[b"collected"])) == (20, 300)
        assert all(blobs.get(r) for r in kept)
        print(f"killed with {mid - 20} orphans left of 300")
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            scraped = page.read().decode()
        for line in ("marbles_rq_blobs 20.0", "marbles_rq_blobs_collected_total 300.0",
                     f"marbles_rq_blob_bytes {sum(r.size for r in kept)}.0"):
            assert line in scraped.splitlines(), line
        files = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
        assert sorted(p.name for p in files) == sorted(r.sha256 for r in kept)
    finally:
        procs.stop_all()
        print(procs.report())


def test_a_debounce_windows_offloaded_input_is_kept_while_the_window_is_open(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run held in a debounce window has no record yet: its input's blob (300 KB, over
    the offload threshold) is still referenced, and the collection keeps it pass after pass."""
    monkeypatch.setenv("MARBLES_BLOB_GRACE_S", "1")
    store = open_store(redis_url)
    procs = Procs(redis_url, tmp_path / "procs", sources=(BLOB_WORKFLOWS,))
    procs.env.update(MARBLES_BLOB_GRACE_S="1")
    try:
        procs.controller()
        big = tmp_path / "input.json"
        big.write_text(json.dumps({"customer": "acme", "text": "t" * 300_000}))
        done = procs.cli("enqueue", "bw_debounced", "--input", f"@{big}")
        assert done.returncode == 0, done.stderr
        (sha,) = [as_text(s) for s in store.client.zrange(store.keys.blobs_index, 0, -1)]
        (holder,) = store.client.hkeys(store.keys.blob_holders(sha))
        run_id = as_text(holder).removeprefix("run:")
        assert not store.client.exists(store.keys.run(run_id))  # the window holds it
        for _ in range(3):  # looked at and kept, three passes over
            seen = store.client.zscore(store.keys.blobs_index, sha)
            wait_for(lambda s=seen: (store.client.zscore(store.keys.blobs_index, sha) or 0)
                     > s or None, timeout=30, what="the window's blob looked at again")
        assert store.client.hkeys(store.keys.blob_holders(sha)) == [holder]
        assert open_blob_store(store, "redis").exists(BlobRef(sha, 0))
    finally:
        procs.stop_all()
        print(procs.report())


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_an_offloaded_payload_is_sealed_before_it_leaves(
        kind: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With keys configured the blob holds the sealed (encrypted) payload: the plaintext is
    in neither Redis nor the blob store, and it reads back."""
    from marbles_rq.payloads.crypto import generate_key

    monkeypatch.setenv("MARBLES_KEYS", f"k1:{generate_key()}")
    monkeypatch.setenv("MARBLES_OFFLOAD_BYTES", "1000")
    monkeypatch.setenv("MARBLES_BLOB_STORE", _url(kind, tmp_path))
    store = open_store(redis_url)
    marker = os.urandom(8).hex()
    value = json.dumps({"secret": marker, "pad": os.urandom(20_000).hex()}).encode()
    stored = encode_payload(store, value, holder="run:s1")
    assert is_ref(stored)
    blob = open_blob_store(store, _url(kind, tmp_path)).get(ref_of(stored))
    assert blob.startswith(b'{"$mr":"enc"') and marker.encode() not in blob
    dumped = b"".join(store.client.dump(k) or b"" for k in store.client.scan_iter())
    assert marker.encode() not in dumped
    assert decode_payload(store, stored) == value


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_small_blobs_stay_in_redis_large_go_to_the_store(
        kind: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    """With a directory or S3 store, a blob up to MARBLES_BLOB_INLINE_MAX stays in Redis (its
    ref says so), a larger one goes to the store; both read back through the store, and the
    artifact path (a put then a get) reads whichever it is."""
    if kind == "s3":
        request.getfixturevalue("s3_env")
    monkeypatch.setenv("MARBLES_BLOB_INLINE_MAX", "4096")
    store = open_store(redis_url)
    blobs = open_blob_store(store, _url(kind, tmp_path))
    small, large = os.urandom(4096), os.urandom(4097)
    s_ref = blobs.put(small, holder="run:tier-small")
    l_ref = blobs.put(large, holder="run:tier-large")
    assert (s_ref.backend, l_ref.backend) == ("redis", kind)
    assert store.client.get(store.keys.blob(s_ref.sha256)) == small
    assert store.client.get(store.keys.blob(l_ref.sha256)) is None
    assert blobs.exists(s_ref) and blobs.exists(l_ref)
    assert blobs.get(s_ref) == small and blobs.get(l_ref) == large
    with blobs.open(s_ref) as reader:
        assert reader.read() == small
    with blobs.open(l_ref) as reader:
        assert reader.read() == large
    if kind == "file":
        files = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
        assert [f.name for f in files if s_ref.sha256 in f.name] == []
        assert [f.name for f in files if l_ref.sha256 in f.name] != []
