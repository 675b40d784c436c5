"""Session append throughput and latency, and the read of a 1,000-message transcript:

    .venv/bin/python -m bench.sessions [--quick] [--appends 4000] [--writers 8]

Against a fresh redis-server started here as the deployment runs it (appendonly,
``appendfsync always``: each append is fsynced before it is answered):

1. **One writer**: `--appends` appends (a 200-byte JSON message each, an idempotency key
   each) by `Session.append`, one at a time: appends/s and per-append latency p50/p99; next
   to the floor, a plain ``XADD`` of the same bytes by redis-py on the same server (one round
   trip and one fsync: what any append costs at least), as a ratio.
2. **8 writers**: `--writers` processes appending to one session at once, `--appends` /
   writers each: total appends/s and the latency p50/p99 across all of them.
3. **Read**: `Session.read()` of a 1,000-message session (decode included): ms p50/p99 over
   50 reads, and messages/s.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import redis

import marbles_rq as mr

MESSAGE = {"role": "assistant", "text": "x" * 160, "n": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def _append_many(url: str, session: str, writer: int, n: int, out: object) -> None:
    client = mr.connect(url)
    s = client.session(session)
    lat = []
    for j in range(n):
        t = time.perf_counter()
        s.append({**MESSAGE, "n": j}, key=f"w{writer}-{j}")
        lat.append(time.perf_counter() - t)
    out.put(lat)  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--appends", type=int, default=4000)
    ap.add_argument("--writers", type=int, default=8)
    args = ap.parse_args()
    n = 800 if args.quick else args.appends
    tmp = Path(tempfile.mkdtemp(prefix="bench-sessions-"))
    port = _free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--dir", str(tmp), "--appendonly", "yes",
         "--appendfsync", "always", "--save", ""], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        raw = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        while True:
            try:
                raw.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client = mr.connect(url)
        client.session("warm").append(MESSAGE)

        # 1. one writer, and the XADD floor
        floor = []
        body = msgspec_json(MESSAGE)
        for j in range(n):
            t = time.perf_counter()
            raw.xadd("floor", {"m": body, "k": f"k{j}"})
            floor.append(time.perf_counter() - t)
        one = multiprocessing.Queue()
        t0 = time.perf_counter()
        _append_many(url, "one", 0, n, one)
        took = time.perf_counter() - t0
        lat = one.get()
        print(f"== 1. one writer, {n} appends (appendfsync always)")
        print(f"   Session.append   {n / took:8.0f} appends/s   p50 {_pct(lat, 50) * 1e3:.3f} ms"
              f"   p99 {_pct(lat, 99) * 1e3:.3f} ms")
        print(f"   plain XADD       {n / sum(floor):8.0f} /s          p50 "
              f"{_pct(floor, 50) * 1e3:.3f} ms   p99 {_pct(floor, 99) * 1e3:.3f} ms")
        print(f"   ratio (append p50 / XADD p50): {_pct(lat, 50) / _pct(floor, 50):.2f}")

        # 2. writers at once on one session
        w = args.writers
        per = max(1, n // w)
        q: multiprocessing.Queue[list[float]] = multiprocessing.Queue()
        procs = [multiprocessing.Process(target=_append_many, args=(url, "many", i, per, q))
                 for i in range(w)]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        lats = [x for _ in procs for x in q.get()]
        for p in procs:
            p.join()
        took = time.perf_counter() - t0
        count = client.session_info("many").messages
        assert count == w * per, count
        print(f"== 2. {w} writer processes on one session, {per} appends each "
              f"({count} messages, none lost)")
        print(f"   total {count / took:8.0f} appends/s (process start included)   p50 "
              f"{_pct(lats, 50) * 1e3:.3f} ms   p99 {_pct(lats, 99) * 1e3:.3f} ms")

        # 3. read of 1,000 messages
        s = client.session("read1000")
        for j in range(1000):
            s.append({**MESSAGE, "n": j})
        reads = []
        for _ in range(50):
            t = time.perf_counter()
            got = s.read()
            reads.append(time.perf_counter() - t)
        assert len(got) == 1000
        print("== 3. Session.read() of 1,000 messages (200 bytes each), 50 reads")
        print(f"   p50 {_pct(reads, 50) * 1e3:.2f} ms   p99 {_pct(reads, 99) * 1e3:.2f} ms   "
              f"{1000 / statistics.median(reads):,.0f} messages/s")
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def msgspec_json(value: object) -> bytes:
    import msgspec

    return msgspec.json.encode(value)


if __name__ == "__main__":
    main()
