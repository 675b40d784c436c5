"""Benchmark (not a test): what OpenTelemetry tracing costs the engine's hot path.

Run from the repo root (needs the ``otel`` extra)::

    python -m bench.tracing_cost [--runs 200] [--rounds 4]

One durable ``redis-server``; one process records runs of ``one_step`` and ``ten_steps``
(bench/runs_flows.py) and executes them in-process (``execute()``, no RQ), in blocks that
alternate tracing off and on. On is what a worker with MARBLES_TRACING=1 does: the SDK's
BatchSpanProcessor and OTLP/HTTP exporter, posting to a local receiver in a process of its
own (tests/otlp_receiver.py, decoding every request); with ``--flush-each``, as a forking
worker's work-horse, a flush at the end of each delivery (one POST per delivery), else as a
``--pool`` executor, batches in the background. Tracing is switched by the module's own
switch, so both sides run in one process under the same load. CPU time of this process per
run, and the wall rate. The runs are recorded untraced before each block: only execution
is measured."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.redis_procs import DEFAULT_CONF, RedisServer

from .runs_util import load_line, median

FLOWS = "bench/runs_flows.py"


def say(text: str = "") -> None:
    print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--flush-each", action="store_true")
    args = parser.parse_args(argv)

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from marbles_rq import tracing
    from marbles_rq.engine import ops
    from marbles_rq.engine.authoring import REGISTRY, load_source
    from marbles_rq.engine.execute import execute
    from marbles_rq.engine.runs import RunStore
    from marbles_rq.store import open_store

    say(f"host load at start: {load_line()}")
    tmp = Path(tempfile.mkdtemp(prefix="marbles-bench-tracing-"))
    server = RedisServer.start(dir=tmp / "redis", conf=DEFAULT_CONF)
    receiver = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom tests.otlp_receiver import Receiver\n"
         "r = Receiver()\nprint(r.url, flush=True)\nsys.stdin.read()\n"
         "print(len(r.received()), r.posts, flush=True)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert receiver.stdout is not None and receiver.stdin is not None
    url = receiver.stdout.readline().strip()
    try:
        load_source(FLOWS)
        runs = RunStore(open_store(server.url))
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=url + "/v1/traces")))
        tracing.use_provider(provider)
        if args.flush_each:
            tracing.exit_after_each_delivery()
        cpu: dict[tuple[str, bool], list[float]] = {}
        wall: dict[tuple[str, bool], list[float]] = {}
        for rnd in range(args.rounds):
            for workflow in ("one_step", "ten_steps"):
                for enabled in ((False, True) if rnd % 2 == 0 else (True, False)):
                    tracing._state = False
                    ids = [runs.record(ops.prepare(ops.RunRequest(workflow))).record.id
                           for _ in range(args.runs)]
                    tracing._state = enabled
                    c0, w0 = time.process_time(), time.perf_counter()
                    for rid in ids:
                        execute(runs, REGISTRY, rid, 1, worker="bench-tracing",
                                lease_ms=10_000, hard_exit=False)
                    c1, w1 = time.process_time(), time.perf_counter()
                    cpu.setdefault((workflow, enabled), []).append((c1 - c0) / args.runs)
                    wall.setdefault((workflow, enabled), []).append(args.runs / (w1 - w0))
            say(f"  round {rnd + 1}: " + ", ".join(
                f"{w} {'on ' if e else 'off'} {cpu[(w, e)][-1] * 1e3:.3f} ms CPU/run "
                f"{wall[(w, e)][-1]:.0f} runs/s" for w in ("one_step", "ten_steps")
                for e in (False, True)))
        say()
        say("medians over rounds (CPU of the executing process per run; wall runs/s):")
        for workflow in ("one_step", "ten_steps"):
            off_c, on_c = median(cpu[(workflow, False)]), median(cpu[(workflow, True)])
            say(f"  {workflow:9}  off {off_c * 1e3:.3f} ms  on {on_c * 1e3:.3f} ms  "
                f"delta {(on_c - off_c) * 1e6:+.0f} us ({(on_c / off_c - 1) * 100:+.1f} %);  "
                f"runs/s off {median(wall[(workflow, False)]):.0f} "
                f"on {median(wall[(workflow, True)]):.0f}")
        provider.shutdown()  # exports what is left
        tracing.disable()
        spans, posts = receiver.communicate("", timeout=60)[0].split()
        say(f"spans received: {spans} in {posts} requests")
    finally:
        if receiver.poll() is None:
            receiver.kill()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"host load at end: {load_line()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
