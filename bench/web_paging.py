"""The dashboard's runs list with many runs: does a page stay fast at 1,000,000?

    .venv/bin/python bench/web_paging.py [--runs 1000000] [--pages 20]

Starts its own redis-server (no AOF: this measures reads, and the writes that fill it are
not the subject) in a temporary directory, fills it cheaply with `--runs` runs written the
way the store keeps them (the run hash with its document and status, and the run's entry in
its bucket's listing), pipelined, without scripts; 1 run in 100 failed, 1 in 10 of workflow
`rare`. Then times, at 10,000 runs and at `--runs`:

* the first page (50 newest), through the pager (engine/paging.py) and through HTTP from a
  real `marbles-rq web` (GET /runs, the full page rendered);
* a page deep in the list (following the cursor from the middle of the runs);
* a filtered page: status=failed (1 %), workflow=rare (10 %);
* the old read path, `RunStore.list_runs(limit=50)` (what `marbles-rq runs` does), for scale.

Nothing asserts; it prints medians and maxima over `--pages` repetitions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import msgspec

from marbles_rq.engine.paging import Cursor, Filters, RunPager
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.store.records import RunRecord, encode
from tests.redis_procs import RedisServer, free_port

BASE_MS = 1_780_000_000_000


def fill(store_runs: RunStore, start: int, stop: int) -> None:
    keys = store_runs.keys
    client = store_runs.client
    pipe = client.pipeline(transaction=False)
    for i in range(start, stop):
        rid = f"r{i:08d}"
        name = "rare" if i % 10 == 0 else "chain"
        created = BASE_MS + i  # one run per millisecond, the newest last
        doc = encode(RunRecord(version=1, id=rid, name=name, queue="default",
                               input=msgspec.Raw(b'{"steps":3}'), requested_at_ms=created))
        pipe.hset(keys.run(rid), mapping={
            "doc": doc, "status": "failed" if i % 100 == 7 else "succeeded",
            "queue": "default", "attempt": 1, "created_ms": created,
            "started_ms": created + 5, "finished_ms": created + 700})
        pipe.zadd(keys.listing("run", keys.bucket_of(rid)), {rid: created})
        if len(pipe) >= 20_000:
            pipe.execute()
    pipe.execute()


def timed(fn: Callable[[], object], n: int) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples), max(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=1_000_000)
    ap.add_argument("--pages", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer.start(dir=Path(tmp) / "redis", conf=None)
        web = None
        try:
            runs = RunStore(open_store(server.url))
            pager = RunPager(runs)
            port = free_port()
            env = {**os.environ, "MARBLES_REDIS_URL": server.url}
            env.pop("MARBLES_WEB_TOKEN", None)
            web = subprocess.Popen([sys.executable, "-m", "marbles_rq", "web", "--port",
                                    str(port), "--log-level", "warning"], env=env,
                                   stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
            http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
            for _ in range(100):
                try:
                    http.get("/healthz")
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            done = 0
            print(f"{'runs':>10}  {'what':44} {'median ms':>10} {'max ms':>8}")
            for target in sorted({min(10_000, args.runs), args.runs}):
                t0 = time.perf_counter()
                fill(runs, done, target)
                done = target
                fill_s = time.perf_counter() - t0
                middle = Cursor(BASE_MS + target // 2, f"r{target // 2:08d}")
                rows: list[tuple[str, Callable[[], object], int]] = [
                    ("first page, pager", lambda: pager.page(limit=50), args.pages),
                    ("first page, HTTP GET /runs (rendered)",
                     lambda: http.get("/runs").raise_for_status(), args.pages),
                    ("page from the middle, pager",
                     lambda: pager.page(limit=50, after=middle), args.pages),  # noqa: B023
                    ("page from the middle, HTTP",
                     lambda: http.get("/runs", params={"after": middle.encode()}  # noqa: B023
                                      ).raise_for_status(), args.pages),
                    ("filtered status=failed (1 %), pager",
                     lambda: pager.page(limit=50, filters=Filters(status="failed")),
                     args.pages),
                    ("filtered workflow=rare (10 %), pager",
                     lambda: pager.page(limit=50, filters=Filters(workflow="rare")),
                     args.pages),
                    ("old path: RunStore.list_runs(limit=50)",
                     lambda: runs.list_runs(limit=50), max(3, args.pages // 5)),
                ]
                print(f"{target:>10,}  (filled in {fill_s:.1f} s, "
                      f"{server.client().info('memory')['used_memory_human']})")
                for what, fn, n in rows:
                    med, worst = timed(fn, n)
                    print(f"{'':>10}  {what:44} {med:>10.1f} {worst:>8.1f}")
                page = pager.page(limit=50, filters=Filters(status="failed"))
                print(f"{'':>10}  (a status=failed page looked at {page.scanned} runs; "
                      f"budget hit: {page.exhausted_budget})")
        finally:
            if web is not None:
                web.terminate()
                web.wait(10)
            server.stop()


if __name__ == "__main__":
    main()
