"""OpenTelemetry tracing (marbles_rq/tracing.py): in this process with the SDK's in-memory
exporter (a run killed mid-attempt and redelivered stays one trace; its status and log lines
carry the trace id), and end to end: a real `marbles-rq web`, worker and controller export
over OTLP/HTTP to a receiver this test starts, for a run started through the HTTP API with
a caller's traceparent, two steps and a child."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# ops/test installs the otel extra into .otel, beside .venv, where only these tests see it
# (installed in .venv, redis-py would import OpenTelemetry in every process of the suite).
OTEL = Path(__file__).resolve().parent.parent / ".otel"
if OTEL.is_dir() and str(OTEL) not in sys.path:
    sys.path.insert(0, str(OTEL))
try:
    import opentelemetry.sdk.trace  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI runs ops/test, which installs it: missing there is a failure
    pytest.skip("the otel extra is not installed (ops/test puts it in .otel)",
                allow_module_level=True)

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

import marbles_rq as mr  # noqa: E402
from marbles_rq import tracing  # noqa: E402
from marbles_rq.controller import Controller  # noqa: E402
from marbles_rq.engine.authoring import REGISTRY  # noqa: E402
from marbles_rq.engine.execute import execute  # noqa: E402
from marbles_rq.engine.ops import RunRequest, prepare  # noqa: E402
from marbles_rq.engine.runs import RunStore  # noqa: E402
from marbles_rq.store import open_store  # noqa: E402
from marbles_rq.transport.dispatch import rq_connection  # noqa: E402
from tests.otlp_receiver import Received, Receiver  # noqa: E402
from tests.procs import REPO_ROOT, Procs, wait_for  # noqa: E402
from tests.web_stack import start_web  # noqa: E402

# What a process of these tests needs on its path to import the otel extra.
OTEL_PATH = {"PYTHONPATH": str(OTEL)} if OTEL.is_dir() else {}

PROCS_SOURCES = [REPO_ROOT / "tests" / "tracing_workflows.py"]
API_TOKEN = "api-token-tracing-0123456789abcdef"

CRASH: list[bool] = []


class Crash(BaseException):
    """Stands in for the process dying mid-attempt: nothing is settled."""


@mr.step
def trc_first(n: int) -> int:
    return n + 1


@mr.step
def trc_second(n: int) -> int:
    return n * 10


@mr.workflow("trc_crash")
def trc_crash(ctx: mr.RunContext, inp: dict[str, int]) -> int:
    a = trc_first(inp["n"])
    if CRASH:
        raise Crash
    ctx.log.info("second step next")
    return trc_second(a)


class Recorder(InMemorySpanExporter):
    """The in-memory exporter, with the provider it is attached to."""

    def __init__(self) -> None:
        super().__init__()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self))


@pytest.fixture
def spans() -> Iterator[Recorder]:
    recorder = Recorder()
    tracing.use_provider(recorder.provider)
    try:
        yield recorder
    finally:
        tracing.disable()
        recorder.provider.shutdown()


def _one(found: list[ReadableSpan], name: str) -> ReadableSpan:
    named = [s for s in found if s.name == name]
    assert len(named) == 1, (name, [s.name for s in found])
    return named[0]


def _parent(span: ReadableSpan) -> int:
    return span.parent.span_id if span.parent is not None else 0


def test_a_redelivered_attempt_joins_its_runs_trace(
        redis_url: str, spans: Recorder, caplog: pytest.LogCaptureFixture) -> None:
    runs = RunStore(open_store(redis_url))
    caller_tracer = TracerProvider().get_tracer("app")
    with caller_tracer.start_as_current_span("caller") as caller:
        recorded = runs.record(prepare(RunRequest("trc_crash", b'{"n": 4}',
                                                  "trace-redelivered")))
    assert recorded.created
    record = recorded.record
    trace_id = caller.get_span_context().trace_id
    assert tracing.parse_traceparent(record.traceparent) is not None

    CRASH[:] = [True]  # attempt 1 dies after its first step, as under kill -9
    with pytest.raises(Crash):
        execute(runs, REGISTRY, record.id, 1, worker="w1", lease_ms=60_000, hard_exit=False)
    assert runs.abandon(record.id, 1, "w1") == "ok"
    ctl = Controller(runs, rq_connection(redis_url))
    assert ctl.lead() and ctl.reap() == 1
    CRASH.clear()
    with caplog.at_level(logging.INFO):
        assert execute(runs, REGISTRY, record.id, 2, worker="w2", lease_ms=60_000,
                       hard_exit=False) == "succeeded"

    found = list(spans.get_finished_spans())
    assert {s.context.trace_id for s in found} == {trace_id}, [s.name for s in found]
    enqueue = _one(found, "enqueue trc_crash")
    assert _parent(enqueue) == caller.get_span_context().span_id
    run = _one(found, "run trc_crash")
    assert run.context.span_id == tracing.run_span_id(record.id)
    assert _parent(run) == enqueue.context.span_id
    assert run.start_time == record.requested_at_ms * 1_000_000
    assert run.attributes is not None and run.attributes["marbles.status"] == "succeeded"
    attempts = sorted((s for s in found if s.name == "attempt trc_crash"),
                      key=lambda s: s.attributes["marbles.delivery"] if s.attributes else 0)
    assert [a.attributes["marbles.delivery"] for a in attempts if a.attributes] == [1, 2]
    assert {_parent(a) for a in attempts} == {run.context.span_id}
    assert attempts[0].attributes and attempts[0].attributes["marbles.worker"] == "w1"
    # The first step ran in attempt 1; attempt 2 replayed it and ran only the second.
    assert _parent(_one(found, "step trc_first")) == attempts[0].context.span_id
    assert _parent(_one(found, "step trc_second")) == attempts[1].context.span_id

    view = runs.get(record.id)
    assert view is not None and view.to_json()["trace_id"] == f"{trace_id:032x}"
    lines = [r.getMessage() for r in caplog.records if "second step next" in r.getMessage()]
    assert lines and all(f"trace_id={trace_id:032x}" in line for line in lines), lines


def test_a_run_enqueued_without_tracing_still_has_one_trace(
        redis_url: str, spans: Recorder) -> None:
    runs = RunStore(open_store(redis_url))
    tracing.disable()
    recorded = runs.record(prepare(RunRequest("trc_crash", b'{"n": 1}', "trace-untraced")))
    assert recorded.created and recorded.record.traceparent == ""
    record = recorded.record
    tracing.use_provider(spans.provider)  # the worker traces; its enqueuer did not
    assert execute(runs, REGISTRY, record.id, 1, worker="w1", lease_ms=60_000,
                   hard_exit=False) == "succeeded"
    found = list(spans.get_finished_spans())
    derived = tracing.run_trace_id(record.id)
    assert {s.context.trace_id for s in found} == {derived}
    run = _one(found, "run trc_crash")
    assert run.parent is None and run.context.span_id == tracing.run_span_id(record.id)
    view = runs.get(record.id)
    assert view is not None and view.to_json()["trace_id"] == f"{derived:032x}"


def test_signals_and_inbound_events_have_spans(redis_url: str, spans: Recorder) -> None:
    """A signal's span, failed when the run does not exist; an inbound event's span, with the
    enqueue of the run its trigger starts under it."""
    import tests.tracing_workflows  # noqa: F401  (the event's trigger)
    from marbles_rq.engine.signals import send_signal
    from marbles_rq.errors import MarblesError
    from marbles_rq.triggers.events import send_event

    runs = RunStore(open_store(redis_url))
    rq = rq_connection(redis_url)
    record = prepare(RunRequest("trc_crash", b'{"n": 1}', "trace-signalled"))
    assert runs.record(record).created
    send_signal(runs, "trace-signalled", "nudge", {"x": 1})
    with pytest.raises(MarblesError):
        send_signal(runs, "trace-nobody", "nudge", 1)
    sent = send_event(runs, rq, "tr-shop", "evt-1", type="paid", payload=b'{"sku": 1}')
    assert sent.created

    found = list(spans.get_finished_spans())
    signals = [s for s in found if s.name == "signal nudge"]
    assert [s.attributes["marbles.run_id"] for s in signals if s.attributes] == [
        "trace-signalled", "trace-nobody"]
    assert signals[0].status.is_ok and not signals[1].status.is_ok
    event = _one(found, "event tr-shop")
    assert event.attributes and event.attributes["marbles.event_type"] == "paid"
    enqueue = _one(found, "enqueue tr_on_paid")
    assert _parent(enqueue) == event.context.span_id
    assert enqueue.attributes and enqueue.attributes["marbles.origin"] == "event"


def test_a_bad_traceparent_is_not_a_trace() -> None:
    for bad in ("", "garbage", "00-xyz-abc-01", "01-" + "1" * 32 + "-" + "1" * 16 + "-01",
                "00-" + "0" * 32 + "-" + "1" * 16 + "-01"):
        assert tracing.parse_traceparent(bad) is None, bad
    good = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    assert tracing.parse_traceparent(good) == (int("ab" * 16, 16), int("cd" * 8, 16), 1)
    assert tracing.run_trace_id("r", good) == int("ab" * 16, 16)


def test_tracing_off_imports_no_opentelemetry(redis_url: str) -> None:
    probe = (
        "import sys, json\n"
        "from marbles_rq.engine.ops import RunRequest, prepare\n"
        "from marbles_rq.engine.runs import RunStore\n"
        "from marbles_rq.store import open_store\n"
        "import tests.tracing_workflows\n"
        "runs = RunStore(open_store(sys.argv[1]))\n"
        "r = prepare(RunRequest('tr_child', b'{\"n\": 1}', 'trace-off'))\n"
        "r = runs.record(r).record\n"
        "view = runs.get('trace-off').to_json()\n"
        "from marbles_rq import tracing\n"
        "print(json.dumps([r.traceparent, view['trace_id'], tracing._tracer is None,"
        " sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace',"
        " 'opentelemetry.exporter', 'opentelemetry.propagate')))]))\n")
    env = {"PATH": "/usr/bin:/bin", "MARBLES_TRACING": "0", **OTEL_PATH}
    done = subprocess.run([sys.executable, "-c", probe, redis_url], capture_output=True,
                          text=True, cwd=REPO_ROOT, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    # (redis-py imports OpenTelemetry's metrics SDK itself wherever it is installed.)
    traceparent, trace_id, no_tracer, imported = json.loads(done.stdout.splitlines()[-1])
    assert traceparent == "" and no_tracer and imported == []
    assert trace_id == f"{tracing.run_trace_id('trace-off'):032x}"


def test_a_bad_switch_is_a_one_line_error(redis_url: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "MARBLES_TRACING": "maybe"}
    done = subprocess.run([sys.executable, "-m", "marbles_rq", "--redis-url",
                           redis_url, "--source", "tests/tracing_workflows.py",
                           "worker"], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=env, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "error: MARBLES_TRACING must be 1 or 0, not 'maybe'"


# -- end to end: real processes exporting over OTLP/HTTP -----------------------------------------


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.close()


def _by_name(found: list[Received], name: str, count: int = 1) -> list[Received]:
    named = [s for s in found if s.name == name]
    assert len(named) == count, (name, sorted(s.name for s in found))
    return named


def test_a_run_with_steps_and_a_child_is_one_trace_across_processes(
        procs: Procs, receiver: Receiver) -> None:
    procs.env.update(MARBLES_TRACING="1", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, **OTEL_PATH,
                     OTEL_SERVICE_NAME="marbles-e2e", OTEL_BSP_SCHEDULE_DELAY="100")
    web = start_web(procs, extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    worker = procs.worker()
    procs.controller()
    trace_hex, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    start = json.dumps({"workflow": "tr_parent", "input": {"n": 3}, "id": "trace-e2e"})
    done = subprocess.run(
        ["curl", "-sS", "-X", "POST", "-H", f"Authorization: Bearer {API_TOKEN}",
         "-H", "Content-Type: application/json",
         "-H", f"traceparent: 00-{trace_hex}-{caller_span}-01",
         "--data-binary", start, "-w", "\n%{http_code}", web.url + "/api/runs"],
        capture_output=True, text=True, timeout=60)
    assert done.stdout.rsplit("\n", 1)[-1] == "201", done.stdout + done.stderr
    procs.observer.wait_status("trace-e2e", "succeeded", timeout=60)

    def complete() -> list[Received] | None:
        found = receiver.received()
        names = [s.name for s in found]
        return found if {"run tr_parent", "run tr_child", "POST /api/runs"} <= set(
            names) else None

    found = wait_for(complete, timeout=30, what="the run's spans at the OTLP receiver")
    assert {s.trace_id for s in found} == {trace_hex}, sorted((s.name, s.trace_id)
                                                            for s in found)
    mine = found

    (server,) = _by_name(mine, "POST /api/runs")
    assert server.parent_id == caller_span and server.service == "marbles-e2e"
    (enqueue,) = _by_name(mine, "enqueue tr_parent")
    assert enqueue.parent_id == server.span_id
    (run,) = _by_name(mine, "run tr_parent")
    assert run.parent_id == enqueue.span_id
    assert run.span_id == f"{tracing.run_span_id('trace-e2e'):016x}"
    # Two deliveries: the first runs both steps and starts the child, then parks on it; the
    # second, woken by the child's settle, finishes.
    attempts = sorted(_by_name(mine, "attempt tr_parent", 2),
                      key=lambda s: s.attributes["marbles.delivery"])
    assert {a.parent_id for a in attempts} == {run.span_id}
    assert [a.attributes["marbles.outcome"] for a in attempts] == ["parked", "succeeded"]
    for step in ("step tr_fetch", "step tr_double"):
        assert _by_name(mine, step)[0].parent_id == attempts[0].span_id
    (child_enqueue,) = _by_name(mine, "enqueue tr_child")
    assert child_enqueue.parent_id == attempts[0].span_id
    (child_run,) = _by_name(mine, "run tr_child")
    assert child_run.parent_id == child_enqueue.span_id
    (child_attempt,) = _by_name(mine, "attempt tr_child")
    assert child_attempt.parent_id == child_run.span_id
    assert _by_name(mine, "step tr_child_step")[0].parent_id == child_attempt.span_id
    assert run.start_ns <= attempts[0].start_ns and attempts[1].end_ns <= run.end_ns + 10**9

    # The trace id in the run's status (CLI and client) and in the worker's log lines.
    status = procs.cli("status", "trace-e2e", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["trace_id"] == trace_hex
    with mr.connect(procs.url) as client:
        assert client.status("trace-e2e").trace_id == trace_hex
    line = next(x for x in worker.text().splitlines() if "steps done: 8" in x)
    assert f"trace_id={trace_hex}" in line

    # `marbles-rq enqueue` with tracing on: its enqueue span starts a trace of its own (no
    # caller), exported before the command exits, and the run's spans join it.
    done = procs.cli("enqueue", "tr_child", "--input", '{"n": 1}', "--id", "trace-cli")
    assert done.returncode == 0, done.stderr
    procs.observer.wait_status("trace-cli", "succeeded", timeout=60)
    cli_trace = json.loads(procs.cli("status", "trace-cli", "--json").stdout)["trace_id"]
    assert cli_trace != trace_hex

    def cli_spans() -> list[Received] | None:
        got = [s for s in receiver.received() if s.trace_id == cli_trace]
        return got if {s.name for s in got} >= {"enqueue tr_child", "run tr_child"} else None

    got = wait_for(cli_spans, timeout=30, what="the CLI-enqueued run's spans")
    (cli_enqueue,) = _by_name(got, "enqueue tr_child")
    assert cli_enqueue.parent_id == ""
    assert _by_name(got, "run tr_child")[0].parent_id == cli_enqueue.span_id
