"""Every Lua script documents what it touches: its header lists each KEYS[i] and ARGV[i] the
body uses, and its replies; and the installed wheel ships every script."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from marbles_rq.store.scripts import Script, load_scripts, lua_dir

SCRIPTS = sorted(load_scripts().values(), key=lambda s: s.name)


def _split(source: str) -> tuple[str, str]:
    assert source.startswith("#!lua"), "a shebang makes undeclared keys fail fast on a cluster"
    header_end = source.index("]]")
    return source[:header_end], source[header_end:]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_header_documents_keys_argv_and_replies(script: Script) -> None:
    name, source = script.name, script.source
    header, body = _split(source)
    assert header.splitlines()[1].startswith(f"--[[ {name}: "), "header names the script"
    assert "Returns:" in header
    for kind in ("KEYS", "ARGV"):
        used = {int(n) for n in re.findall(rf"{kind}\[(\d+)\]", body)}
        documented = {int(n) for n in re.findall(rf"^{kind}\[(\d+)\]", header, re.M)}
        assert used <= documented, f"{kind} used but not documented: {used - documented}"
        if name != "purge_owned":  # its keys and arguments come in variable-length runs
            assert documented == set(range(1, len(documented) + 1))
            assert used == documented, f"{kind} documented but unused: {documented - used}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_no_key_is_built_inside_lua(script: Script) -> None:
    _, body = _split(script.source)
    for call in re.findall(r"redis\.call\('(\w+)',\s*([^,)]+)", body):
        command, first = call
        if command in ("TIME",):
            continue
        assert ".." not in first, f"{command} on a key built in Lua: {first}"


def test_the_wheel_ships_every_script(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                    str(tmp_path), str(repo)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("marbles_rq-*.whl"))
    shipped = {Path(n).name for n in zipfile.ZipFile(wheel).namelist()
               if n.startswith("marbles_rq/lua/")}
    assert shipped == {p.name for p in lua_dir().glob("*.lua")}
