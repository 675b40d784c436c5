"""The dashboard's side of pause on exhaustion, in a real browser (Playwright driving Debian's
chromium; see tests/test_web_browser.py): a run paused on a failed step is listed on the Feed
page, and its run page retries the step with an input patch, or gives it up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.procs import REPO_ROOT, Procs
from tests.test_web_browser import Page, browser, expect, shots
from tests.web_stack import start_web

PROCS_SOURCES = [REPO_ROOT / "tests" / "retry_workflows.py"]
__all__ = ["browser", "shots"]  # the fixtures, used by name


def _paused(procs: Procs, run_id: str) -> None:
    from tests.procs import wait_for

    obs = procs.observer
    wait_for(lambda: (v := obs.view(run_id)) is not None and v.wait_reason == "failed_step",
             timeout=60, what=f"{run_id} to pause", context=lambda: obs.dump(run_id))


def test_retry_with_a_patch_and_fail_from_the_run_page(procs: Procs, browser: Any,
                                                       shots: Path) -> None:
    procs.start(workers=1, controller=False)
    web = start_web(procs)
    procs.enqueue("rt_order", 500, "web-order-1")
    procs.enqueue("rt_order", 900, "web-order-2")
    _paused(procs, "web-order-1")
    _paused(procs, "web-order-2")
    tab = Page(browser, web)
    tab.sign_in()

    page = tab.goto("/feed")
    listed = page.locator("table.failed-steps")
    expect(listed).to_contain_text("web-order-1")
    expect(listed).to_contain_text("ValueError: amount 500 is over the limit")
    tab.shot(shots, "failed-steps-feed")

    page = tab.goto("/runs/web-order-1")
    expect(page.locator("p.note.waiting")).to_contain_text("failed 2 of 2 attempts")
    tab.shot(shots, "failed-step-run")
    page.get_by_label("Input patch").fill('{"amount": "lots"}')
    page.get_by_role("button", name="Retry step").click()
    expect(page.locator(".flash.bad")).to_contain_text("does not fit")
    assert procs.observer.view("web-order-1").wait_reason == "failed_step"  # type: ignore
    page = tab.goto("/runs/web-order-1")
    page.get_by_label("Input patch").fill('{"amount": 30}')
    page.get_by_role("button", name="Retry step").click()
    expect(page.locator(".flash.ok")).to_contain_text("retried with its input patched")
    expect(page.locator("#run-status")).to_have_text("succeeded", timeout=30_000)

    page = tab.goto("/runs/web-order-2")
    page.get_by_label("Reason").fill("card expired")
    page.get_by_role("button", name="Fail step").click()
    expect(page.locator(".flash.ok")).to_contain_text("given up")
    expect(page.locator("#run-status")).to_have_text("failed", timeout=30_000)
    view = procs.observer.view("web-order-2")
    assert view is not None and view.error is not None
    assert view.error.message.endswith("(given up: card expired)")
    tab.close()
