"""The `marbles-rq` command line. Exit codes: 0 ok; 1 the thing asked about is not ok (a
doctor problem, a failed run) or an unexpected error; 2 bad input; 3 Redis unreachable,
refused or unsafe. Every failure is one line on stderr; --debug (or MARBLES_DEBUG=1) adds
the traceback of an unexpected one."""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

import click
import redis

from ..deployment import Settings
from ..engine.authoring import SOURCE_ENV
from ..errors import (
    BucketMismatchError,
    ConfigError,
    InvalidIdError,
    MarblesError,
    RedisUnavailableError,
    UnsafeRedisError,
)
from ..store.connection import DEFAULT_URL, URL_ENV, refused, unavailable
from ..store.keys import DEFAULT_BUCKETS, DEFAULT_PREFIX
from .exits import EXIT_INPUT, EXIT_PROBLEM, EXIT_REDIS

if TYPE_CHECKING:
    # The modules _COMMANDS names, imported by name when a command is looked up: listed here
    # for the import-graph test (tests/test_import_cycles.py), which reads import statements.
    from . import (  # noqa: F401
        control,
        dev,
        doctor,
        dryrun,
        events,
        health,
        layout,
        procs,
        published,
        rerun,
        runs,
        schedules,
        signals,
        waits,
        web,
    )

DEBUG_ENV = "MARBLES_DEBUG"


def _version() -> str:
    from .. import __version__

    return __version__


# Every subcommand: its name -> (its module in this package, the command's name there).
_COMMANDS: dict[str, tuple[str, str]] = {
    "enqueue": ("runs", "enqueue"), "status": ("runs", "status"), "runs": ("runs", "runs_cmd"),
    "watch": ("runs", "watch"), "cancel": ("runs", "cancel"),
    "answer": ("waits", "answer"), "approve": ("waits", "approve"),
    "reject": ("waits", "reject"), "feed": ("waits", "feed"), "pause": ("waits", "pause"),
    "resume": ("waits", "resume"),
    "worker": ("procs", "worker"), "controller": ("procs", "controller"),
    "doctor": ("doctor", "doctor"),
    "leader": ("control", "leader"), "roll": ("control", "roll"), "list": ("control", "list_cmd"),
    "events": ("events", "events"), "schedules": ("schedules", "schedules"),
    "dev": ("dev", "dev"), "health": ("health", "health"), "web": ("web", "web"),
    "buckets": ("layout", "buckets"), "rerun": ("rerun", "rerun"), "run": ("dryrun", "run_cmd"),
    "get": ("published", "get"),
    "signal": ("signals", "signal"),
}


class _LazyGroup(click.Group):
    """The top-level group: a subcommand's module is imported when the command is looked up
    (to run it, complete it, or list it in --help), so a process imports what its one command
    needs; the tests start hundreds of them."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *_COMMANDS})

    def get_command(self, ctx: click.Context | None, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in _COMMANDS:
            module, name = _COMMANDS[cmd_name]
            command: click.Command = getattr(importlib.import_module(f".{module}", __name__),
                                             name)
            _accept_connection_options(command)
            self.add_command(command, cmd_name)
        return self.commands.get(cmd_name)

    def resolve_command(self, ctx: click.Context,
                        args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in self.commands and args[0] not in _COMMANDS:
            _register()  # an unknown name: click's error (its suggestions) sees every command
        return super().resolve_command(ctx, args)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=_version(), prog_name="marbles-rq", message="%(prog)s %(version)s")
@click.option("--redis-url", envvar=URL_ENV, default=DEFAULT_URL, show_default=True,
              help=f"Redis URL (env {URL_ENV}); redis+cluster://host:port for a cluster.")
@click.option("--prefix", envvar="MARBLES_PREFIX", default=DEFAULT_PREFIX, show_default=True,
              help="Key prefix of this deployment (env MARBLES_PREFIX).")
@click.option("--buckets", envvar="MARBLES_BUCKETS", default=None, type=int,
              help=f"Bucket count of a new deployment (default {DEFAULT_BUCKETS}); an existing "
                   f"one uses its recorded count, and a different value is refused "
                   f"(env MARBLES_BUCKETS; see `buckets grow`).")
@click.option("--lane-count", "lanes", envvar="MARBLES_LANE_COUNT", default=None, type=int,
              help="Lane count of a new deployment: RQ keyspaces and controller shards "
                   "(default 1, or one per master on a Redis Cluster); an existing one uses "
                   "its recorded count (env MARBLES_LANE_COUNT).")
@click.option("--source", envvar=SOURCE_ENV, default=None,
              help="Workflow definitions: a module path, a file, or a folder of modules "
                   "(env MARBLES_SOURCE).")
@click.option("--rq-url", envvar="MARBLES_RQ_URL", default=None,
              help="Redis for RQ's queues if not the store's: a server, or a cluster "
                   "(redis+cluster://) whose lanes follow their masters (env MARBLES_RQ_URL).")
@click.option("--debug", is_flag=True,
              help=f"Show the traceback of an unexpected error (env {DEBUG_ENV}=1).")
@click.pass_context
def cli(ctx: click.Context, redis_url: str, prefix: str, buckets: int | None,
        lanes: int | None, source: str | None, rq_url: str | None, debug: bool) -> None:
    """Durable workflows on Redis with RQ workers."""
    ctx.obj = Settings(redis_url, prefix, buckets, source, rq_url, lanes=lanes)


# The connection options, also accepted after the command name (`marbles-rq status RUN
# --redis-url URL`), where they win over the same option given before it. They take no
# default and no environment variable there: the group's own options carry those.
_AFTER: tuple[tuple[str, str, Any, str], ...] = (
    ("--redis-url", "redis_url", str, "Redis URL (as before the command)."),
    ("--prefix", "prefix", str, "Key prefix (as before the command)."),
    ("--buckets", "buckets", int, "Bucket count (as before the command)."),
    ("--lane-count", "lanes", int, "Lane count (as before the command)."),
    ("--source", "source", str, "Workflow definitions (as before the command)."),
    ("--rq-url", "rq_url", str, "Redis for RQ's queues (as before the command)."),
)


def _set_setting(attr: str) -> Any:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is None:
            return
        settings = ctx.find_object(Settings)
        if settings is not None:
            setattr(settings, attr, value)

    return callback


def _accept_connection_options(command: click.Command) -> None:
    """Give `command` (and a group's subcommands) the connection options and --debug."""
    taken = {opt for p in command.params for opt in getattr(p, "opts", [])}
    for flag, attr, kind, text in _AFTER:
        if flag not in taken:
            # A name of its own: `events send SOURCE` has an argument called source.
            command.params.append(click.Option(
                [flag, f"connection_{attr}"], type=kind, default=None, expose_value=False,
                is_eager=True, callback=_set_setting(attr), help=text))
    if "--debug" not in taken:
        # main() reads --debug from the whole command line; here it only has to be accepted.
        command.params.append(click.Option(["--debug", "connection_debug"], is_flag=True,
                                           expose_value=False,
                                           help="Show the traceback of an unexpected error."))
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _accept_connection_options(sub)


def _register() -> None:
    """Load every subcommand (the full command tree, e.g. for generated docs); `main` loads
    only the one it runs."""
    for name in _COMMANDS:
        cli.get_command(None, name)


def main(argv: list[str] | None = None) -> None:
    """Entry point: every expected failure becomes one line on stderr and an exit code."""
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
        from ..engine.execution import RunNotFoundError
        from ..triggers.schedule_spec import UnknownScheduleError

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
