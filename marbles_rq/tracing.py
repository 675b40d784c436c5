"""OpenTelemetry tracing: every span marbles-rq makes, behind helpers that cost nothing when off.

Off unless MARBLES_TRACING=1 (and the ``otel`` extra installed); until then no helper
imports OpenTelemetry, and each is one test of a module global. On, a process exports with
the SDK's OTLP/HTTP exporter configured by the standard ``OTEL_*`` variables
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER ...), unless the
application installed a tracer provider of its own first, which is then used.

The shape of a run's trace (docs/operate/tracing.md)::

    enqueue <workflow>            the caller's span (client, CLI, HTTP API, a parent's step)
      run <workflow>              enqueue to settle; written by the worker that settles it
        attempt <workflow>        one per delivery (a redelivery, a resumption after a wait)
          step <name>             one per try of a step's function
            enqueue <child>       a child run: its own run span and attempts below

A run spans processes and days, so no process can hold its span open. Its identity is fixed
instead: the enqueue span's W3C traceparent is stored on the run record when the run is
created, and the run span's id is derived from the run id. Every attempt, on whichever
worker and however often redelivered (a kill -9 included), starts as a child of that id and
lands in the same trace; the worker that settles the run then writes the run span itself,
with that id and the run's creation time as its start. A run enqueued while tracing was
off gets a trace id derived from its run id, so its attempts still share one trace.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from .envvars import TRACING_ENV, env_flag
from .errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    from .store.records import RunRecord

ENV = TRACING_ENV
TRACER_NAME = "marbles_rq"

log = logging.getLogger(__name__)

_state: bool | None = None  # None: the environment not read yet
_lock = threading.Lock()
_tracer: Any = None
_provider: Any = None
_ids: Any = None  # the id generator that can be told the run span's ids
# The trace id of the attempt this thread (context) executes, for the worker's log lines.
_log_trace: contextvars.ContextVar[str] = contextvars.ContextVar("marbles_trace", default="")


def enabled() -> bool:
    """Whether this process traces (MARBLES_TRACING=1 and OpenTelemetry installed). The first
    call reads the environment and, when on, sets tracing up."""
    if _state is None:
        _configure()
    return bool(_state)


def _configure() -> None:
    global _state
    with _lock:
        if _state is not None:
            return
        try:
            on = env_flag(ENV)
        except ConfigError:
            _state = False
            raise
        if not on:
            _state = False
            return
        try:
            _setup()
        except ImportError as exc:
            _state = False
            log.warning("%s=1 but OpenTelemetry is not installed (%s): tracing is off; "
                        "install marbles-rq[otel]", ENV, exc)
            return
        _state = True


def _setup(provider: Any = None) -> None:
    """Use the application's tracer provider if it set one, else build the SDK's with an
    OTLP/HTTP exporter (its OTEL_* variables apply)."""
    global _tracer, _provider, _ids
    from opentelemetry import trace

    if provider is None:
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider):
            provider = _sdk_provider()
            trace.set_tracer_provider(provider)
    generator = getattr(provider, "id_generator", None)
    if generator is not None and not isinstance(generator, _run_id_generator_class()):
        generator = _run_id_generator_class()(generator)
        provider.id_generator = generator
    _ids, _provider = generator, provider
    _tracer = provider.get_tracer(TRACER_NAME)
    _install_log_factory()


def _sdk_provider() -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "marbles-rq"}
    provider = TracerProvider(resource=Resource.create(attributes))
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip() == "console":
        exporter: Any = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def use_provider(provider: Any) -> None:
    """Trace through `provider` (an SDK TracerProvider) from now on, whatever the environment
    says: for an application that sets tracing up itself, and for tests."""
    global _state
    with _lock:
        _setup(provider)
        _state = True


def disable() -> None:
    """Stop tracing in this process (spans already made are exported as usual)."""
    global _state
    with _lock:
        _state = False


def _run_id_generator_class() -> type[Any]:
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    global _RunIdGenerator
    if _RunIdGenerator is None:
        class RunIdGenerator(IdGenerator):
            """The provider's own generator, except for the one span whose ids are fixed in
            advance (a run span), told by `fixed` on this thread."""

            def __init__(self, inner: Any) -> None:
                self.inner = inner
                self.local = threading.local()

            def generate_span_id(self) -> int:
                fixed = getattr(self.local, "span_id", 0)
                return fixed or int(self.inner.generate_span_id())

            def generate_trace_id(self) -> int:
                fixed = getattr(self.local, "trace_id", 0)
                return fixed or int(self.inner.generate_trace_id())

        _RunIdGenerator = RunIdGenerator
    return _RunIdGenerator


_RunIdGenerator: type[Any] | None = None


def _install_log_factory() -> None:
    """Log lines written while an attempt executes carry its trace id (` trace_id=...`)."""
    previous: Callable[..., logging.LogRecord] = logging.getLogRecordFactory()
    if getattr(previous, "_marbles_trace", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        trace_id = _log_trace.get()
        if trace_id and isinstance(record.msg, str):
            record.msg = f"{record.msg} trace_id={trace_id}"
        return record

    factory._marbles_trace = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


_flush_each = False  # a work-horse: it exits right after its delivery


def exit_after_each_delivery() -> None:
    """Called in a work-horse: its spans are exported when its delivery ends, since the
    process then exits without running any exit handler (a long-lived process exports
    them in the background, in batches)."""
    global _flush_each
    _flush_each = True


def flush() -> None:
    """Export what this process has buffered now."""
    if _state and _provider is not None:
        force = getattr(_provider, "force_flush", None)
        if force is not None:
            force(5000)


# -- ids (plain Python: the status of a run shows its trace id with tracing off) ---------------


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\x00".join(parts).encode()).digest()


def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) of a W3C traceparent, or None if it is not one."""
    parts = value.split("-")
    if len(parts) < 4 or parts[0] != "00" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    return (trace_id, span_id, flags) if trace_id and span_id else None


def run_trace_id(run_id: str, traceparent: str = "") -> int:
    """The trace a run's spans belong to: its enqueuer's, or one derived from its id."""
    parsed = parse_traceparent(traceparent) if traceparent else None
    if parsed is not None:
        return parsed[0]
    return int.from_bytes(_digest("trace", run_id)[:16], "big") or 1


def run_span_id(run_id: str) -> int:
    """The id of a run's span, which its attempts name as their parent."""
    return int.from_bytes(_digest("run", run_id)[:8], "big") or 1


def trace_id_hex(record: RunRecord) -> str:
    """The run's trace id as trace backends show it (32 hex digits)."""
    return f"{run_trace_id(record.id, record.traceparent):032x}"


# -- spans ---------------------------------------------------------------------------------------


class _NoSpan:
    """What every helper returns while tracing is off."""

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def set(self, key: str, value: Any) -> None:
        pass

    def begin(self, record: RunRecord, kind: str, worker: str) -> None:
        pass

    def end(self, status: str, settled: RunRecord | None = None,
            settled_ms: int = 0) -> None:
        pass


NO_SPAN = _NoSpan()


class _Span:
    """A span made current for the `with` block; an exception marks it as an error."""

    def __init__(self, name: str, kind: str, attributes: dict[str, Any],
                 parent: Any = None) -> None:
        from opentelemetry import context, trace

        self._context, self._trace = context, trace
        self.span = _tracer.start_span(name, context=parent, kind=getattr(trace.SpanKind, kind),
                                       attributes=attributes)
        self.token: Any = None

    def __enter__(self) -> _Span:
        self.token = self._context.attach(self._trace.set_span_in_context(self.span))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None and not isinstance(exc, Exception):
            # The engine's own stops (a park, a cancel) unwind through here: not failures.
            self.span.set_attribute("marbles.unwound_by", exc_type.__name__)
        elif exc is not None:
            self.span.record_exception(exc)
            self.span.set_status(self._trace.Status(self._trace.StatusCode.ERROR,
                                                    f"{exc_type.__name__}: {exc}"))
        self._context.detach(self.token)
        self.span.end()

    def set(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)


def span(name: str, kind: str = "INTERNAL", **attributes: Any) -> _Span | _NoSpan:
    """A span around a `with` block (signals, inbound events, commands)."""
    if not (_state if _state is not None else enabled()):
        return NO_SPAN
    return _Span(name, kind, attributes)


def enqueue_traceparent(record: RunRecord) -> str:
    """The span of a run's enqueue, under the caller's current span; returns its W3C
    traceparent to store on the record ("" while tracing is off)."""
    if not (_state if _state is not None else enabled()):
        return ""
    from opentelemetry import trace

    attributes = {"marbles.run_id": record.id, "marbles.workflow": record.name,
                  "marbles.queue": record.queue}
    if record.parent:
        attributes["marbles.parent_run_id"] = record.parent
    if record.origin:
        attributes["marbles.origin"] = record.origin
    made = _tracer.start_span(f"enqueue {record.name}", kind=trace.SpanKind.PRODUCER,
                              attributes=attributes)
    made.end()
    sc = made.get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def _run_parent(record: RunRecord) -> tuple[int, int, Any]:
    """(trace id, flags, the enqueue span's context or None) of a run."""
    from opentelemetry import trace

    parsed = parse_traceparent(record.traceparent) if record.traceparent else None
    if parsed is None:
        return run_trace_id(record.id), 1, None
    trace_id, span_id, flags = parsed
    enqueue = trace.SpanContext(trace_id, span_id, is_remote=True,
                                trace_flags=trace.TraceFlags(flags & 1))
    return trace_id, flags & 1, trace.set_span_in_context(trace.NonRecordingSpan(enqueue))


class _Delivery:
    """One delivery's attempt span: `begin` once its run's record is known, `end` with its
    outcome (and, when this delivery settled the run, the run's span too)."""

    def __init__(self, run_id: str, attempt: int) -> None:
        self.run_id, self.attempt = run_id, attempt
        self.inner: _Span | None = None
        self.log_token: Any = None

    def begin(self, record: RunRecord, kind: str, worker: str) -> None:
        from opentelemetry import trace

        trace_id, flags, _ = _run_parent(record)
        run_span = trace.SpanContext(trace_id, run_span_id(record.id), is_remote=True,
                                     trace_flags=trace.TraceFlags(flags))
        parent = trace.set_span_in_context(trace.NonRecordingSpan(run_span))
        self.inner = _Span(f"attempt {record.name}", "CONSUMER", {
            "marbles.run_id": record.id, "marbles.workflow": record.name,
            "marbles.queue": record.queue, "marbles.delivery": self.attempt,
            "marbles.start_kind": kind, "marbles.worker": worker}, parent)
        self.inner.__enter__()
        self.log_token = _log_trace.set(f"{trace_id:032x}")

    def end(self, status: str, settled: RunRecord | None = None,
            settled_ms: int = 0) -> None:
        if self.inner is not None:
            from opentelemetry import trace

            self.inner.set("marbles.outcome", status)
            if status in ("failed", "timed_out"):
                self.inner.span.set_status(trace.Status(trace.StatusCode.ERROR, status))
            self.inner.__exit__(None, None, None)
            _log_trace.reset(self.log_token)
            self.inner = None
        if settled is not None:
            _run_span(settled, status, settled_ms)
        if _flush_each:
            flush()

    def __enter__(self) -> _Delivery:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.inner is not None:  # left by an exception (a Redis outage): unsettled
            self.inner.__exit__(exc_type, exc, tb)
            _log_trace.reset(self.log_token)
            self.inner = None
            if _flush_each:
                flush()


def delivery(run_id: str, attempt: int) -> _Delivery | _NoSpan:
    """The attempt span of one delivery of a run (a `with` block around its execution)."""
    if not (_state if _state is not None else enabled()):
        return NO_SPAN
    return _Delivery(run_id, attempt)


def _run_span(record: RunRecord, status: str, settled_ms: int) -> None:
    """Write the run's span, from its creation to its settle, with its fixed ids."""
    from opentelemetry import trace

    trace_id, _, parent = _run_parent(record)
    local = getattr(_ids, "local", None)
    if local is not None:
        local.trace_id, local.span_id = trace_id, run_span_id(record.id)
    try:
        made = _tracer.start_span(
            f"run {record.name}", context=parent, kind=trace.SpanKind.INTERNAL,
            start_time=record.requested_at_ms * 1_000_000,
            attributes={"marbles.run_id": record.id, "marbles.workflow": record.name,
                        "marbles.queue": record.queue, "marbles.status": status})
    finally:
        if local is not None:
            local.trace_id = local.span_id = 0
    if status != "succeeded":
        made.set_status(trace.Status(trace.StatusCode.ERROR, status))
    made.end(end_time=max(settled_ms, record.requested_at_ms) * 1_000_000)


def step(name: str, key: str, attempt: int) -> _Span | _NoSpan:
    """The span of one try of a step's function."""
    if not _state:
        return NO_SPAN
    return _Span(f"step {name}", "INTERNAL", {"marbles.step": key,
                                              "marbles.step_attempt": attempt})


# -- the HTTP API ------------------------------------------------------------------------------


def asgi(app: Any) -> Any:
    """`app` with a server span around each request of the HTTP API and of webhooks, joined
    to the caller's trace by its traceparent header; `app` itself while tracing is off."""
    if not enabled():
        return app

    from opentelemetry import trace
    from opentelemetry.propagate import extract

    async def traced(scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path.startswith("/api/") or path.startswith("/events/")):
            await app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope["method"]
        route = "/".join(path.split("/")[:3])  # no ids in a span's name
        status: list[int] = []

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        with _Span(f"{method} {route}", "SERVER",
                   {"http.request.method": method, "url.path": path},
                   extract(headers)) as made:
            await app(scope, receive, send_status)
            if status:
                made.set("http.response.status_code", status[0])
                if status[0] >= 500:
                    made.span.set_status(trace.Status(trace.StatusCode.ERROR))

    return traced
