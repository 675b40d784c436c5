"""The client's documentation runs as written: the README quick start's three lines and every
Python block of docs/client.md, executed against a real redis-server, a real worker and a
real controller, the way a reader would run them (their own process, from the repository
root, MARBLES_REDIS_URL set, no workflow source imported)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import marbles_rq as mr
from marbles_rq.cli.dev import DEFAULT_PORT
from tests.docs_blocks import blocks, printed, run_blocks
from tests.procs import CHAIN_SOURCE, REPO_ROOT, Procs

SHOP_SOURCE = REPO_ROOT / "examples" / "app" / "shop.py"
PROCS_SOURCES = (CHAIN_SOURCE, SHOP_SOURCE)
README = REPO_ROOT / "README.md"
CLIENT_DOC = REPO_ROOT / "docs" / "client.md"


@pytest.fixture
def stack(procs: Procs) -> Procs:
    procs.controller()
    procs.worker(pool=2)
    return procs


def test_the_readme_quick_start_runs_as_written(stack: Procs, tmp_path: Path) -> None:
    quick = [b for b in blocks(README) if b.mark == "quickstart"]
    assert len(quick) == 1 and quick[0].lang == "python"
    assert quick[0].code.splitlines() == [
        "import marbles_rq as mr",
        "client = mr.connect()",
        'print(client.start("chain", {"steps": 3}).result(timeout=60))']
    # The shell lines above it start `marbles-rq dev` and export what the client reads: the
    # block runs with those variables, the URL moved to this test's server.
    shell = blocks(README)[blocks(README).index(quick[0]) - 1].code
    assert "--source examples/chain.py dev" in shell
    export = next(line for line in shell.splitlines() if line.startswith("export "))
    exported = dict(word.split("=", 1) for word in export.split("#")[0].split()[1:])
    assert exported["MARBLES_REDIS_URL"] == f"redis://127.0.0.1:{DEFAULT_PORT}/0"
    exported["MARBLES_REDIS_URL"] = stack.url
    out = run_blocks(stack, quick, tmp_path, exported)
    assert printed(out, quick[0])[0].startswith("{'steps': 3, 'keys': [")
    # It started one run of chain, and that run succeeded.
    with mr.connect(stack.url) as client:
        runs = client.runs(workflow="chain").runs
    assert [r.status for r in runs] == ["succeeded"]


def test_every_python_block_of_the_client_page_is_run(stack: Procs, tmp_path: Path) -> None:
    found = blocks(CLIENT_DOC)
    python = [b for b in found if b.lang == "python"]
    unmarked = [b.line for b in python if b.mark != "run"]
    assert not unmarked, f"python blocks of docs/client.md not marked to run: lines {unmarked}"
    assert len(python) >= 12
    out = run_blocks(stack, python, tmp_path)
    said = {b.code.splitlines()[0]: printed(out, b) for b in python}
    assert len(said) == len(python)  # each block is found by its first line
    assert said['run = client.start("place_order", {"sku": "book", "qty": 3}, '
                'id="order-1043")'] == [
        "order-1043 True", "{'status': 'placed', 'total': 36, 'reservation': 'res-book-3', "
        "'receipt': 'ch-order-1043:place_order.charge#0'}"]
    assert said['handles = client.start_many([mr.StartRequest("place_order", {"sku": sku}, '
                'id=f"order-{sku}")'] == ["[45, 12]"]
    assert said['checked = mr.connect(source="examples/app/shop.py")'] == [
        "invalid_input - input of workflow 'place_order' has an unknown field 'colour' "
        "(it takes: sku, qty)", "unknown_workflow"]
    assert said["import msgspec"] == ["Placed(status='placed', total=36)"]
    assert said["try:"] == ["run_failed ValueError unknown sku 'unicorn'", "not yet",
                            "{'sku': 'lamp', 'batches': 3}"]
    assert said['status = client.status("order-1043")'] == [
        "succeeded 1 ['price', 'reserve', 'charge']"]
    watched = said['print([entry.type for entry in client.handle("order-1043").watch()])']
    assert watched[0].startswith("['queued', 'attempt_started', 'step_started'")
    assert watched[0].endswith("'step_succeeded', 'final']")
    assert said['big = client.start("place_order", {"sku": "sofa", "qty": 2}, '
                'id="order-1044")'] == [
        "[('big-order', 'Approve an order of 2400?')]",
        "run order-1044: big-order approved; run woken", "placed", "already_answered"]
    paused, resumed, cancelled, raised = said[
        'slow = client.start("restock", {"sku": "sofa", "steps": 20, "sleep_s": 0.2})']
    assert paused in ("paused", "requested") and resumed in ("woken", "resumed")
    assert cancelled in ("cancelled", "requested") and raised == "run_cancelled"
    # Every place_order run so far, newest first, two to a page, each once.
    pages = said["cursor = None"]
    listed = [rid for page in pages for rid in re.findall(r"\('([^']+)', '", page)]
    assert len(pages) == 3 and all(len(re.findall(r"\('", p)) <= 2 for p in pages)
    assert {"order-1043", "order-1044", "order-lamp", "order-book"} <= set(listed)
    assert len(listed) == len(set(listed)) == 5  # and the failed 'unicorn' run
    assert said["import datetime as dt"] == ["queued", "1"]
    assert said["import asyncio"] == ["[(200, None), (422, \"unknown sku 'unicorn'\")]"]
    assert said['parcel = client.start("track_delivery", "order-1044", id="parcel-1044",'] == [
        "True", "False", "3", "['depot', 'van', 'delivered']", "run_settled"]
    assert said['parcel = client.start("track_delivery", "order-1045", id="parcel-1045")'] == [
        "packed", "delivered", "{'stage': 'delivered'}", "not_published"]
    # What the page printed is what the store holds.
    assert stack.observer.status("web-1") == "succeeded"
    assert stack.observer.status("order-1044") == "succeeded"
