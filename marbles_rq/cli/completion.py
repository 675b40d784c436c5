"""Shell completion: `marbles-rq completion bash|zsh|fish` prints the script, and the values
it completes (workflow names, run ids, schedule keys) are read here. A completer answers
from what it can reach within a short timeout and answers nothing otherwise: a shell must
never hang on a down Redis nor print a traceback into the command line."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator
from typing import Any

import click
from click.shell_completion import CompletionItem, get_completion_class

from .defaults import COMPLETE_ENV, DEFAULT_PREFIX, DEFAULT_URL, SOURCE_ENV, URL_ENV

TIMEOUT_S = 0.5  # per Redis call; a shell waits for the answer
MAX_ITEMS = 200


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the completion script for SHELL. Completes commands, options, workflow names
    (from the workers' catalog and --source), run ids and schedule keys."""
    cls = get_completion_class(shell)
    assert cls is not None  # every choice has one
    group = click.get_current_context().find_root().command  # the marbles-rq group
    click.echo(cls(group, {}, "marbles-rq", COMPLETE_ENV).source())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Whatever a completer's reads print (a source's own prints, warnings, log lines)
    must not land in the shell's command line."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _settings(ctx: click.Context) -> Any:
    from ..deployment import Settings

    params = ctx.find_root().params  # the group's options, parsed (not yet applied)
    return Settings(params.get("redis_url") or os.environ.get(URL_ENV) or DEFAULT_URL,
                    params.get("prefix") or os.environ.get("MARBLES_PREFIX") or DEFAULT_PREFIX,
                    None, params.get("source") or os.environ.get(SOURCE_ENV) or None, None)


def _client(settings: Any) -> Any:
    """A client that gives up fast (one try, short timeouts), or None when Redis does not
    answer a PING: completion reads, it never waits."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from ..store.connection import check_url

    check_url(settings.redis_url)
    if settings.redis_url.startswith("redis+cluster"):
        return None
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=TIMEOUT_S,
                                  socket_connect_timeout=TIMEOUT_S, retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    except (redis.RedisError, OSError):
        return None
    return client


def _safely(read: Callable[[click.Context, str], list[str]]) -> Any:
    def complete(ctx: click.Context, param: click.Parameter,
                 incomplete: str) -> list[CompletionItem]:
        try:
            with _quiet():
                found = read(ctx, incomplete)
        except BaseException:
            return []
        return [CompletionItem(v) for v in sorted(set(found)) if v.startswith(incomplete)][
            :MAX_ITEMS]

    return complete


def _workflow_names(ctx: click.Context, incomplete: str) -> list[str]:
    settings = _settings(ctx)
    names: list[str] = []
    if settings.source:
        with contextlib.suppress(BaseException):
            settings.load_source()
            from ..engine.authoring import REGISTRY

            names += list(REGISTRY.workflows)
    with contextlib.suppress(BaseException):
        from ..store.keys import Keyspace

        client = _client(settings)
        if client is not None:
            names += [k.decode() if isinstance(k, bytes) else str(k)
                      for k in client.hkeys(Keyspace(settings.prefix, 1).workflows)]
    return names


def _run_ids(ctx: click.Context, incomplete: str) -> list[str]:
    """The newest runs' ids (the first MAX_ITEMS across the buckets)."""
    from ..store.grow import read_state
    from ..store.keys import Keyspace

    settings = _settings(ctx)
    client = _client(settings)
    if client is None:
        return []
    state = read_state(client, settings.prefix)
    if state is None:
        return []
    keys = Keyspace(settings.prefix, state.buckets, lanes=state.lanes, layout=state.layout)
    pipe = client.pipeline(transaction=False)
    for b in range(keys.buckets):
        pipe.zrevrange(keys.listing("run", b), 0, MAX_ITEMS - 1, withscores=True)
    rows = sorted(((score, rid) for part in pipe.execute() for rid, score in part),
                  reverse=True)
    ids = [rid.decode() if isinstance(rid, bytes) else str(rid) for _, rid in rows]
    return [rid for rid in ids if rid.startswith(incomplete)][:MAX_ITEMS]


def _schedule_keys(ctx: click.Context, incomplete: str) -> list[str]:
    settings = _settings(ctx)
    keys: list[str] = []
    if settings.source:
        with contextlib.suppress(BaseException):
            settings.load_source()
            from ..triggers.schedules import SCHEDULES

            keys += list(SCHEDULES.schedules)
    with contextlib.suppress(BaseException):
        client = _client(settings)
        if client is not None:  # it answered now: the reads below are quick
            from ..triggers.schedules import list_schedules

            keys += [v.key for v in list_schedules(settings.runs(read_only=True),
                                                    sources_known=False)]
    return keys


# (command path, parameter name) -> what completes it.
_COMPLETERS: dict[tuple[str, str], Callable[[click.Context, str], list[str]]] = {
    ("enqueue", "name"): _workflow_names, ("run", "name"): _workflow_names,
    ("roll", "name"): _workflow_names, ("runs", "name"): _workflow_names,
    ("schedules pause", "key"): _schedule_keys, ("schedules resume", "key"): _schedule_keys,
}
_RUN_ID_PARAMS = ("run_id", "run_ids")


def attach_completers(command: click.Command, path: str) -> None:
    """Give the parameters of `command` (and of a group's subcommands) that name a
    workflow, a run or a schedule their completer; no command's definition changes."""
    for param in command.params:
        read = _COMPLETERS.get((path, param.name or ""))
        if read is None and param.name in _RUN_ID_PARAMS and isinstance(param, click.Argument):
            read = _run_ids
        if read is not None and getattr(param, "_custom_shell_complete", None) is None:
            param._custom_shell_complete = _safely(read)
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            attach_completers(sub, f"{path} {name}")
