"""The `marbles-rq` command line. Exit codes: 0 ok; 1 the thing asked about is not ok (a
doctor problem, a failed run) or an unexpected error; 2 bad input; 3 Redis unreachable,
refused or unsafe. Every failure is one line on stderr; --debug (or MARBLES_DEBUG=1) adds
the traceback of an unexpected one."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click
import redis

from ..engine.runs import RunStore
from ..errors import (
    BucketMismatchError,
    ConfigError,
    InvalidIdError,
    MarblesError,
    RedisUnavailableError,
    UnsafeRedisError,
)
from ..store import RedisStore, open_store
from ..store.connection import DEFAULT_URL, URL_ENV, check_url, connect, refused, unavailable
from ..store.keys import DEFAULT_BUCKETS, DEFAULT_PREFIX, Keyspace

EXIT_PROBLEM, EXIT_INPUT, EXIT_REDIS = 1, 2, 3
if TYPE_CHECKING:
    from ..transport.lanes import Lanes

DEBUG_ENV = "MARBLES_DEBUG"


@dataclass
class Settings:
    redis_url: str
    prefix: str
    buckets: int
    source: str | None = None
    rq_url: str | None = None
    lanes: int = 1
    _lanes: Lanes | None = field(default=None, repr=False)
    _store: RedisStore | None = field(default=None, repr=False)
    _reader: RedisStore | None = field(default=None, repr=False)
    _loaded: bool = field(default=False, repr=False)

    def load_source(self) -> None:
        """Import the workflow definitions named by --source (once)."""
        from ..engine.authoring import load_source

        if self.source and not self._loaded:
            for part in self.source.split(os.pathsep):
                load_source(part)
            self._loaded = True

    def runs(self, *, read_only: bool = False) -> RunStore:
        return RunStore(self.reader() if read_only else self.store())

    def rq(self) -> Lanes:
        """The deployment's lanes: RQ's queues, on --rq-url or the store's Redis."""
        from ..transport.lanes import open_lanes

        if self._lanes is None:
            url = self.rq_url or self.redis_url
            if self.rq_url:
                check_url(self.rq_url)  # one line that hides its password, as for --redis-url
            self._lanes = open_lanes(url, self.keys)
        return self._lanes

    def client(self) -> Any:
        return connect(self.redis_url)

    def store(self) -> RedisStore:
        if self._store is None:
            self._store = open_store(self.redis_url, prefix=self.prefix, buckets=self.buckets,
                                     lanes=self.lanes)
        return self._store

    def reader(self) -> RedisStore:
        """The store for commands that only read: it never records the deployment's meta."""
        if self._store is not None:
            return self._store
        if self._reader is None:
            self._reader = open_store(self.redis_url, prefix=self.prefix, buckets=self.buckets,
                                      lanes=self.lanes, read_only=True)
        return self._reader

    @property
    def keys(self) -> Keyspace:
        return Keyspace(self.prefix, self.buckets, self.lanes)


@click.group()
@click.option("--redis-url", envvar=URL_ENV, default=DEFAULT_URL, show_default=True,
              help=f"Redis URL (env {URL_ENV}); redis+cluster://host:port for a cluster.")
@click.option("--prefix", envvar="MARBLES_PREFIX", default=DEFAULT_PREFIX, show_default=True,
              help="Key prefix of this deployment (env MARBLES_PREFIX).")
@click.option("--buckets", envvar="MARBLES_BUCKETS", default=DEFAULT_BUCKETS, show_default=True,
              type=int, help="Bucket count, fixed per deployment (env MARBLES_BUCKETS).")
@click.option("--lane-count", "lanes", envvar="MARBLES_LANE_COUNT", default=1,
              show_default=True, type=int,
              help="Lane count, fixed per deployment: RQ keyspaces (one per cluster master) "
                   "and controller shards (env MARBLES_LANE_COUNT).")
@click.option("--source", envvar="MARBLES_SOURCE", default=None,
              help="Workflow definitions: a module path, a file, or a folder of modules "
                   "(env MARBLES_SOURCE).")
@click.option("--rq-url", envvar="MARBLES_RQ_URL", default=None,
              help="Redis for RQ's queues if not the store's: a server, or a cluster "
                   "(redis+cluster://) whose lanes follow their masters (env MARBLES_RQ_URL).")
@click.option("--debug", is_flag=True,
              help=f"Show the traceback of an unexpected error (env {DEBUG_ENV}=1).")
@click.pass_context
def cli(ctx: click.Context, redis_url: str, prefix: str, buckets: int, lanes: int,
        source: str | None, rq_url: str | None, debug: bool) -> None:
    """Durable workflows on Redis with RQ workers."""
    ctx.obj = Settings(redis_url, prefix, buckets, source, rq_url, lanes)


def _register() -> None:
    from . import control, dev, doctor, events, health, procs, runs, schedules, waits, web

    for command in (runs.enqueue, runs.status, runs.runs_cmd, runs.watch, runs.cancel,
                    waits.answer, waits.approve, waits.reject, waits.feed, waits.pause,
                    waits.resume, procs.worker, procs.controller, doctor.doctor,
                    control.leader, control.roll, control.list_cmd, events.events,
                    schedules.schedules, dev.dev, health.health, web.web):
        cli.add_command(command)


def main(argv: list[str] | None = None) -> None:
    """Entry point: every expected failure becomes one line on stderr and an exit code."""
    _register()
    try:
        cli.main(args=argv, prog_name="marbles-rq", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as exc:
        exc.show()  # bare `marbles-rq`: the help, as click prints it, is the useful answer
        sys.exit(EXIT_INPUT)
    except click.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        _fail(exc.format_message() + hint, EXIT_INPUT)
    except click.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except (ConfigError, InvalidIdError, BucketMismatchError) as exc:
        _fail(str(exc), EXIT_INPUT)
    except (RedisUnavailableError, UnsafeRedisError) as exc:
        _fail(str(exc), EXIT_REDIS)
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError) as exc:
        _fail(str(unavailable(_url_from(argv), exc)), EXIT_REDIS)
    except redis.ResponseError as exc:  # OOM, MISCONF, READONLY, NOPERM ... on any command
        _fail(str(refused(exc)), EXIT_REDIS)
    except redis.RedisError as exc:
        _fail(f"Redis: {type(exc).__name__}: {_first_line(exc)}", EXIT_REDIS)
    except MarblesError as exc:
        from ..engine.authoring import DefinitionError, InputError, UnknownWorkflowError
        from ..engine.runs import RunNotFoundError
        from ..triggers.schedules import UnknownScheduleError

        bad_input = (DefinitionError, InputError, UnknownWorkflowError, RunNotFoundError,
                     UnknownScheduleError)
        _fail(str(exc), EXIT_INPUT if isinstance(exc, bad_input) else EXIT_PROBLEM)
    except Exception as exc:  # a bug or an unforeseen condition: still one line, not a dump
        if _debug(argv):
            import traceback

            traceback.print_exc()
        _fail(f"unexpected {type(exc).__name__}: {_first_line(exc)} (--debug or "
              f"{DEBUG_ENV}=1 shows the traceback)", EXIT_PROBLEM)
    sys.exit(0)


def _fail(message: str, code: int) -> None:
    from ..terminal import safe

    # safe(): a message may quote a value from Redis or the user; it stays one line.
    click.echo(f"error: {safe(message)}", err=True)
    sys.exit(code)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def _debug(argv: list[str] | None) -> bool:
    args = sys.argv[1:] if argv is None else argv
    return "--debug" in args or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _url_from(argv: list[str] | None) -> str:
    import os

    args = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(args):
        if arg == "--redis-url" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--redis-url="):
            return arg.split("=", 1)[1]
    return os.environ.get(URL_ENV) or DEFAULT_URL
