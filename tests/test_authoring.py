"""Defining workflows and steps, loading sources, validating input (no Redis needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.engine.authoring import REGISTRY, DefinitionError, InputError, load_source

SOURCES = Path(__file__).parent / "sources"


class Order(msgspec.Struct):
    sku: str
    qty: int = 1


class Knobs(msgspec.Struct):
    n: int
    fast: bool = True


class Need(msgspec.Struct):
    n: int


def test_a_three_step_workflow_is_a_dozen_lines() -> None:
    @mr.step("t_price")  # examples/app/shop.py has a `price`
    def price(sku: str) -> int:
        return {"apple": 3}.get(sku, 1)

    @mr.step("t_total", retries=2)
    def total(unit: int, qty: int) -> int:
        return unit * qty

    @mr.step("t_receipt")
    def receipt(amount: int) -> str:
        return f"charged {amount}"

    @mr.workflow("t_order")
    def order(ctx: mr.RunContext, inp: Order) -> str:
        return receipt(total(price(inp.sku), inp.qty))

    definition = REGISTRY.workflow("t_order")
    value, recorded = definition.parse_input(b'{"sku":"apple","qty":4}')
    assert value == Order("apple", 4)
    assert recorded == b'{"sku":"apple","qty":4}'
    # Outside a run, steps are plain calls: easy to unit-test.
    assert order.fn(None, value) == "charged 12"


def test_input_defaults_are_recorded_as_used() -> None:
    @mr.workflow("t_knobs")
    def knobs(ctx: mr.RunContext, inp: Knobs) -> None:
        return None

    _, recorded = REGISTRY.workflow("t_knobs").parse_input(b'{"n": 2}')
    assert msgspec.json.decode(recorded) == {"n": 2, "fast": True}


@pytest.mark.parametrize("raw,message", [
    (b'{"n": "two"}', "Expected `int`, got `str` - at `$.n`"),
    (b'{}', "Object missing required field `n`"),
    (b'{"n": 1', "input is not valid JSON"),
])
def test_bad_input_is_one_clear_error(raw: bytes, message: str) -> None:
    @mr.workflow("t_need")
    def need(ctx: mr.RunContext, inp: Need) -> None:
        return None

    with pytest.raises(InputError, match=message.replace("$", r"\$").replace("`", ".")):
        REGISTRY.workflow("t_need").parse_input(raw)


def test_a_workflow_without_input_refuses_one() -> None:
    @mr.workflow("t_noinput")
    def noinput(ctx: mr.RunContext) -> None:
        return None

    assert REGISTRY.workflow("t_noinput").parse_input(b"null") == (None, b"null")
    with pytest.raises(InputError, match="takes no input"):
        REGISTRY.workflow("t_noinput").parse_input(b'{"x": 1}')


def test_unknown_workflow_names_the_known_ones() -> None:
    with pytest.raises(mr.MarblesError, match="unknown workflow 'nope'"):
        REGISTRY.workflow("nope")


def test_duplicate_names_fail_at_load_naming_both_places() -> None:
    with pytest.raises(DefinitionError) as err:
        load_source(str(SOURCES / "dup"))
    text = str(err.value)
    assert "duplicate workflow name 'same'" in text
    assert "a.py:" in text and "b.py:" in text


def test_a_folder_loads_in_sorted_order_skipping_underscore_modules() -> None:
    modules = load_source(str(SOURCES / "folder"))
    assert modules == ["marbles_source.a_first", "marbles_source.b_second"]
    assert {"folder_a", "folder_b"} <= set(REGISTRY.workflows)
    # Loading the same folder again is not a duplicate.
    load_source(str(SOURCES / "folder"))


def test_a_missing_source_is_a_clear_error() -> None:
    with pytest.raises(DefinitionError, match="does not exist"):
        load_source("no/such/file.py")
    with pytest.raises(DefinitionError, match="cannot import source"):
        load_source("no_such_module_anywhere")


def test_a_module_path_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "t_mod_src.py").write_text(
        "import marbles_rq as mr\n@mr.workflow('t_mod')\ndef f(ctx):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_source("t_mod_src") == ["t_mod_src"]
    assert "t_mod" in REGISTRY.workflows
    sys.modules.pop("t_mod_src", None)
