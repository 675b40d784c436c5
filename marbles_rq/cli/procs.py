"""Long-running processes: worker and controller."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import click
import redis

from .. import tracing
from ..deployment import Settings
from ..errors import ConfigError
from ..store.connection import unavailable
from ..store.doctor import require_durable

LOG_LEVELS = click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                          case_sensitive=False)


class FiniteFloatRange(click.FloatRange):
    """FloatRange that refuses nan and inf: nan passes every comparison, so
    `--interval nan` would be accepted and the controller would spin without sleeping."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _check_redis(settings: Settings, allow_unsafe: bool) -> None:
    require_durable(settings.store().client, allow_unsafe=allow_unsafe)
    if settings.rq_url and settings.rq_url != settings.redis_url:
        try:
            lanes = settings.rq()
            for conn in {id(c): c for c in [lanes.registration,
                                            *(lane.conn for lane in lanes.lanes)]}.values():
                require_durable(conn, allow_unsafe=allow_unsafe)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # Name RQ's Redis: the store's URL, which the generic handler would name, works.
            raise unavailable(settings.rq_url, exc) from None


def metrics_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--metrics-port and --metrics-bind (README, "Metrics")."""
    from ..metrics import BIND_ENV, DEFAULT_BIND, PORT_ENV

    fn = click.option("--metrics-bind", envvar=BIND_ENV, default=DEFAULT_BIND,
                      show_default=True,
                      help=f"Address of the metrics endpoint (env {BIND_ENV}).")(fn)
    return click.option("--metrics-port", envvar=PORT_ENV, type=click.IntRange(1, 65535),
                        default=None,
                        help=f"Serve Prometheus metrics on this port at /metrics (env "
                             f"{PORT_ENV}); off by default.")(fn)


def _queue_names(queues: str) -> list[str]:
    from ..engine.authoring import queue_problem

    names = [q.strip() for q in queues.split(",")]
    for name in names:
        problem = queue_problem(name)
        if problem is not None:
            raise click.BadParameter(problem, param_hint="'--queues'")
    return names


@click.command()
@click.option("--queues", "-q", default="default", show_default=True,
              help="Comma-separated RQ queues, in priority order.")
@click.option("--burst", is_flag=True, help="Exit when the queues are empty.")
@click.option("--pool", type=click.IntRange(1, 256), default=None,
              help="Run N non-forking executors instead of one forking worker.")
@click.option("--concurrency", type=click.IntRange(1, 1024), default=None,
              help="Execute up to N runs at once in each process (threads; async bodies on "
                   "each thread's event loop) instead of one forked work-horse per run.")
@click.option("--lease-ms", type=click.IntRange(1000, 3_600_000), default=10_000,
              show_default=True, help="Lease of a running execution; renewed every third.")
@click.option("--allow-unsafe-redis", is_flag=True,
              help="Start even if Redis could lose acknowledged writes (logged loudly).")
@click.option("--lanes", "lanes_text", default="all", show_default=True,
              help="The lanes to serve: 'all' or lane numbers, comma-separated. Each executor "
                   "serves its own lane first and helps the others when it is empty.")
@click.option("--log-level", type=LOG_LEVELS, default="INFO", show_default=True)
@metrics_options
@click.pass_obj
def worker(settings: Settings, queues: str, burst: bool, pool: int | None,
           concurrency: int | None, lease_ms: int,
           lanes_text: str, allow_unsafe_redis: bool, log_level: str, metrics_port: int | None,
           metrics_bind: str) -> None:
    """Execute run deliveries from RQ queues."""
    from ..engine.authoring import REGISTRY
    from ..engine.catalog import declare
    from ..engine.context import Limits
    from ..engine.execute import Engine
    from ..transport.worker import MarblesWorker, concurrent, run_pool, work
    from ..triggers.events import declare_triggers

    names = _queue_names(queues)
    if metrics_port is not None:
        from ..metrics import serve_metrics

        # Horses and --pool executors are forked: they count through files (metrics.py).
        serve_metrics(metrics_port, metrics_bind, multiprocess=True)
    serve = settings.rq().parse_indexes(lanes_text)
    # A worker without workflows would take deliveries only to fail every one of them.
    if not settings.source:
        raise ConfigError("a worker needs --source (env MARBLES_SOURCE): the workflows it runs")
    settings.load_source()
    if not REGISTRY.workflows:
        raise ConfigError(f"--source {settings.source!r} defines no workflow")
    if metrics_port is not None:
        from ..metrics import start_at_zero

        start_at_zero((w.name, w.queue) for w in REGISTRY.workflows.values())
    _logging(log_level)
    # Set up before any fork: every work-horse then traces with the parent's exporter.
    tracing.enabled()
    _check_redis(settings, allow_unsafe_redis)
    runs = settings.runs()
    # Callers that do not import the workflow code start its runs with these defaults, and
    # send events to these triggers (workflows first: a trigger found names a known one).
    declare(runs.client, runs.keys, REGISTRY)
    declare_triggers(runs.client, runs.keys)
    _declare_artifacts(runs)
    engine = Engine(runs, REGISTRY, worker_name="", lease_ms=lease_ms,
                    limits=Limits.from_env())
    logging.getLogger("marbles_rq.transport.worker").info(
        "workflows: %s", ", ".join(sorted(REGISTRY.workflows)))
    if pool:
        run_pool(engine, names, settings.rq(), size=pool, burst=burst, logging_level=log_level,
                 serve=serve, concurrency=concurrency or 1)
    else:
        cls = concurrent(concurrency) if concurrency else MarblesWorker
        work(engine, cls, names, settings.rq(), burst=burst, logging_level=log_level,
             serve=serve)


@click.command()
@click.option("--lease-ms", type=click.IntRange(1000, 600_000), default=10_000,
              show_default=True, help="The controller's own lease.")
@click.option("--interval", type=FiniteFloatRange(0.05, 60), default=0.5, show_default=True,
              help="Seconds between passes.")
@click.option("--allow-unsafe-redis", is_flag=True,
              help="Start even if Redis could lose acknowledged writes (logged loudly).")
@click.option("--log-level", type=LOG_LEVELS, default="INFO", show_default=True)
@metrics_options
@click.pass_obj
def controller(settings: Settings, lease_ms: int, interval: float, allow_unsafe_redis: bool,
               log_level: str, metrics_port: int | None, metrics_bind: str) -> None:
    """Lead a fair share of the lanes (with one lane: one elected controller, the others
    wait); redeliver vanished executions, dispatch recorded runs, fire schedules."""
    from ..controller.duties import default_duties
    from ..controller.share import Sharing

    if metrics_port is not None:
        from ..metrics import serve_metrics

        serve_metrics(metrics_port, metrics_bind)
    _logging(log_level)
    # `kill -USR2 PID` prints every thread's stack to the log: what a controller that has
    # gone quiet is doing, without stopping it.
    import faulthandler

    faulthandler.register(signal.SIGUSR2, all_threads=True)
    settings.load_source()  # schedules, triggers and monitors are declared beside workflows
    _check_redis(settings, allow_unsafe_redis)
    ctl = Sharing(settings.runs(), settings.rq(), lease_ms=lease_ms, interval_s=interval,
                  duties=default_duties)
    if metrics_port is not None:
        from ..controller.gauges import store_gauges
        from ..engine.authoring import REGISTRY
        from ..metrics import add_collector, start_at_zero

        add_collector(store_gauges(settings.runs(), settings.rq(), leading=ctl.leading))
        from ..triggers.batches import OpenBatchesGauge

        add_collector(OpenBatchesGauge(settings.runs()))
        from ..controller.rate_gauges import RateGauges

        add_collector(RateGauges(settings.runs(read_only=True)))
        from ..controller.blob_gauges import BlobGauges

        add_collector(BlobGauges(settings.runs(read_only=True)))
        start_at_zero((w.name, w.queue) for w in REGISTRY.workflows.values())

    def stop(_signum: int, _frame: Any) -> None:
        ctl.stop_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    ctl.run()
    # The lease is released. A monitor handler that hangs holds a pool thread that Python
    # would wait for at exit: a stopped controller must not, so leave without joining it.
    logging.shutdown()
    os._exit(0)


def _declare_artifacts(runs: Any) -> None:
    """The artifacts the source declares (`mr.artifact` at module level), listed before any
    version exists; a source that never imported marbles_rq.artifacts declares none."""
    handle = sys.modules.get("marbles_rq.artifacts.handle")
    if handle is not None:
        handle.declare_all(runs)
