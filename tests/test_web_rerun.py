"""The dashboard's Rerun is `marbles-rq rerun` (issue 16, item 8): over HTTP against a real
`marbles-rq web`, workers and controller. It refuses a run that has not finished, records
`rerun_of` (and the step it reran from), offers "from this step", and a repeated POST of
one form returns the rerun the first POST made instead of starting a second."""

from __future__ import annotations

import re

import redis

from marbles_rq.engine.runs import RunStore, RunView
from marbles_rq.store import open_store
from tests.procs import REPO_ROOT, Procs
from tests.web_stack import WEB_SOURCE, Web, start_web

PROCS_SOURCES = [WEB_SOURCE, REPO_ROOT / "tests" / "rerun_workflows.py"]


def _runs(url: str) -> list[RunView]:
    return RunStore(open_store(url, read_only=True)).list_runs(limit=1000)


def _form(web: Web, client: object, run_id: str) -> dict[str, str]:
    """The Rerun form of the run's page, as a browser would submit it."""
    page = client.get(f"/runs/{run_id}")  # type: ignore[attr-defined]
    assert page.status_code == 200, page.text
    form = re.search(r'<form method="post" action="/runs/[^"]+/rerun"[^>]*>(.*?)</form>',
                     page.text, re.S)
    assert form is not None, "no Rerun form on the page"
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"',
                             form.group(1)))
    fields["options"] = ",".join(re.findall(r'<option value="([^"]*)"', form.group(1)))
    return fields


def test_dashboard_rerun_is_the_engines_rerun(procs: Procs) -> None:
    procs.start(workers=1)
    web = start_web(procs)
    r = redis.Redis.from_url(procs.url)
    procs.enqueue("ordered", 1, "orig")
    assert procs.observer.wait_final("orig").data["status"] == "succeeded"
    procs.enqueue("web_approve", None, "parked")
    procs.observer.wait_status("parked", "waiting")

    browser = web.signed_in()
    csrf = web.csrf(browser)
    origin = {"Origin": web.url}

    # A waiting run: a POST is refused with nothing written, and its page has no Rerun.
    before = len(_runs(procs.url))
    refused = browser.post("/runs/parked/rerun", data={"csrf": csrf, "new_id": "x-1"},
                           headers={**origin, "Accept": "application/json"})
    assert refused.status_code in (400, 409), refused.text
    assert "only a finished run can be rerun" in refused.json()["error"]
    assert len(_runs(procs.url)) == before and procs.observer.view("x-1") is None
    assert "/rerun" not in browser.get("/runs/parked").text

    # A finished run: Rerun from the top or from each step of its ledger.
    form = _form(web, browser, "orig")
    assert form["options"].split(",") == ["", "ordered.zeta#0", "ordered.alpha#0",
                                          "ordered.mid#0"]
    new_id = form["new_id"]
    data = {"csrf": form["csrf"], "new_id": new_id, "from_step": "ordered.alpha#0"}
    first = browser.post("/runs/orig/rerun", data=data, headers=origin)
    assert first.status_code == 303 and first.headers["location"] == f"/runs/{new_id}"
    assert procs.observer.wait_final(new_id).data["result"] == 23
    view = procs.observer.view(new_id)
    assert view is not None
    assert (view.record.rerun_of, view.record.rerun_from_step) == ("orig", "ordered.alpha#0")
    # zeta came from the copied ledger; alpha and mid executed again.
    assert [int(r.get(f"ordered:{s}") or 0) for s in ("zeta", "alpha", "mid")] == [1, 2, 2]
    page = browser.get(f"/runs/{new_id}").text
    assert "Rerun of" in page and 'href="/runs/orig"' in page

    # The same form again (a double click, a resend): the same rerun, no second run.
    count = len(_runs(procs.url))
    again = browser.post("/runs/orig/rerun", data=data, headers=origin)
    assert again.status_code == 303 and again.headers["location"] == f"/runs/{new_id}"
    assert len(_runs(procs.url)) == count
    assert [v.record.id for v in _runs(procs.url) if v.record.rerun_of == "orig"] == [new_id]
    assert [int(r.get(f"ordered:{s}") or 0) for s in ("zeta", "alpha", "mid")] == [1, 2, 2]

    # An id that names another run is refused, not passed off as the rerun.
    taken = browser.post("/runs/orig/rerun", data={"csrf": csrf, "new_id": "parked"},
                         headers={**origin, "Accept": "application/json"})
    assert taken.status_code in (400, 409) and "exists already" in taken.json()["error"]
    assert len(_runs(procs.url)) == count
