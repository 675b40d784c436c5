"""The runs list's batch bar in a real browser (Debian's chromium, as tests/test_web_browser.py):
tick runs and act on them, "select all N matching" and approve by key, refusals as a flash,
against a real redis-server, `marbles-rq web` and worker. Screenshots: runs-batch-*.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.procs import Procs
from tests.test_web_browser import Page, browser, expect, shots  # noqa: F401 - fixtures
from tests.web_stack import WEB_SOURCE, start_web

PROCS_SOURCES = [WEB_SOURCE]


def test_tick_runs_and_select_all_matching(procs: Procs, browser: Any,  # noqa: F811
                                           shots: Path) -> None:  # noqa: F811
    procs.start(workers=1, controller=False)
    web = start_web(procs)
    approvals = [f"rel-{i}" for i in range(4)]
    for run_id in approvals:
        procs.enqueue("web_approve", None, run_id)
    for i in range(2):
        procs.enqueue("web_noop", {"order": i}, f"noop-{i}")
    for run_id in approvals:
        procs.observer.wait_status(run_id, "waiting")
    for i in range(2):
        procs.observer.wait_status(f"noop-{i}", "succeeded")

    tab = Page(browser, web)
    tab.sign_in()
    page = tab.goto("/runs?workflow=web_approve&status=waiting")
    rows = page.locator("table.runs tbody tr")
    expect(rows).to_have_count(4)
    bar = page.locator("#batch")
    expect(bar.locator("#pick-matching")).to_have_text("Select all 4 matching")

    # Nothing ticked: refused with a flash, nothing changed.
    bar.get_by_role("button", name="Pause").click()
    expect(page.locator(".flash.bad")).to_contain_text("tick some runs first")

    # Tick one run and cancel it.
    page.get_by_label("Select rel-0").check()
    expect(bar.locator("#picked")).to_have_text("1 selected")
    tab.shot(shots, "runs-batch-ticked-wide")
    bar.get_by_role("button", name="Cancel").click()
    expect(page.locator(".flash.ok")).to_have_text("cancel: done 1, skipped 0, failed 0")
    procs.observer.wait_status("rel-0", "cancelled")
    expect(rows).to_have_count(3)  # the page keeps its filter: three still waiting

    # Every run the filter selects, approved by key with a note.
    bar.locator("#pick-matching").click()
    expect(bar.locator("#picked")).to_have_text("all 3 matching selected")
    bar.get_by_label("Approval").fill("ship")
    bar.get_by_label("Note").fill("batch <ok>")
    tab.shot(shots, "runs-batch-all-wide")
    bar.get_by_role("button", name="Approve").click()
    expect(page.locator(".flash.ok")).to_have_text("approve: done 3, skipped 0, failed 0")
    for run_id in approvals[1:]:
        view = procs.observer.wait_status(run_id, "succeeded")
        assert json.loads(bytes(view.result or b"null")) == {
            "decision": {"approved": True, "note": "batch <ok>"}}
    assert procs.observer.status("noop-0") == "succeeded"  # outside the filter: untouched

    # Ticking the header box ticks the page; a rerun of finished runs goes through.
    page = tab.goto("/runs?workflow=web_noop")
    page.get_by_label("Select every run on this page").check()
    expect(page.locator("#picked")).to_have_text("2 selected")
    page.locator("#batch").get_by_role("button", name="Rerun").click()
    expect(page.locator(".flash.ok")).to_have_text("rerun: done 2, skipped 0, failed 0")
    tab.close()

    narrow = Page(browser, web, width=400, height=860)
    narrow.sign_in()
    narrow.goto("/runs?workflow=web_approve")
    expect(narrow.page.locator("#batch")).to_be_visible()
    narrow.shot(shots, "runs-batch-narrow")
    width = narrow.page.evaluate("document.documentElement.scrollWidth")
    assert width <= 400, width
    narrow.close()
