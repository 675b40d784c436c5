"""Long-running processes: worker and controller."""

from __future__ import annotations

import logging
import signal
from typing import Any

import click

from ..doctor import require_durable
from . import Settings


def _logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _check_redis(settings: Settings, allow_unsafe: bool) -> None:
    require_durable(settings.store().client, allow_unsafe=allow_unsafe)
    if settings.rq_url and settings.rq_url != settings.redis_url:
        require_durable(settings.rq(), allow_unsafe=allow_unsafe)


@click.command()
@click.option("--queues", "-q", default="default", show_default=True,
              help="Comma-separated RQ queues, in priority order.")
@click.option("--burst", is_flag=True, help="Exit when the queues are empty.")
@click.option("--pool", type=click.IntRange(1, 256), default=None,
              help="Run N non-forking executors instead of one forking worker.")
@click.option("--lease-ms", type=click.IntRange(1000, 3_600_000), default=10_000,
              show_default=True, help="Lease of a running execution; renewed every third.")
@click.option("--allow-unsafe-redis", is_flag=True,
              help="Start even if Redis could lose acknowledged writes (logged loudly).")
@click.option("--log-level", default="INFO", show_default=True)
@click.pass_obj
def worker(settings: Settings, queues: str, burst: bool, pool: int | None, lease_ms: int,
           allow_unsafe_redis: bool, log_level: str) -> None:
    """Execute run deliveries from RQ queues."""
    from ..authoring import REGISTRY
    from ..execute import Engine
    from ..worker import MarblesWorker, run_pool, work

    _logging(log_level)
    settings.load_source()
    _check_redis(settings, allow_unsafe_redis)
    names = [q.strip() for q in queues.split(",") if q.strip()]
    engine = Engine(settings.runs(), REGISTRY, worker_name="", lease_ms=lease_ms)
    logging.getLogger("marbles_rq.worker").info(
        "workflows: %s", ", ".join(sorted(REGISTRY.workflows)) or "none (is --source set?)")
    if pool:
        run_pool(engine, names, settings.rq(), size=pool, burst=burst, logging_level=log_level)
    else:
        work(engine, MarblesWorker, names, settings.rq(), burst=burst, logging_level=log_level)


@click.command()
@click.option("--lease-ms", type=click.IntRange(1000, 600_000), default=10_000,
              show_default=True, help="The controller's own lease.")
@click.option("--interval", type=click.FloatRange(0.05, 60), default=0.5, show_default=True,
              help="Seconds between passes.")
@click.option("--allow-unsafe-redis", is_flag=True,
              help="Start even if Redis could lose acknowledged writes (logged loudly).")
@click.option("--log-level", default="INFO", show_default=True)
@click.pass_obj
def controller(settings: Settings, lease_ms: int, interval: float, allow_unsafe_redis: bool,
               log_level: str) -> None:
    """Elect one controller; it redelivers vanished executions and dispatches recorded runs."""
    from ..controller import Controller

    _logging(log_level)
    _check_redis(settings, allow_unsafe_redis)
    ctl = Controller(settings.runs(), settings.rq(), lease_ms=lease_ms, interval_s=interval)

    def stop(_signum: int, _frame: Any) -> None:
        ctl.stop_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    ctl.run()
