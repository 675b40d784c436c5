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

from .defaults import (
    COMPLETE_ENV,
    DEFAULT_BUCKETS,
    DEFAULT_PREFIX,
    DEFAULT_URL,
    SOURCE_ENV,
    URL_ENV,
)
from .exits import EXIT_INPUT, EXIT_PROBLEM, EXIT_REDIS

if TYPE_CHECKING:
    # The modules _COMMANDS names, imported by name when a command is looked up: listed here
    # for the import-graph test (tests/test_import_cycles.py), which reads import statements.
    from . import (  # noqa: F401
        artifacts,
        completion,
        control,
        dev,
        doctor,
        dryrun,
        events,
        failed_steps,
        health,
        info,
        layout,
        procs,
        published,
        replay,
        rerun,
        runs,
        schedules,
        sessions,
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
    "retry": ("failed_steps", "retry"), "fail": ("failed_steps", "fail"),
    "worker": ("procs", "worker"), "controller": ("procs", "controller"),
    "doctor": ("doctor", "doctor"),
    "leader": ("control", "leader"), "roll": ("control", "roll"), "list": ("control", "list_cmd"),
    "events": ("events", "events"), "schedules": ("schedules", "schedules"),
    "dev": ("dev", "dev"), "health": ("health", "health"), "web": ("web", "web"),
    "buckets": ("layout", "buckets"), "rerun": ("rerun", "rerun"), "run": ("dryrun", "run_cmd"),
    "export": ("replay", "export_cmd"), "replay": ("replay", "replay_cmd"),
    "get": ("published", "get"),
    "signal": ("signals", "signal"),
    "info": ("info", "info"), "completion": ("completion", "completion"),
    "limits": ("limits", "limits"),
    "locks": ("locks", "locks"),
    "sessions": ("sessions", "sessions"),
    "artifacts": ("artifacts", "artifacts"),
}

# How --help groups them: section -> (command, summary, example). Static, so the listing and
# the completion of command names import no command module; every command is in one
# section (tests/test_cli_help.py), and its example also ends its own --help.
SECTIONS: dict[str, list[tuple[str, str, str]]] = {
    "Runs": [
        ("enqueue", "Start a run of a workflow (--wait follows it).",
         "marbles-rq enqueue signup --input '{\"email\": \"a@example.com\"}' --wait"),
        ("run", "Run a workflow now and follow it (--dry-run: in this process).",
         "marbles-rq run signup --dry-run --input '{\"email\": \"a@example.com\"}'"),
        ("status", "Show one run: status, timings, steps, questions.",
         "marbles-rq status r-8f2c1"),
        ("runs", "List runs, newest first.", "marbles-rq runs --status failed --limit 20"),
        ("watch", "Print a run's output and follow it to the end.", "marbles-rq watch r-8f2c1"),
        ("cancel", "Cancel a run (and its children).", "marbles-rq cancel r-8f2c1"),
        ("pause", "Park a run at its next step boundary.", "marbles-rq pause r-8f2c1"),
        ("resume", "Resume a paused run.", "marbles-rq resume r-8f2c1"),
        ("retry", "Run the failed step a run is paused on again (--input-patch).",
         "marbles-rq retry r-8f2c1 --input-patch '{\"amount\": 5}'"),
        ("fail", "Give up the failed step a run is paused on.",
         "marbles-rq fail r-8f2c1 --reason 'card expired'"),
        ("rerun", "A new run of a finished run, optionally from a step.",
         "marbles-rq rerun r-8f2c1 --from-step charge"),
        ("get", "Print the value a run published under a key.",
         "marbles-rq get r-8f2c1 progress"),
        ("export", "Write run histories as JSON lines (for replay --check).",
         "marbles-rq export --workflow order --status waiting -o runs.jsonl"),
        ("replay", "Check new code against recorded runs before deploying it.",
         "marbles-rq replay --check --source app/ --workflow order"),
        ("artifacts", "Versioned outputs: list, show versions, get, put, delete.",
         "marbles-rq artifacts get weekly-report > report.html"),
    ],
    "Questions and signals": [
        ("feed", "Open questions across runs, then the newest reports.", "marbles-rq feed"),
        ("answer", "Answer a run's question.", "marbles-rq answer r-8f2c1 plan 2"),
        ("approve", "Approve a run's approval.",
         "marbles-rq approve r-8f2c1 refund --note 'checked'"),
        ("reject", "Reject a run's approval.", "marbles-rq reject r-8f2c1 refund"),
        ("signal", "Send a signal to a run.",
         "marbles-rq signal r-8f2c1 nudge --payload '{\"n\": 1}'"),
        ("sessions", "Sessions (transcripts): list, show, follow, append, delete.",
         "marbles-rq sessions show r-8f2c1 --follow"),
    ],
    "Schedules and triggers": [
        ("list", "What --source declares: workflows, schedules, monitors.",
         "marbles-rq --source app/flows.py list"),
        ("schedules", "Schedules with their history; pause and resume them.",
         "marbles-rq schedules pause nightly-report"),
        ("roll", "Run a workflow, schedule or monitor once, now.",
         "marbles-rq roll nightly-report"),
        ("events", "Inbound events; send one.",
         "marbles-rq events send github --id delivery-1 --payload '{}'"),
    ],
    "Operations": [
        ("info", "Queues and lanes, workers, leaders, waiting and failed runs.",
         "marbles-rq info"),
        ("dev", "Redis, a worker and a controller on this machine.",
         "marbles-rq --source examples/ dev"),
        ("worker", "Execute run deliveries from RQ queues.",
         "marbles-rq --source app/flows.py worker --queues default"),
        ("controller", "Lead the lanes: timers, retries, schedules, pruning.",
         "marbles-rq --source app/flows.py controller"),
        ("web", "Serve the dashboard, the HTTP API and webhooks.", "marbles-rq web --port 8080"),
        ("doctor", "Check Redis: durability, script permission, layout.", "marbles-rq doctor"),
        ("health", "Is this host's controller or worker alive?", "marbles-rq health worker"),
        ("leader", "Which controller leads (each lane's).", "marbles-rq leader"),
        ("limits", "Rate limits: rates, held runs; set one at run time.",
         "marbles-rq limits set stripe 25/s --burst 5"),
        ("locks", "Locks (mr.lock): each one's holder and waiters in order.",
         "marbles-rq locks --json"),
        ("buckets", "The bucket layout; grow the bucket count.", "marbles-rq buckets show"),
        ("completion", "Print the shell completion script.",
         "eval \"$(marbles-rq completion bash)\""),
    ],
}
_ABOUT = {name: (summary, example) for rows in SECTIONS.values()
          for name, summary, example in rows}
CONNECTION_FLAGS = ("--redis-url", "--prefix", "--buckets", "--lane-count", "--source",
                    "--rq-url")


class _LazyGroup(click.Group):
    """The top-level group: a subcommand's module is imported when the command is looked up
    (to run it or complete its arguments), so a process imports what its one command needs;
    the tests start hundreds of them. --help and the completion of command names read the
    static SECTIONS instead."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *_COMMANDS})

    def get_command(self, ctx: click.Context | None, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in _COMMANDS:
            module, name = _COMMANDS[cmd_name]
            command: click.Command = getattr(importlib.import_module(f".{module}", __name__),
                                             name)
            _accept_connection_options(command)
            _add_example(command, cmd_name)
            if COMPLETE_ENV in os.environ:  # completing: values for its arguments
                from .completion import attach_completers

                attach_completers(command, cmd_name)
            self.add_command(command, cmd_name)
        return self.commands.get(cmd_name)

    def resolve_command(self, ctx: click.Context,
                        args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in self.commands and args[0] not in _COMMANDS:
            _register()  # an unknown name: click's error (its suggestions) sees every command
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        for title, rows in SECTIONS.items():
            with formatter.section(title):
                formatter.write_dl([(name, summary) for name, summary, _ in rows])

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        connection: list[tuple[str, str]] = []
        other: list[tuple[str, str]] = []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                flags = getattr(param, "opts", [])
                (connection if set(flags) & set(CONNECTION_FLAGS) else other).append(record)
        with formatter.section("Connection options (also accepted after the command)"):
            formatter.write_dl(connection)
        with formatter.section("Options"):
            formatter.write_dl(other)
        self.format_commands(ctx, formatter)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_paragraph()
        formatter.write_text("Each command's --help shows its options and an example.")

    def shell_complete(self, ctx: click.Context,
                       incomplete: str) -> list[click.shell_completion.CompletionItem]:
        from click.shell_completion import CompletionItem

        if incomplete.startswith("-"):
            return super().shell_complete(ctx, incomplete)
        return [CompletionItem(name, help=_ABOUT[name][0] if name in _ABOUT else None)
                for name in self.list_commands(ctx) if name.startswith(incomplete)]


def _add_example(command: click.Command, name: str) -> None:
    """End the command's help (and its subcommands') with its example and the connection
    options' heading."""
    if isinstance(command, click.Group):
        for sub_name, sub in command.commands.items():
            _add_example(sub, f"{name} {sub_name}")
    if command.epilog:
        return
    # \b keeps click from rewrapping each block into one paragraph.
    example = f"\b\nExample:\n  {_ABOUT[name][1]}\n\n" if name in _ABOUT else ""
    command.epilog = (f"{example}\b\nConnection options (as before the command; see "
                      f"marbles-rq --help):\n  {', '.join(CONNECTION_FLAGS)}, --debug")


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
    from ..deployment import Settings

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
        from ..deployment import Settings

        settings = ctx.find_object(Settings)
        if settings is not None:
            setattr(settings, attr, value)

    return callback


class _ConnectionOption(click.Option):
    """A connection option after the command name: completed and parsed like any option,
    but listed under its own heading at the end of the command's help, not among the
    command's own options."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        return None


def _accept_connection_options(command: click.Command) -> None:
    """Give `command` (and a group's subcommands) the connection options and --debug."""
    taken = {opt for p in command.params for opt in getattr(p, "opts", [])}
    for flag, attr, kind, text in _AFTER:
        if flag not in taken:
            # A name of its own: `events send SOURCE` has an argument called source.
            command.params.append(_ConnectionOption(
                [flag, f"connection_{attr}"], type=kind, default=None, expose_value=False,
                is_eager=True, callback=_set_setting(attr), help=text))
    if "--debug" not in taken:
        # main() reads --debug from the whole command line; here it only has to be accepted.
        command.params.append(_ConnectionOption(["--debug", "connection_debug"], is_flag=True,
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
        # click lays a missing choice's options out on lines of their own ("Choose
        # from:\n\tbash,\n\tzsh"): one line here, not escaped newlines.
        _fail(exc.format_message().replace("\n\t", " ") + hint, EXIT_INPUT)
    except click.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except Exception as exc:
        known = _known_failure(exc, argv)
        if known is None:
            if _debug(argv):
                import traceback

                traceback.print_exc()
            # A bug or an unforeseen condition: still one line, not a dump.
            known = (f"unexpected {type(exc).__name__}: {_first_line(exc)} (--debug or "
                     f"{DEBUG_ENV}=1 shows the traceback)", EXIT_PROBLEM)
        _fail(*known)
    sys.exit(0)


def _known_failure(exc: Exception, argv: list[str] | None) -> tuple[str, int] | None:
    """(message, exit code) of an expected failure; None for anything else. The error
    classes are imported here: an error of a module that was never imported cannot occur,
    and `--version` imports neither redis nor the store."""
    errors = sys.modules.get("marbles_rq.errors")
    if errors is not None:
        if isinstance(exc, (errors.ConfigError, errors.InvalidIdError,
                            errors.BucketMismatchError)):
            return str(exc), EXIT_INPUT
        if isinstance(exc, (errors.RedisUnavailableError, errors.UnsafeRedisError)):
            return str(exc), EXIT_REDIS
    redis = sys.modules.get("redis")
    if redis is not None and isinstance(exc, redis.RedisError):
        from ..store.connection import refused, unavailable

        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError,
                            redis.AuthenticationError)):
            return str(unavailable(_url_from(argv), exc)), EXIT_REDIS
        if isinstance(exc, redis.ResponseError):  # OOM, MISCONF, READONLY, NOPERM ...
            return str(refused(exc)), EXIT_REDIS
        return f"Redis: {type(exc).__name__}: {_first_line(exc)}", EXIT_REDIS
    if errors is not None and isinstance(exc, errors.MarblesError):
        from ..engine.authoring import DefinitionError, InputError, UnknownWorkflowError
        from ..engine.execution import RunNotFoundError
        from ..flow.rate_specs import RateError
        from ..flow.rate_store import UnknownRateLimitError
        from ..triggers.schedule_spec import UnknownScheduleError

        bad_input: tuple[type[Exception], ...] = (
            DefinitionError, InputError, UnknownWorkflowError, RunNotFoundError,
            UnknownScheduleError, RateError, UnknownRateLimitError)
        found = sys.modules.get("marbles_rq.artifacts.errors")
        if found is not None:  # a conflict, an unknown artifact or version: exit 2
            bad_input += (found.ArtifactConflict, found.UnknownArtifactError,
                          found.UnknownArtifactVersionError)
        return str(exc), EXIT_INPUT if isinstance(exc, bad_input) else EXIT_PROBLEM
    return None


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
