"""The dashboard in a real browser: Playwright (sync API) driving Debian's `chromium`, against
a real redis-server, a real `marbles-rq web`, a real worker and a real controller.

Chromium is Debian's package (`apt-get install chromium`, ops/test does it as root),
launched by its path; no browser is ever downloaded. Without it the tests skip locally and
fail in CI (CI=true). Screenshots, wide and ~400 px narrow, go to $MARBLES_SCREENSHOTS (or
the test's temporary directory).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.procs import Procs
from tests.web_stack import TOKEN, WEB_SOURCE, Web, ci, start_web

PROCS_SOURCES = [WEB_SOURCE]
XSS = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script>'

try:
    from playwright import sync_api
except ImportError:  # the dev extras install it; CI must not pass without running these
    sync_api = None


def expect(locator: Any) -> Any:
    assert sync_api is not None
    return sync_api.expect(locator)


def _missing(message: str) -> None:
    if ci():
        pytest.fail(message + " (CI=true: the browser tests must run)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if sync_api is None:
        _missing("playwright is not installed (pip install -e '.[dev]')")
    path = shutil.which("chromium")
    if path is None:
        _missing("Debian's chromium is not installed (apt-get install -y chromium; ops/test "
                 "installs it when run as root)")
    assert sync_api is not None and path is not None
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("MARBLES_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Page:
    """A browser tab on the dashboard that fails the test on any page error or dialog (an
    injected script would raise one)."""

    def __init__(self, browser: Any, web: Web, width: int = 1280, height: int = 900) -> None:
        self.web = web
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.page.on("pageerror", lambda exc: self.problems.append(f"page error: {exc}"))
        self.page.on("dialog", lambda d: (self.problems.append(f"dialog: {d.message}"),
                                          d.dismiss()))

    def goto(self, path: str) -> Any:
        self.page.goto(self.web.url + path)
        return self.page

    def sign_in(self) -> None:
        page = self.goto("/login?next=/runs")
        page.get_by_label("Token").fill(TOKEN)
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator(".flash.ok")).to_have_text("signed in")

    def shot(self, folder: Path, name: str) -> None:
        self.page.screenshot(path=str(folder / f"{name}.png"), full_page=True)

    def close(self) -> None:
        assert not self.problems, self.problems
        self.context.close()


def _gate(procs: Procs, run_id: str) -> None:
    client = redis.Redis.from_url(procs.url)
    client.rpush(f"web:gate:{run_id}", "go")
    client.close()


def test_runs_list_filter_and_live_output(procs: Procs, browser: Any, shots: Path) -> None:
    procs.start(workers=2)
    web = start_web(procs)
    for i in range(3):
        procs.enqueue("web_noop", {"order": i}, f"order-{i}")
    for i in range(3):
        procs.observer.wait_status(f"order-{i}", "succeeded")
    procs.enqueue("web_ticker", None, "ticker-1")
    tab = Page(browser, web)
    page = tab.goto("/runs")
    rows = page.locator("table.runs tbody tr")
    expect(rows).to_have_count(4)
    expect(page.locator('tr[data-run="ticker-1"] .badge')).to_have_text("running")

    # Filters: by status, then by workflow.
    page.get_by_label("Status").select_option("succeeded")
    page.get_by_role("button", name="Filter").click()
    expect(rows).to_have_count(3)
    expect(page.locator('tr[data-run="ticker-1"]')).to_have_count(0)
    page.goto(web.url + "/runs")
    page.get_by_label("Workflow").select_option("web_ticker")
    page.get_by_role("button", name="Filter").click()
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("ticker-1")
    tab.shot(shots, "runs-filtered-wide")

    # Search by id opens the run; its output grows while we watch.
    page.get_by_label("Run id").fill("ticker-1")
    page.get_by_role("button", name="Open").click()
    expect(page).to_have_url(web.url + "/runs/ticker-1")
    lines = page.locator("#output li")
    expect(page.locator("#output")).to_contain_text("tick 2")
    shown = lines.count()
    expect(page.locator("#output")).to_contain_text(f"tick {shown + 3}")  # no reload
    tab.shot(shots, "run-live-wide")
    _gate(procs, "ticker-1")
    expect(page.locator("#run-status")).to_have_text("succeeded", timeout=20_000)
    expect(page.locator("#output")).to_contain_text("run succeeded")
    expect(page.locator("#output-state")).to_have_text("finished")
    expect(page.locator("table.steps")).to_contain_text("web_ticker.web_tick_until_gate")
    tab.close()

    narrow = Page(browser, web, width=400, height=860)
    narrow.goto("/runs")
    expect(narrow.page.locator("table.runs tbody tr")).to_have_count(4)
    narrow.shot(shots, "runs-narrow")
    narrow.goto("/runs/ticker-1")
    expect(narrow.page.locator("#run-status")).to_have_text("succeeded")
    narrow.shot(shots, "run-narrow")
    # Nothing is wider than the window: no sideways scrolling on a phone.
    width = narrow.page.evaluate("document.documentElement.scrollWidth")
    assert width <= 400, width
    narrow.close()


def test_answer_a_question_in_the_browser(procs: Procs, browser: Any, shots: Path) -> None:
    procs.start(workers=1)
    web = start_web(procs)
    procs.enqueue("web_ask", {"title": XSS, "body": "pick a colour & go"}, "ask-1")
    procs.enqueue("web_approve", None, "rel-1.4")
    procs.observer.wait_status("ask-1", "waiting")
    procs.observer.wait_status("rel-1.4", "waiting")
    tab = Page(browser, web)
    tab.sign_in()
    page = tab.goto("/feed")
    question = page.locator('[data-question="ask-1|q"]')
    expect(question.locator(".q-title")).to_have_text(XSS)  # shown as text
    assert page.evaluate("window.__xss === undefined")  # and never run
    tab.shot(shots, "feed-wide")

    question.get_by_label("Answer").fill("blue <b>&</b>")
    question.get_by_role("button", name="Answer").click()
    expect(page.locator(".flash.ok")).to_contain_text("run ask-1: q answered")
    page.locator('[data-question="rel-1.4|ship"]').get_by_role("button", name="Approve").click()
    expect(page.locator(".flash.ok")).to_contain_text("ship approved")
    expect(page.locator(".question")).to_have_count(0)

    page = tab.goto("/runs/ask-1")
    expect(page.locator("#run-status")).to_have_text("succeeded", timeout=20_000)
    expect(page.locator("#output")).to_contain_text("got: blue <b>&</b>")
    expect(page.locator("#output")).to_contain_text(f"asking: {XSS}")
    assert page.evaluate("window.__xss === undefined")
    tab.shot(shots, "run-answered-wide")
    view = procs.observer.wait_status("rel-1.4", "succeeded")
    assert json.loads(bytes(view.result or b"null")) == {
        "decision": {"approved": True, "note": None}}
    # The answer was recorded as `marbles-rq answer` records it: a second one is refused.
    again = procs.cli("answer", "ask-1", "q", "red")
    assert again.returncode == 1 and "already" in again.stderr
    tab.close()


def test_cancel_pause_schedule_and_refusal(procs: Procs, browser: Any, shots: Path) -> None:
    procs.start(workers=1)
    web = start_web(procs)
    procs.enqueue("web_ticker", None, "long-1")
    procs.observer.wait_status("long-1", "running")
    tab = Page(browser, web)

    # Not signed in: the write is refused, and nothing changes.
    page = tab.goto("/runs/long-1")
    page.get_by_role("button", name="Cancel").click()
    expect(page.locator(".flash.bad")).to_contain_text("refused: sign in")
    assert procs.observer.status("long-1") == "running"
    tab.shot(shots, "refused-wide")

    # Signing in on the refusal page returns to the run; now Cancel works.
    page.get_by_label("Token").fill(TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(web.url + "/runs/long-1")
    page.get_by_role("button", name="Cancel").click()
    expect(page.locator(".flash.ok")).to_contain_text("run long-1")
    expect(page.locator("#run-status")).to_have_text("cancelled", timeout=20_000)
    procs.observer.wait_status("long-1", "cancelled")

    # Pause the hourly schedule (registered by the controller at election).
    page = tab.goto("/schedules")
    row = page.locator('tr[data-schedule="web-hourly"]')
    expect(row.locator(".badge").first).to_have_text("active")
    row.get_by_role("button", name="Pause").click()
    expect(page.locator(".flash.ok")).to_have_text("schedule web-hourly paused")
    expect(row.locator(".badge").first).to_have_text("paused")
    listed = json.loads(procs.cli("schedules", "--json").stdout)
    assert [s["status"] for s in listed if s["key"] == "web-hourly"] == ["paused"]
    tab.shot(shots, "schedules-wide")

    for path, name in (("/system", "system"), ("/events", "events"), ("/monitors", "monitors")):
        tab.goto(path)
        tab.shot(shots, f"{name}-wide")
    expect(tab.page.locator("h1")).to_have_text("Monitors")
    tab.close()
