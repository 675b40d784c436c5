"""Compensation through every face over the client: the HTTP API (driven with curl, as a
service in another language would), the dashboard's "Compensate" button and
its run page, and the asyncio client; with their refusals of bad input. A real
redis-server, a real worker and the real `marbles-rq web` process; the workflows are in
tests/comp_workflows.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import marbles_rq as mr
from marbles_rq.engine.execution import RunNotFoundError
from tests import test_web_browser as browsing
from tests.comp_workflows import UNDONE
from tests.procs import REPO_ROOT, Procs
from tests.test_web_api import API_TOKEN, curl
from tests.web_stack import start_web

PROCS_SOURCES = (REPO_ROOT / "tests" / "comp_workflows.py",)
# The browser tests' chromium and screenshot folder (tests/test_web_browser.py).
browser, shots = browsing.browser, browsing.shots
Page, expect = browsing.Page, browsing.expect


def enqueue(procs: Procs, run_id: str) -> None:
    done = procs.cli("enqueue", "comp_waiter", "--id", run_id)
    assert done.returncode == 0, done.stderr


def undone(procs: Procs, run_id: str) -> list[str]:
    return [v if isinstance(v, str) else v.decode()
            for v in procs.observer.client.lrange(UNDONE + run_id, 0, -1)]


def test_http_api_cancel_with_compensation_and_its_refusal(procs: Procs) -> None:
    procs.worker()
    web = start_web(procs, extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    enqueue(procs, "h-1")
    procs.observer.wait_status("h-1", "waiting", timeout=60)
    bad = curl(web, "POST", "/api/runs/h-1/cancel?compensate=maybe")
    assert bad.status == 400 and bad.error()["code"] == "invalid_request"
    assert procs.observer.status("h-1") == "waiting"  # nothing done
    done = curl(web, "POST", "/api/runs/h-1/cancel?compensate=true")
    assert done.status == 200, done.body
    assert done.json()["outcome"] == "compensating"
    procs.observer.wait_status("h-1", "cancelled", timeout=60)
    status = curl(web, "GET", "/api/runs/h-1").json()
    assert status["phase"] is None
    assert [(c["name"], c["status"]) for c in status["compensations"]] == [
        ("comp_release", "done")]
    assert undone(procs, "h-1") == ["release w"]
    missing = curl(web, "POST", "/api/runs/nope/cancel?compensate=true")
    assert missing.status == 404 and missing.error()["code"] == "run_not_found"


def test_dashboard_button_cancels_with_compensation(procs: Procs) -> None:
    procs.worker()
    web = start_web(procs)
    enqueue(procs, "d-1")
    procs.observer.wait_status("d-1", "waiting", timeout=60)
    session = web.signed_in()
    csrf = web.csrf(session)
    page = session.get("/runs/d-1")
    assert 'id="cancel-compensate"' in page.text and "Compensations" in page.text
    done = session.post("/runs/d-1/cancel", data={"csrf": csrf, "compensate": "1",
                                                  "next": "/runs/d-1"},
                        headers={"Origin": web.url})
    assert done.status_code == 303, done.text
    procs.observer.wait_status("d-1", "cancelled", timeout=60)
    assert undone(procs, "d-1") == ["release w"]
    page = session.get("/runs/d-1")
    assert "is compensating" in page.text  # the flash
    assert 'id="compensations"' in page.text and ">done<" in page.text
    assert 'id="cancel-compensate"' not in page.text  # finished: no more buttons


def test_async_client_cancel_with_compensation(procs: Procs) -> None:
    procs.worker()
    enqueue(procs, "a-1")
    procs.observer.wait_status("a-1", "waiting", timeout=60)

    async def main() -> tuple[Any, Any]:
        async with mr.connect_async(procs.url) as client:
            outcome = await client.handle("a-1").cancel(compensate=True)
            with pytest.raises(RunNotFoundError):
                await client.cancel("nope", compensate=True)
            with pytest.raises(mr.RunCancelledError):
                await client.handle("a-1").result(timeout=60)
            return outcome, await client.status("a-1")

    outcome, status = asyncio.run(main())
    assert outcome.outcome == "compensating"
    assert status.status == "cancelled"
    assert [(c.name, c.status) for c in status.compensations] == [("comp_release", "done")]
    assert json.loads(procs.cli("status", "a-1", "--json").stdout)["compensations"][0][
        "status"] == "done"


def test_dashboard_in_a_browser_compensates_and_lists_the_undos(
        procs: Procs, browser: Any, shots: Path) -> None:
    procs.worker()
    web = start_web(procs)
    enqueue(procs, "b-1")
    procs.observer.wait_status("b-1", "waiting", timeout=60)
    tab = Page(browser, web)
    tab.sign_in()
    page = tab.goto("/runs/b-1")
    page.get_by_role("button", name="Compensate").click()
    expect(page.locator(".flash.ok")).to_contain_text("run b-1 is compensating")
    expect(page.locator("#run-status")).to_have_text("cancelled", timeout=20_000)
    procs.observer.wait_status("b-1", "cancelled", timeout=60)
    page = tab.goto("/runs/b-1")
    rows = page.locator("#compensations tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("comp_release")
    expect(rows.first).to_contain_text("done")
    tab.shot(shots, "run-compensated")
    tab.close()
    assert undone(procs, "b-1") == ["release w"]
