"""The dashboard's pictures in a real browser (Debian's chromium via Playwright, as in
tests/test_web_browser.py) against a real redis-server, worker, controller and `marbles-rq
web`: the charts over the controller's rollups on Runs and System, and a run's timeline with
its waits drawn beside its steps and a "rerun from here" per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from marbles_rq.store.keys import Keyspace
from marbles_rq.store.rollups import MINUTE_MS, read_minutes
from tests import test_web_browser
from tests.procs import Procs, wait_for
from tests.test_web_browser import Page, _gate, expect
from tests.web_stack import WEB_SOURCE, start_web

PROCS_SOURCES = [WEB_SOURCE]
# The browser and the screenshot folder, as tests/test_web_browser.py provides them.
browser = test_web_browser.browser
shots = test_web_browser.shots


def _succeeded_in_rollups(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        secs, micros = client.time()
        now = (int(secs) * 1000 + int(micros) // 1000) // MINUTE_MS
        return sum(m.succeeded for m in read_minutes(client, Keyspace(), now - 5, now).values())
    finally:
        client.close()


def test_charts_render_on_runs_and_system(procs: Procs, browser: Any, shots: Path) -> None:
    procs.start(workers=1)
    web = start_web(procs)
    for i in range(4):
        procs.enqueue("web_noop", {"order": i}, f"order-{i}")
    for i in range(4):
        procs.observer.wait_status(f"order-{i}", "succeeded")
    wait_for(lambda: _succeeded_in_rollups(procs.url) == 4 or None, timeout=60,
             what="the controller's rollups to count the 4 runs")
    tab = Page(browser, web)
    page = tab.goto("/runs")
    runs_chart = page.locator("svg#chart-runs")
    expect(runs_chart).to_be_visible()
    expect(runs_chart).to_have_attribute("role", "img")
    expect(runs_chart.locator("title").first).to_contain_text("Runs finished per minute")
    expect(runs_chart.locator("g.bar")).to_have_count(60)
    expect(runs_chart.locator("rect.s-ok").first).to_be_visible()
    expect(runs_chart.locator("desc")).to_contain_text("in all 4 succeeded, 0 failed")
    expect(page.locator("svg#chart-durations g.series[data-name='web_noop p50']")
           ).to_have_count(1)
    # The list is still there below the charts.
    expect(page.locator("table.runs tbody tr")).to_have_count(4)
    # Another span: 48 bars of 30 minutes for a day.
    page.get_by_role("link", name="24h").click()
    expect(page.locator("svg#chart-runs g.bar")).to_have_count(48)
    page.goto(web.url + "/runs")
    tab.shot(shots, "runs-charts")

    page = tab.goto("/system")
    expect(page.locator("svg#chart-runs")).to_be_visible()
    queues = page.locator("svg#chart-queues")
    expect(queues).to_be_visible()
    expect(queues.locator("desc")).to_contain_text(
        "latest: queued 0; open questions 0; timed waits 0")
    tab.shot(shots, "system")
    tab.close()


def test_run_timeline_shows_waits_and_reruns_from_a_step(procs: Procs, browser: Any,
                                                          shots: Path) -> None:
    procs.start(workers=1)
    web = start_web(procs)
    procs.enqueue("web_ask", {"title": "Which colour?"}, "ask-1")
    procs.observer.wait_status("ask-1", "waiting")
    tab = Page(browser, web)
    tab.sign_in()
    page = tab.goto("/runs/ask-1")
    wait_row = page.locator("tr.wait-row[data-wait='question']")
    expect(wait_row).to_have_count(1)
    expect(wait_row).to_contain_text("an answer to q")
    expect(wait_row).to_contain_text("waiting")
    expect(wait_row.locator(".seg.wait.question")).to_be_visible()
    tab.shot(shots, "run-timeline-waiting")
    assert procs.cli("answer", "ask-1", "q", "blue").returncode == 0
    # The page follows live: the span ends, with what ended it.
    expect(page.locator("#run-status")).to_have_text("succeeded", timeout=20_000)
    expect(wait_row).to_contain_text("woken by answer")

    # A finished run with a step: each try's row offers a rerun from that step.
    procs.enqueue("web_ticker", None, "ticker-1")
    procs.observer.wait_status("ticker-1", "running")
    _gate(procs, "ticker-1")
    procs.observer.wait_status("ticker-1", "succeeded")
    page = tab.goto("/runs/ticker-1")
    step = "web_ticker.web_tick_until_gate#0"
    row = page.locator(f"tr[data-step='{step}']")
    expect(row).to_have_count(1)
    tab.shot(shots, "run-timeline")
    row.get_by_role("button", name=f"Rerun from step {step}").click()
    expect(page.locator(".flash.ok")).to_be_visible()
    new_id = page.url.rsplit("/", 1)[1]
    assert new_id != "ticker-1"
    view = procs.observer.view(new_id)
    assert view is not None
    assert (view.record.rerun_of, view.record.rerun_from_step) == ("ticker-1", step)
    tab.close()
