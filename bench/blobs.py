"""What the blob store costs, per backend (Redis, a directory, S3 through moto_server when
it is installed), for values of 1, 10 and 50 MB:

    .venv/bin/python -m bench.blobs [--sizes 1,10,50] [--rounds 3] [--no-runs]

1. **The store itself**: `put` (new bytes: index, holder, write) and `get` of one blob,
   in-process; MB/s.
2. **A run's round trip**: a run whose one step returns N MB (offloaded through the codec)
   and whose result is those N MB, from `client.start` to the result in the client's hands,
   one ``--pool 1`` worker; Redis memory the run's own keys hold after it; and plain RQ
   doing the same (a job returning N MB, pickled into Redis by RQ; the result fetched) as
   the ratio's baseline.

The Redis server is started from ops/redis.conf (appendfsync always). Figures are medians
over --rounds. Nothing asserts: see tests/test_blobs.py for what must hold.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from marbles_rq.payloads.blobs import open_blob_store
from marbles_rq.store import open_store
from tests.blob_workflows import big_text
from tests.procs import REPO_ROOT, Procs, wait_for
from tests.redis_procs import DEFAULT_CONF, RedisServer, free_port

WORKFLOWS = REPO_ROOT / "tests" / "blob_workflows.py"
MOTO = Path(sys.executable).with_name("moto_server")
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
          "AWS_DEFAULT_REGION": "us-east-1"}


def say(text: str = "") -> None:
    print(text, flush=True)


def start_moto(tmp: Path) -> tuple[subprocess.Popen[bytes], str] | None:
    if not MOTO.exists():
        return None
    port = free_port()
    with open(tmp / "moto.log", "wb") as log:
        proc = subprocess.Popen([str(MOTO), "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                                stderr=subprocess.STDOUT)

    def up() -> bool | None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            return None

    wait_for(up, timeout=60, what="moto_server")
    endpoint = f"http://127.0.0.1:{port}"
    import boto3
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench",
                 aws_secret_access_key="bench", region_name="us-east-1"
                 ).create_bucket(Bucket="bench")
    return proc, endpoint


def backends(tmp: Path, endpoint: str | None) -> list[tuple[str, str]]:
    out = [("redis", "redis"), ("file", f"file://{tmp}/blobs")]
    if endpoint is not None:
        out.append(("s3 (moto_server)", "s3://bench/blobs"))
    return out


def section_store(url: str, stores: list[tuple[str, str]], sizes: list[int],
                  rounds: int) -> None:
    say("## 1. the blob store: put (new bytes) and get of one blob, in-process")
    say(f"{'backend':18} {'MB':>4} {'put ms':>8} {'put MB/s':>9} {'get ms':>8} {'get MB/s':>9}")
    store = open_store(url)
    for label, spec in stores:
        blobs = open_blob_store(store, spec)
        for mb in sizes:
            puts, gets = [], []
            for r in range(rounds):
                data = os.urandom(16) + b"x" * (mb * 1_000_000 - 16)  # new bytes every round
                t0 = time.perf_counter()
                ref = blobs.put(data, holder=f"run:bench{r}")
                t1 = time.perf_counter()
                got = blobs.get(ref)
                t2 = time.perf_counter()
                assert len(got) == len(data)
                puts.append(t1 - t0)
                gets.append(t2 - t1)
            p, g = statistics.median(puts), statistics.median(gets)
            say(f"{label:18} {mb:>4} {p * 1000:>8.1f} {mb / p:>9.0f} {g * 1000:>8.1f} "
                f"{mb / g:>9.0f}")
    say()


def _run_memory(store: Any, run_id: str) -> int:
    rk = store.keys.run_keys(run_id)
    return sum(store.client.memory_usage(k, samples=0) or 0
               for k in (rk.run, rk.steps, rk.output))


def section_runs(url: str, tmp: Path, stores: list[tuple[str, str]], sizes: list[int],
                 rounds: int, s3_endpoint: str | None) -> None:
    import marbles_rq as mr

    say("## 2. a run's round trip: a step returns N MB, the result is those N MB; "
        "start -> result in the client")
    say(f"{'backend':18} {'MB':>4} {'round trip s':>13} {'MB/s':>7} {'run keys KB':>12} "
        f"{'vs RQ':>6}")
    rq_times = rq_round_trips(url, tmp, sizes, rounds)
    store = open_store(url)
    for label, spec in stores:
        procs = Procs(url, tmp / f"procs-{label.split()[0]}", sources=(WORKFLOWS,))
        procs.env.update(MARBLES_BLOB_STORE=spec, MARBLES_MAX_STEP_RESULT=str(64 << 20),
                         MARBLES_MAX_RESULT=str(64 << 20))
        if s3_endpoint:
            procs.env.update(S3_ENV, MARBLES_S3_ENDPOINT=s3_endpoint)
        os.environ.update(procs.env)  # this process reads the results: the same blob store
        os.environ.pop("MARBLES_SOURCE", None)
        try:
            procs.worker(pool=1)
            with mr.connect(url) as client:
                for mb in sizes:
                    times, mem = [], 0
                    for r in range(rounds):
                        t0 = time.perf_counter()
                        run = client.start("bw_big_kept", {"size": mb * 1_000_000 - r,
                                                           "steps": 1})
                        result = run.result(timeout=600)
                        times.append(time.perf_counter() - t0)
                        assert result == big_text(0, mb * 1_000_000 - r)
                        mem = _run_memory(store, run.id)
                    t = statistics.median(times)
                    say(f"{label:18} {mb:>4} {t:>13.2f} {mb / t:>7.1f} {mem / 1000:>12.1f} "
                        f"{rq_times[mb] / t:>5.2f}x")
        finally:
            procs.stop_all()
    say(f"{'plain RQ':18} " + "  ".join(f"{mb} MB: {rq_times[mb]:.2f} s" for mb in sizes))
    say("(vs RQ: RQ's time / this time; RQ keeps the pickled result in Redis)")
    say()


def rq_round_trips(url: str, tmp: Path, sizes: list[int], rounds: int) -> dict[int, float]:
    """Plain RQ: a job returning N MB (tests.blob_workflows.big_text), run by one rq
    worker; enqueue -> the result fetched by the client."""
    from rq import Queue
    from rq.job import Job

    conn = redis.Redis.from_url(url)
    queue = Queue("bench_blobs", connection=conn)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with open(tmp / "rq-worker.log", "wb") as log:
        worker = subprocess.Popen([str(Path(sys.executable).with_name("rq")), "worker",
                                   "--url", url, "bench_blobs"], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    out: dict[int, float] = {}
    try:
        for mb in sizes:
            times = []
            for r in range(rounds):
                t0 = time.perf_counter()
                job = queue.enqueue("tests.blob_workflows.big_text", 0, mb * 1_000_000 - r,
                                    result_ttl=600)
                wait_for(lambda j=job: j.get_status(refresh=True) in ("finished", "failed")
                         or None, timeout=600, interval=0.01, what="the rq job")
                got = Job.fetch(job.id, connection=conn).return_value()
                times.append(time.perf_counter() - t0)
                assert got is not None and len(got) == mb * 1_000_000 - r
            out[mb] = statistics.median(times)
    finally:
        worker.terminate()
        worker.wait(10)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,10,50", help="MB, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-runs", action="store_true", help="only the store section")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-blobs-"))
    server = RedisServer.start(dir=tmp / "redis", conf=DEFAULT_CONF)
    moto = None
    try:
        for k, v in S3_ENV.items():
            os.environ.setdefault(k, v)
        moto = start_moto(tmp)
        endpoint = moto[1] if moto else None
        if endpoint:
            os.environ["MARBLES_S3_ENDPOINT"] = endpoint
        info = server.client().info("server")
        say(f"# bench/blobs.py  redis {info['redis_version']} (appendfsync always), "
            f"{os.cpu_count()} CPUs, sizes {sizes} MB, {args.rounds} rounds (median)")
        if moto is None:
            say("(moto_server not installed: no S3 rows; pip install 'moto[server]')")
        stores = backends(tmp, endpoint)
        section_store(server.url, stores, sizes, args.rounds)
        if not args.no_runs:
            section_runs(server.url, tmp, stores, sizes, args.rounds, endpoint)
    finally:
        if moto is not None:
            moto[0].terminate()
            moto[0].wait(10)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
