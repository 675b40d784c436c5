"""What the payload codec costs (marbles_rq/payloads: zstd compression, AES-256-GCM):

    .venv/bin/python -m bench.codec [--runs 100] [--rounds 3] [--size 1000]

1. **Per payload**: µs per encode + decode (``encode_payload`` then ``decode_payload``, in
   this process, median of repeated calls) and the bytes stored, for JSON values of about
   100 B, 10 KB and 1 MB, under four settings: plain (no keys, ``MARBLES_COMPRESS=off``),
   zstd alone (no keys, ``MARBLES_COMPRESS=zstd``), AES-GCM alone (keys,
   ``MARBLES_COMPRESS=off``) and zstd + AES-GCM (keys, ``auto``: the default with keys).
2. **Per run**: ``ten_payload_steps`` (bench/codec_flows.py: ten steps, each result about
   ``--size`` bytes of JSON) recorded ``--runs`` times and executed in this process
   (``execute()``, no RQ), against a durable redis-server (ops/redis.conf: appendfsync
   always); steps/s without keys and with ``MARBLES_KEYS`` set, alternated over
   ``--rounds`` rounds, and the ratio.
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import redis

from tests.redis_procs import DEFAULT_CONF, RedisServer

from .runs_util import load_line, table

FLOWS = "bench/codec_flows.py"
KEYS = f"k1:{base64.b64encode(os.urandom(32)).decode()}"
SETTINGS: dict[str, dict[str, str]] = {
    "plain": {"MARBLES_COMPRESS": "off"},
    "zstd": {"MARBLES_COMPRESS": "zstd"},
    "AES-GCM": {"MARBLES_KEYS": KEYS, "MARBLES_COMPRESS": "off"},
    "zstd + AES-GCM": {"MARBLES_KEYS": KEYS, "MARBLES_COMPRESS": "auto"},
}


def say(text: str = "") -> None:
    print(text, flush=True)


def setting(env: dict[str, str]) -> None:
    for name in ("MARBLES_KEYS", "MARBLES_COMPRESS"):
        os.environ.pop(name, None)
    os.environ.update(env)


def payload(size: int) -> bytes:
    """About `size` bytes of JSON shaped like an application's value (records, text)."""
    if size <= 200:
        return msgspec.json.encode({"id": 42, "name": "customer 000042", "total": 1554,
                                    "email": "c42@example.com", "note": "paid in full"})
    rows = [{"id": n, "name": f"customer {n:06d}", "email": f"c{n}@example.com",
             "total": n * 37 % 10007, "note": "paid in full"} for n in range(size // 90)]
    return msgspec.json.encode({"rows": rows})


def per_call_us(fn: Callable[[], Any], budget_s: float = 0.4) -> float:
    fn()
    samples = []
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or len(samples) < 5:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def section_payloads() -> None:
    from marbles_rq.payloads import decode_payload, encode_payload

    rows = []
    for label, size in (("100 B", 100), ("10 KB", 10_000), ("1 MB", 1_000_000)):
        data = payload(size)
        for name, env in SETTINGS.items():
            setting(env)
            stored = encode_payload(None, data)
            assert decode_payload(None, stored) == data

            def both(data: bytes = data) -> None:
                decode_payload(None, encode_payload(None, data))

            us = per_call_us(both)
            rows.append([label, f"{len(data):,}", name, f"{us:,.1f}", f"{len(stored):,}",
                         f"{len(stored) / len(data):.2f}"])
    setting({})
    say("== 1. per payload: encode + decode in this process")
    say(table(["value", "bytes", "setting", "µs encode+decode", "bytes stored",
               "stored / given"], rows))


def one_round(url: str, n: int, size: int, keyed: bool) -> float:
    from marbles_rq.engine import ops
    from marbles_rq.engine.authoring import REGISTRY
    from marbles_rq.engine.execute import execute
    from marbles_rq.engine.runs import RunStore
    from marbles_rq.store import open_store

    setting(SETTINGS["zstd + AES-GCM"] if keyed else {})
    redis.Redis.from_url(url).flushall()
    runs = RunStore(open_store(url))
    ids = [runs.record(ops.prepare(ops.RunRequest("ten_payload_steps", msgspec.json.encode(
        {"size": size})))).record.id for _ in range(n)]
    t0 = time.perf_counter()
    outcomes = [execute(runs, REGISTRY, rid, 1, worker="bench-codec", lease_ms=10_000,
                        hard_exit=False) for rid in ids]
    elapsed = time.perf_counter() - t0
    if set(outcomes) != {"succeeded"}:
        raise RuntimeError(f"outcomes: {outcomes[:5]}")
    if keyed:  # the ledger really is sealed
        raw = redis.Redis.from_url(url)
        entry = next(iter(raw.hvals(runs.keys.steps(ids[0]))))
        assert b'"$mr":"enc"' in entry, entry[:200]
    return n * 10 / elapsed


def section_runs(n: int, rounds: int, size: int) -> None:
    from marbles_rq.engine.authoring import load_source

    load_source(FLOWS)
    tmp = Path(tempfile.mkdtemp(prefix="marbles-bench-codec-"))
    server = RedisServer.start(dir=tmp / "redis", conf=DEFAULT_CONF)
    r = redis.Redis.from_url(server.url)
    say(f"\n== 2. per run: ten_payload_steps (10 steps of ~{size:,} B results), {n} runs "
        f"executed in-process, {rounds} rounds alternated; redis-server "
        f"{r.info('server')['redis_version']}, appendfsync "
        f"{r.config_get('appendfsync')['appendfsync']}")
    rates: dict[bool, list[float]] = {False: [], True: []}
    try:
        for rnd in range(rounds):
            for keyed in ((False, True) if rnd % 2 == 0 else (True, False)):
                rates[keyed].append(one_round(server.url, n, size, keyed))
                say(f"  round {rnd + 1} {'keys' if keyed else 'plain':5}: "
                    f"{rates[keyed][-1]:,.0f} steps/s")
    finally:
        setting({})
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    plain, keyed = statistics.median(rates[False]), statistics.median(rates[True])
    say(table(["setting", "steps/s (median)", "ms/step", "ratio to plain"], [
        ["no keys", f"{plain:,.0f}", f"{1000 / plain:.3f}", "1.00"],
        ["MARBLES_KEYS (zstd + AES-GCM)", f"{keyed:,.0f}", f"{1000 / keyed:.3f}",
         f"{keyed / plain:.2f}"]]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=1000, help="bytes of each step result")
    args = parser.parse_args(argv)
    say(f"machine: {os.cpu_count()} CPUs; host load at start: {load_line()}")
    section_payloads()
    section_runs(args.runs, args.rounds, args.size)
    say(f"host load at end: {load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
