"""Benchmark (not a test): a one-step run started and awaited over the HTTP API, p50/p99.

Run from the repo root::

    .venv/bin/python -m bench.http_api [--runs 300] [--warmup 30] [--pool 1]

It starts its own redis-server from the durable ``ops/redis.conf`` (appendonly yes,
appendfsync always) in a temporary directory, a `marbles-rq worker`, a controller and the
real `marbles-rq web` (with MARBLES_API_TOKEN), each a child process in its own session, all
killed on the way out. Then, one run at a time, as a service in another language would on a
kept-alive connection (httpx):

    POST /api/runs {"workflow": "bench_http_one", "input": {"n": i}}     -> 201
    GET  /api/runs/<id>/result?timeout=30                                 -> 200

and, in the same run against the same worker, the Python client's `start` + `result()`, so
the HTTP layer's own cost is the difference. Prints p50/p99/mean of each half and of the
round trip; nothing asserts.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

import marbles_rq as mr
from tests.redis_procs import RedisServer, free_port

from .runs_util import REPO_ROOT, VENV_BIN, Procs, cpu_model, load_line, pct, table

FLOWS = REPO_ROOT / "bench" / "http_api_flows.py"
TOKEN = "bench-api-token-0123456789abcdef"


def say(line: str = "") -> None:
    print(line, flush=True)


def wait_until(what: str, check: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: {what} did not happen within {timeout:.0f} s")
        time.sleep(0.05)


def stats(label: str, values_ms: list[float]) -> list[str]:
    return [label, f"{pct(values_ms, 50):.2f}", f"{pct(values_ms, 99):.2f}",
            f"{sum(values_ms) / len(values_ms):.2f}", f"{max(values_ms):.2f}"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--pool", type=int, default=1, help="the worker's --pool")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="marbles-bench-http-") as tmp_name:
        tmp = Path(tmp_name)
        server = RedisServer.start(dir=tmp / "redis")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
        env.update(MARBLES_REDIS_URL=server.url, MARBLES_API_TOKEN=TOKEN,
                   PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO_ROOT))
        (tmp / "logs").mkdir()
        procs = Procs(tmp / "logs", env)
        port = free_port()
        try:
            base = [str(VENV_BIN / "marbles-rq"), "--redis-url", server.url,
                    "--source", str(FLOWS)]
            procs.start("controller", [*base, "controller"])
            worker = procs.start("worker", [*base, "worker", "--pool", str(args.pool),
                                            "--log-level", "WARNING"])
            web = procs.start("web", [*base, "web", "--port", str(port),
                                      "--log-level", "warning"])
            r = redis.Redis.from_url(server.url)
            wait_until("the worker's start", lambda: r.scard("rq:workers") >= 1)
            url = f"http://127.0.0.1:{port}"

            def web_up() -> bool:
                try:
                    return httpx.get(url + "/api/openapi.json").status_code == 200
                except httpx.TransportError:
                    return False

            wait_until("the web server's start", web_up)
            info = r.info("server")
            say("marbles-rq benchmark: HTTP API start + result of a one-step run")
            words = sys.argv[1:] if argv is None else argv
            say(f"command : python -m bench.http_api {' '.join(words)}")
            say(f"machine : {os.cpu_count()} CPUs ({cpu_model()}); {platform.system()} "
                f"{platform.release()}; Python {platform.python_version()}; {load_line()}")
            say(f"redis   : {info['redis_version']}, appendonly "
                f"{r.config_get('appendonly')['appendonly']}, appendfsync "
                f"{r.config_get('appendfsync')['appendfsync']}; worker --pool {args.pool}")

            http_start: list[float] = []
            http_result: list[float] = []
            http_total: list[float] = []
            headers = {"Authorization": f"Bearer {TOKEN}"}
            with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
                for i in range(args.warmup + args.runs):
                    t0 = time.perf_counter()
                    started = http.post("/api/runs", json={"workflow": "bench_http_one",
                                                           "input": {"n": i}})
                    t1 = time.perf_counter()
                    assert started.status_code == 201, started.text
                    done = http.get(f"/api/runs/{started.json()['id']}/result",
                                    params={"timeout": 30})
                    t2 = time.perf_counter()
                    assert done.status_code == 200 and done.json()["result"] == i + 1, done.text
                    if i >= args.warmup:
                        http_start.append((t1 - t0) * 1000)
                        http_result.append((t2 - t1) * 1000)
                        http_total.append((t2 - t0) * 1000)

            py_start: list[float] = []
            py_result: list[float] = []
            py_total: list[float] = []
            with mr.connect(server.url, source=str(FLOWS)) as client:
                for i in range(args.warmup + args.runs):
                    t0 = time.perf_counter()
                    run = client.start("bench_http_one", {"n": i})
                    t1 = time.perf_counter()
                    value = run.result(timeout=30)
                    t2 = time.perf_counter()
                    assert value == i + 1
                    if i >= args.warmup:
                        py_start.append((t1 - t0) * 1000)
                        py_result.append((t2 - t1) * 1000)
                        py_total.append((t2 - t0) * 1000)

            say()
            say(f"{args.runs} runs each, one at a time (after {args.warmup} warm-up runs), ms:")
            say(table(["", "p50", "p99", "mean", "max"], [
                stats("HTTP POST /api/runs", http_start),
                stats("HTTP GET .../result (waits for the run)", http_result),
                stats("HTTP start + result", http_total),
                stats("Python client start()", py_start),
                stats("Python client result() (waits for the run)", py_result),
                stats("Python client start + result()", py_total),
            ]))
            p50_gap = pct(http_total, 50) - pct(py_total, 50)
            say(f"\nthe HTTP layer adds {p50_gap:.2f} ms at p50 to the Python client's round "
                f"trip; {load_line()}")
            bad = [c.name for c in procs.children if c.proc.poll() is not None]
            if bad:
                say(f"! processes that exited early: {bad}")
            del worker, web
        finally:
            procs.cleanup()
            server.stop()


if __name__ == "__main__":
    main()
