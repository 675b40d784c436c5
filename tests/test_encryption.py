"""Payloads at rest encrypted (marbles_rq/payloads/crypto.py), against a real redis-server
and real worker and controller processes, every one given MARBLES_KEYS.

* every kind of user value a run stores (input, step argument and result, output line,
  published value, report, answer, signal payload, child input and result, run result)
  reads back through the client and the CLI, and no key of Redis holds any of them in
  clear: every key of every type is read (strings, hash fields and values, lists, sets,
  sorted set members, stream entries) and searched for the markers;
* key rotation with a run in flight: started under k1, the workers restarted with
  ``k2,k1``, the run finishes and reads back, and its ledger holds envelopes of both keys;
* a process without the key: the CLI exits 2 with the one line naming the key; the client
  raises PayloadKeyMissing; the HTTP API answers 409 key_missing;
* a malformed MARBLES_KEYS: a worker (and the CLI) stops at its start with one line.

* session messages (from a body, a step, a client) and artifact contents (from a step and a
  client, small ones kept in Redis and a large one in a file blob store): no key of Redis
  and no file of the blob store holds them in clear; the client and the CLI read them back,
  and the CLI without the key says so in one line.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

import marbles_rq as mr
from marbles_rq.payloads.crypto import PayloadKeyMissing
from tests.procs import REPO_ROOT, Observer, Procs, wait_for

PROCS_SOURCES = (REPO_ROOT / "tests" / "encryption_workflows.py",)


def new_key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def marker(what: str) -> str:
    return f"SECRET-{what}-{uuid.uuid4().hex}"


def with_keys(procs: Procs, monkeypatch: pytest.MonkeyPatch, keys: str) -> None:
    """Every process started from now on (and this test process) holds `keys`."""
    procs.env["MARBLES_KEYS"] = keys
    monkeypatch.setenv("MARBLES_KEYS", keys)


def wait_waiting(obs: Observer, run_id: str, reason: str) -> None:
    def check() -> bool:
        view = obs.view(run_id)
        return view is not None and view.status == "waiting" and view.wait_reason == reason

    wait_for(check, timeout=60, what=f"run {run_id} to wait ({reason})",
             context=lambda: obs.dump(run_id))


def everything_stored(client: redis.Redis) -> list[tuple[str, bytes]]:
    """(key, bytes) of every key name and every element of every key, whatever its type."""
    out: list[tuple[str, bytes]] = []
    for raw_key in client.scan_iter(count=1000):
        key = raw_key.decode()
        out.append((key, raw_key))
        kind = client.type(raw_key).decode()
        if kind == "string":
            out.append((key, client.get(raw_key) or b""))
        elif kind == "hash":
            out += [(key, b) for kv in client.hgetall(raw_key).items() for b in kv]
        elif kind == "list":
            out += [(key, v) for v in client.lrange(raw_key, 0, -1)]
        elif kind == "set":
            out += [(key, v) for v in client.smembers(raw_key)]
        elif kind == "zset":
            out += [(key, m) for m, _ in client.zrange(raw_key, 0, -1, withscores=True)]
        elif kind == "stream":
            for _, fields in client.xrange(raw_key):
                out += [(key, b) for kv in fields.items() for b in kv]
        elif kind != "none":  # none: deleted or expired since the scan named it
            raise AssertionError(f"key {key} of type {kind} not searched")
    return out


def leaks(url: str, markers: list[str]) -> list[str]:
    """Where any of `markers` is stored in clear (in a key's name or contents)."""
    found = []
    client = redis.Redis.from_url(url)  # bytes in, bytes out
    for key, data in everything_stored(client):
        for m in markers:
            if m.encode() in data:
                found.append(f"{m} in {key}: {data[:120]!r}")
    return found


def test_every_user_value_is_sealed_at_rest_and_reads_back(
        procs: Procs, monkeypatch: pytest.MonkeyPatch) -> None:
    with_keys(procs, monkeypatch, f"k1:{new_key()}")
    procs.start(workers=1, controller=True)
    obs = procs.observer
    m = {k: marker(k) for k in ("input", "step", "out", "pub", "rep", "child", "answer",
                                "signal")}
    client = mr.connect(procs.url, source=str(PROCS_SOURCES[0]))
    try:
        client.start("enc_all", {k: m[k] for k in ("step", "out", "pub", "rep", "child")}
                     | {"extra": m["input"]}, id="all")
        wait_waiting(obs, "all", "question")
        client.answer("all", "q", m["answer"])
        wait_waiting(obs, "all", "signal")
        client.signal("all", "go", {"sig": m["signal"]})
        result = client.result("all", timeout=60)
        assert result == {"stepped": f"step saw {m['step']}", "answer": m["answer"],
                          "signal": {"sig": m["signal"]}, "child": {"child saw": m["child"]}}
        assert client.get("all", "state") == {"published": m["pub"]}

        async def read_async() -> tuple[Any, Any]:
            async with mr.connect_async(procs.url) as aclient:
                return (await aclient.result("all", timeout=10),
                        await aclient.handle("all").get("state"))

        assert asyncio.run(read_async()) == (result, {"published": m["pub"]})
        status = client.status_json("all")
        assert status["input"]["extra"] == m["input"], status
        assert status["reports"][0]["entry"] == {"reported": m["rep"]}, status
        assert status["questions"][0]["answer"] == m["answer"], status
        printed = [e for e in obs.events("all") if e.type == "output"]
        assert printed[0].data == {"value": {"printed": m["out"]}}, printed
    finally:
        client.close()

    # The CLI (a process of its own, with the key) reads it back too.
    shown = procs.cli("status", "all", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["result"]["answer"] == m["answer"]
    got = procs.cli("get", "all", "state")
    assert got.returncode == 0 and m["pub"] in got.stdout, got

    found = leaks(procs.url, list(m.values()))
    assert not found, "\n".join(found)
    # The search finds a marker where one is (a control, in a stream entry's field).
    control = redis.Redis.from_url(procs.url)
    control.xadd("control", {"d": f"x{m['input']}y"})
    assert leaks(procs.url, [m["input"]]) == [f"{m['input']} in control: b'x{m['input']}y'"]
    # And the values are there, sealed: the run's result hash field is an envelope of k1.
    raw = redis.Redis.from_url(procs.url)
    stored = raw.hget(obs.runs.keys.run("all"), "result") or b""
    assert stored.startswith(b'{"$mr":"enc","k":"k1"'), stored[:60]


def test_event_payloads_batches_event_waits_and_debounce_windows_are_sealed(
        procs: Procs, monkeypatch: pytest.MonkeyPatch) -> None:
    with_keys(procs, monkeypatch, f"k1:{new_key()}")
    procs.start(workers=1, controller=True)
    obs = procs.observer
    m = {k: marker(k) for k in ("event", "batch1", "batch2", "waited", "deb1", "deb2")}
    client = mr.connect(procs.url, source=str(PROCS_SOURCES[0]))
    try:
        client.start("enc_event_wait", {"order": "o-1"}, id="waiter")
        wait_waiting(obs, "waiter", "event")
        # A debounce window holds its merged input until it closes.
        first = client.start("enc_debounced", {"customer": "c-1", "items": [m["deb1"]]})
        second = client.start("enc_debounced", {"customer": "c-1", "items": [m["deb2"]]})
        assert first.id == second.id
        window = leaks(procs.url, [m["deb1"], m["deb2"]])
        sent = client.send_event("enc-shop", "e-1", type="paid", payload={"p": m["event"]})
        b1 = client.send_event("enc-batch", "b-1", payload={"p": m["batch1"]})
        client.send_event("enc-batch", "b-2", payload={"p": m["batch2"]})
        client.send_event("enc-wait", "w-1", type="paid",
                          payload={"order": "o-1", "p": m["waited"]})
        assert client.result(sent.run_id, timeout=60) == {"got": {"p": m["event"]}}
        assert client.result(b1.run_id, timeout=60) == [{"p": m["batch1"]}, {"p": m["batch2"]}]
        assert client.result("waiter", timeout=60) == {"order": "o-1", "p": m["waited"]}
        assert client.result(first.id, timeout=60) == [m["deb1"], m["deb2"]]
        shown = client.status_json(sent.run_id)
        assert shown["input"]["payload"] == {"p": m["event"]}, shown
    finally:
        client.close()
    assert not window, "\n".join(window)
    found = leaks(procs.url, list(m.values()))
    assert not found, "\n".join(found)


def test_key_rotation_with_a_run_in_flight(procs: Procs,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    k1, k2 = new_key(), new_key()
    with_keys(procs, monkeypatch, f"k1:{k1}")
    workers = procs.start(workers=1, controller=True)
    obs = procs.observer
    secret = marker("rotated")
    assert procs.cli("enqueue", "enc_wait", "--input", json.dumps({"before": secret}),
                     "--id", "rot").returncode == 0
    wait_waiting(obs, "rot", "signal")

    # Every process restarted with the new key first (it seals), the old one still listed.
    procs.stop_all()
    with_keys(procs, monkeypatch, f"k2:{k2},k1:{k1}")
    procs.start(workers=1, controller=True)
    del workers
    sent = procs.cli("signal", "rot", "go", "--payload", json.dumps(secret + "-2"))
    assert sent.returncode == 0, sent.stderr
    obs.wait_final("rot")
    view = obs.view("rot")
    assert view is not None and view.status == "succeeded", obs.dump("rot")
    assert json.loads(bytes(view.result or b"null")) == {
        "before": f"step saw {secret}", "after": f"step saw {secret}-2"}
    ledger = redis.Redis.from_url(procs.url).hvals(obs.runs.keys.steps("rot"))
    sealed_with = {json.loads(v)["result"]["k"] for v in ledger if b'"result":{"$mr"' in v}
    assert {"k1", "k2"} <= sealed_with, sealed_with
    assert not leaks(procs.url, [secret])

    # A process holding only k2 cannot read what k1 sealed: one line, exit 2.
    only_new = {**procs.env, "MARBLES_KEYS": f"k2:{k2}"}
    done = subprocess.run(procs.cli_argv("status", "rot", "--json"), env=only_new,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stderr.strip() == ("error: payload encrypted with key 'k1', which "
                                   "MARBLES_KEYS does not hold"), done.stderr

    # The client raises it, typed.
    monkeypatch.setenv("MARBLES_KEYS", f"k3:{new_key()}")
    client = mr.connect(procs.url)
    try:
        with pytest.raises(PayloadKeyMissing) as err:
            client.result("rot", timeout=10)
        assert err.value.code == "key_missing"
        assert "'k2'" in str(err.value) and "\n" not in str(err.value)
    finally:
        client.close()


def test_a_worker_without_the_newer_key_hands_the_run_back_instead_of_failing_it(
        procs: Procs, monkeypatch: pytest.MonkeyPatch) -> None:
    k1, k2 = new_key(), new_key()
    with_keys(procs, monkeypatch, f"k1:{k1}")
    procs.start(workers=1, controller=True)
    obs = procs.observer
    assert procs.cli("enqueue", "enc_wait", "--input", json.dumps({"before": "b"}),
                     "--id", "wrong").returncode == 0
    wait_waiting(obs, "wrong", "signal")
    # A process rolled out too early seals with k2, which the worker does not hold yet.
    early = {**procs.env, "MARBLES_KEYS": f"k2:{k2},k1:{k1}"}
    sent = subprocess.run(procs.cli_argv("signal", "wrong", "go", "--payload", '"s"'),
                          env=early, capture_output=True, text=True, timeout=60)
    assert sent.returncode == 0, sent.stderr

    def handed_back() -> bool:
        view = obs.view("wrong")
        return view is not None and "MARBLES_KEYS does not hold" in (view.note or "")

    monkeypatch.setenv("MARBLES_KEYS", f"k2:{k2},k1:{k1}")  # this process reads both
    wait_for(handed_back, timeout=60, what="the run to be handed back",
             context=lambda: obs.dump("wrong"))
    assert obs.status("wrong") not in ("failed", "succeeded"), obs.dump("wrong")
    procs.stop_all()
    with_keys(procs, monkeypatch, f"k2:{k2},k1:{k1}")
    procs.start(workers=1, controller=True)
    obs.wait_final("wrong")
    assert obs.status("wrong") == "succeeded", obs.dump("wrong")


def test_the_http_api_and_the_dashboard_say_key_missing(
        procs: Procs, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_web_api import API_TOKEN, curl
    from tests.web_stack import start_web

    with_keys(procs, monkeypatch, f"k1:{new_key()}")
    procs.start(workers=1, controller=True)
    assert procs.cli("enqueue", "enc_wait", "--input", json.dumps({"before": "x"}),
                     "--id", "api").returncode == 0
    wait_waiting(procs.observer, "api", "signal")
    # A web process whose MARBLES_KEYS lacks k1.
    procs.env["MARBLES_KEYS"] = f"k9:{new_key()}"
    web = start_web(procs, extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    reply = curl(web, "GET", "/api/runs/api")
    assert reply.status == 409, reply.body
    assert reply.error()["code"] == "key_missing", reply.body
    assert reply.error()["message"] == ("payload encrypted with key 'k1', which MARBLES_KEYS "
                                        "does not hold")
    browser = web.signed_in()
    try:
        page = browser.get("/runs/api")
    finally:
        browser.close()
    assert page.status_code != 500, page.text
    assert "MARBLES_KEYS does not hold" in page.text, page.text


@pytest.mark.parametrize("value, says", [
    ("k1:not-base64!!", "MARBLES_KEYS: key 'k1' is not valid base64"),
    (f"k1:{base64.b64encode(b'short').decode()}", "MARBLES_KEYS: key 'k1' is 5 bytes, not 32"),
    ("justakey", "MARBLES_KEYS: 'justakey' is not <id>:<base64 key>"),
])
def test_a_malformed_key_list_stops_a_process_at_its_start(
        procs: Procs, tmp_path: Path, value: str, says: str) -> None:
    env = {**procs.env, "MARBLES_KEYS": value}
    worker = subprocess.run(procs.cli_argv("worker", "--burst"), env=env, capture_output=True,
                            text=True, timeout=60)
    assert worker.returncode == 2, (worker.returncode, worker.stderr)
    lines = worker.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {says}"), worker.stderr
    status = subprocess.run(procs.cli_argv("runs"), env=env, capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 2 and says in status.stderr, status.stderr


def test_binary_content_and_altered_envelopes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The codec alone (no Redis): artifact blobs' binary framing, compression, and an
    envelope whose key id or compression flag was altered does not open."""
    from marbles_rq.payloads import decode_payload, encode_payload, open_bytes, seal_bytes
    from marbles_rq.payloads.crypto import MAGIC, PayloadSealError

    monkeypatch.delenv("MARBLES_KEYS", raising=False)
    monkeypatch.delenv("MARBLES_COMPRESS", raising=False)
    blob = os.urandom(3000)
    assert seal_bytes(None, blob) == blob  # no keys: stored as given
    looks_sealed = MAGIC + b"user bytes"
    assert open_bytes(None, seal_bytes(None, looks_sealed)) == looks_sealed
    assert encode_payload(None, b'{"$mr":"enc"}') == b'{"$mr":"esc","v":{"$mr":"enc"}}'

    k1 = new_key()
    monkeypatch.setenv("MARBLES_KEYS", f"k1:{k1}")
    text = b"x" * 5000
    sealed = seal_bytes(None, text)
    assert text not in sealed and open_bytes(None, sealed) == text
    assert len(sealed) < 200  # compressed before encryption
    value = b'{"pan":"' + b"4" * 600 + b'"}'
    stored = encode_payload(None, value)
    assert b'"z":1' in stored and decode_payload(None, stored) == value
    with pytest.raises(PayloadSealError):
        decode_payload(None, stored.replace(b'"z":1', b'"z":0'))
    monkeypatch.setenv("MARBLES_KEYS", f"k1:{k1},k2:{k1}")
    with pytest.raises(PayloadSealError):
        decode_payload(None, stored.replace(b'"k":"k1"', b'"k":"k2"'))
    monkeypatch.setenv("MARBLES_KEYS", f"k2:{new_key()}")
    with pytest.raises(PayloadKeyMissing):
        open_bytes(None, sealed)


def blob_files(root: Path) -> list[tuple[str, bytes]]:
    return [(str(p), p.read_bytes()) for p in root.rglob("*") if p.is_file()]


def test_sessions_artifacts_and_a_file_blob_store_are_sealed_at_rest(
        procs: Procs, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Session messages (from a body, a step and a client) and artifact contents (from a
    step and a client; small ones kept in Redis, a large one in a file blob store) are
    sealed: neither Redis nor any file of the blob store holds a marker, and each reads back
    in clear through the client and the CLI."""
    with_keys(procs, monkeypatch, f"k1:{new_key()}")
    store_dir = tmp_path / "blobs"
    url = f"file://{store_dir}"
    procs.env["MARBLES_BLOB_STORE"] = url
    monkeypatch.setenv("MARBLES_BLOB_STORE", url)
    procs.start(workers=1, controller=True)
    m = {k: marker(k) for k in ("said", "noted", "client_msg", "small", "client_art")}
    large = marker("large") + "." + os.urandom(100_000).hex()  # sealed, still over 64 KiB
    client = mr.connect(procs.url, source=str(PROCS_SOURCES[0]))
    try:
        client.start("enc_kept", {"said": m["said"], "session": "enc-notes",
                                  "noted": m["noted"], "art": "enc-art", "small": m["small"],
                                  "large": large}, id="kept")
        assert client.result("kept", timeout=60) == {"small": 1, "large": 1}
        client.session("enc-notes").append({"client": m["client_msg"]})
        assert client.artifact("enc-client").put(m["client_art"].encode()) == 1
        # Read back in clear through the client.
        own = [msg.data for msg in client.session("kept").read()]
        assert own == [{"said": m["said"]}], own
        notes = [msg.data for msg in client.session("enc-notes").read()]
        assert notes == [{"note": m["noted"]}, {"client": m["client_msg"]}], notes
        assert client.artifact("enc-art").get() == m["small"].encode()
        assert client.artifact("enc-art-big").get() == large.encode()
        assert client.artifact("enc-client").get() == m["client_art"].encode()
    finally:
        client.close()
    shown = procs.cli("sessions", "show", "enc-notes")
    assert shown.returncode == 0 and m["noted"] in shown.stdout, shown
    got = procs.cli("artifacts", "get", "enc-art")
    assert got.returncode == 0 and got.stdout == m["small"], got

    markers = [*m.values(), marker_of(large)]
    found = leaks(procs.url, markers)
    assert not found, "\n".join(found)
    files = blob_files(store_dir)
    assert files, "the large artifact's blob is in the file store"
    in_files = [f"{x} in {path}" for path, data in files for x in markers if x.encode() in data]
    assert not in_files, in_files
    # Without the key, the CLI says so in one line.
    procs.env["MARBLES_KEYS"] = f"k9:{new_key()}"
    for args in (("sessions", "show", "enc-notes"), ("artifacts", "get", "enc-art")):
        done = procs.cli(*args)
        assert done.returncode == 2, done
        assert done.stderr.strip().splitlines() == [
            "error: payload encrypted with key 'k1', which MARBLES_KEYS does not hold"], done


def marker_of(value: str) -> str:
    return value.split(".")[0]
