"""`marbles-rq --help` lists the commands in sections (runs, questions and signals,
schedules and triggers, operations) with the connection options under one heading; each
command's --help ends with an example that parses and the connection options' heading."""

from __future__ import annotations

import re
import shlex

import click

from tests.test_cli_conventions import CONNECTION, mrq


def test_every_command_is_in_exactly_one_section() -> None:
    from marbles_rq.cli import _COMMANDS, SECTIONS

    listed = [name for rows in SECTIONS.values() for name, _, _ in rows]
    assert sorted(listed) == sorted(_COMMANDS)  # each once, none missing, none extra
    assert list(SECTIONS) == ["Runs", "Questions and signals", "Schedules and triggers",
                              "Operations"]


def test_top_level_help_is_grouped() -> None:
    done = mrq("--help")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    headings = re.findall(r"^(\S[^\n]*):$", text, flags=re.MULTILINE)
    assert headings == ["Connection options (also accepted after the command)", "Options",
                        "Runs", "Questions and signals", "Schedules and triggers",
                        "Operations"]
    sections = dict(zip(headings, re.split(r"^\S[^\n]*:$", text, flags=re.MULTILINE)[1:],
                        strict=True))
    for flag in CONNECTION:
        assert flag in sections["Connection options (also accepted after the command)"]
        assert flag not in sections["Options"]
    assert "--version" in sections["Options"] and "--debug" in sections["Options"]
    assert re.search(r"^\s+status\s+Show one run", sections["Runs"], flags=re.MULTILINE)
    assert re.search(r"^\s+approve\s", sections["Questions and signals"], flags=re.MULTILINE)
    assert re.search(r"^\s+schedules\s", sections["Schedules and triggers"],
                     flags=re.MULTILINE)
    assert re.search(r"^\s+info\s", sections["Operations"], flags=re.MULTILINE)


def test_each_command_help_ends_with_an_example_and_the_connection_heading() -> None:
    done = mrq("approve", "--help")
    assert done.returncode == 0
    own, _, rest = done.stdout.partition("Example:")
    assert "marbles-rq approve r-8f2c1 refund" in rest
    assert "--note" in own and "--redis-url" not in own  # not among its own options
    heading = rest.split("Connection options", 1)[1]
    assert all(flag in heading for flag in (*CONNECTION, "--debug"))
    # Nested commands have the heading too (their group's example is on the group).
    nested = mrq("schedules", "pause", "--help")
    assert "Connection options" in nested.stdout and "--redis-url" in nested.stdout


def test_every_example_parses_against_its_command() -> None:
    """An example names its command and only options the command has, with valid values."""
    from marbles_rq.cli import SECTIONS, _register, cli

    _register()
    for rows in SECTIONS.values():
        for name, _, example in rows:
            words = shlex.split(example)
            if words[0] == "eval":  # eval "$(marbles-rq completion bash)"
                words = shlex.split(words[1].removeprefix("$(").removesuffix(")"))
            assert words[0] == "marbles-rq", example
            root = cli.make_context("marbles-rq", words[1:], resilient_parsing=False)
            args = [*root._protected_args, *root.args]
            assert args[0] == name, example
            command = cli.get_command(root, name)
            assert command is not None
            try:
                sub = command.make_context(name, args[1:], parent=root)
                if isinstance(command, click.Group) and sub._protected_args:
                    inner = command.get_command(sub, sub._protected_args[0])
                    assert inner is not None, example
                    inner.make_context(sub._protected_args[0],
                                       [*sub._protected_args[1:], *sub.args], parent=sub)
            except click.UsageError as exc:
                raise AssertionError(f"{example}: {exc.format_message()}") from None
