"""The dashboard's runs: the list (filters, a cursor), a run's page and its live fragment,
and the writes on a run (cancel, pause, resume, rerun, answer)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote, urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from ..engine.authoring import REGISTRY, InputError
from ..engine.paging import Cursor, Filters, Page, RunPager
from ..engine.runs import STATUSES
from ..engine.selection import FilterError, RunFilter, Selection
from ..engine.tags import TagError, parse_tags
from ..errors import InvalidIdError
from ..store.ids import check_id
from ..store.replies import as_text
from . import reads
from .endpoint import CSRF_MARK, Web, readable, redirect_flash, write
from .security import CSRF_FIELD

PAGE_SIZE = 50
COUNT_CAP = 10_000  # "select all N matching" counts this far, then shows "10000+"
MAX_TICKED = 1000  # ids one batch-bar POST carries
WINDOWS = {"15m": 15 * 60_000, "1h": 3_600_000, "24h": 86_400_000, "7d": 7 * 86_400_000}


def runs_params(request: Request) -> dict[str, Any]:
    """The filters and the cursor of a Runs page, as read (whatever else is in the
    query)."""
    return params_of(request.query_params)


def params_of(q: Mapping[str, str]) -> dict[str, Any]:
    """runs_params of a query, or of the filter fields a batch-bar form carries."""
    status = q.get("status") or None
    if status not in STATUSES:
        status = None
    window = q.get("window") or ""
    if window not in WINDOWS:
        window = ""
    try:
        after = Cursor.decode(q.get("after"))
    except ValueError:
        after = None
    tag = (q.get("tag") or "").strip()
    tag_error = ""
    try:
        tags = parse_tags([tag]) if tag else ()
    except TagError as exc:
        # Kept, not dropped: without its tag the filter would select more runs than asked
        # for (and a batch on "all matching" act on them).
        tags, tag_error = (), str(exc)
    return dict(status=status, workflow=q.get("workflow") or None,
                queue=q.get("queue") or None, window=window, tag=tag, tags=tags,
                tag_error=tag_error, after=after.encode() if after is not None else "")


def _since_ms(window: str) -> int | None:
    return int(time.time() * 1000) - WINDOWS[window] if window else None


def run_filter(p: dict[str, Any]) -> RunFilter | None:
    """The filter of a Runs page as the batch bar's "all matching" uses it; None when the
    page has no filter (a batch never means every run)."""
    if p["tag_error"]:
        return None
    since = _since_ms(p["window"])
    try:
        return RunFilter.build(status=p["status"], workflow=p["workflow"], queue=p["queue"],
                               since=None if since is None else since / 1000,
                               tags=[f"{k}={v}" for k, v in p["tags"]])
    except FilterError:
        return None


def runs_context(web: Web, request: Request) -> dict[str, Any]:
    settings = web.settings
    p = runs_params(request)
    status, window = p["status"], p["window"]
    since = _since_ms(window)
    filters = Filters(status=status, workflow=p["workflow"], queue=p["queue"],
                      since_ms=since, tags=p["tags"])
    after = Cursor.decode(p["after"]) if p["after"] else None
    t0 = time.perf_counter()
    if p["tag_error"]:
        page = Page(rows=[], next=None, scanned=0, exhausted_budget=False)
    else:
        page = RunPager(settings.runs(read_only=True)).page(limit=PAGE_SIZE, after=after,
                                                             filters=filters)
    took_ms = (time.perf_counter() - t0) * 1000
    params = {"status": status or "", "workflow": filters.workflow or "",
              "queue": filters.queue or "", "window": window if since else "",
              "tag": p["tag"]}
    return dict(page=page, params=params, took_ms=took_ms, first=after is None,
                filter_error=p["tag_error"],
                workflows=declared_workflows(web, filters.workflow), windows=list(WINDOWS))


def declared_workflows(web: Web, chosen: str | None) -> list[str]:
    """The workflow filter's choices: what the workers declared (engine/catalog.py) and what
    --source loads here, with the one asked for even if neither knows it (an old run's)."""
    names = set(REGISTRY.workflows)
    names.update(as_text(n) for n in web.settings.reader().client.hkeys(
        web.settings.keys.workflows))
    if chosen:
        names.add(chosen)
    return sorted(names)


def charts_of(web: Web, request: Request, path: str) -> dict[str, Any]:
    """The charts partial's context (templates/_charts.html): the rollups of the span asked
    (`span`), and the page's own query for its span links."""
    from .chart_data import charts_context

    query = {k: v for k, v in request.query_params.items() if k != "span"}
    return dict(charts=charts_context(web.settings, request.query_params.get("span")),
                charts_base=f"{path}?{urlencode(query)}&" if query else f"{path}?")


def routes(web: Web) -> list[BaseRoute]:
    settings = web.settings

    @readable(web)
    def runs_page(request: Request) -> Response:
        search = (request.query_params.get("id") or "").strip()
        if search:
            try:
                check_id(search, "run id")
            except InvalidIdError as exc:
                return redirect_flash("/runs", False, str(exc))
            if settings.runs(read_only=True).get(search) is not None:
                return RedirectResponse(f"/runs/{search}", status_code=303)
            return redirect_flash("/runs", False, f"no run with id {search!r}")
        ctx = runs_context(web, request)
        selected = run_filter(runs_params(request))
        matching = None if selected is None else Selection(
            settings.runs(read_only=True), selected, batch=1000).count(0, cap=COUNT_CAP)[0]
        response = web.render(request, "runs.html", title="Runs", live="runs",
                              live_query=request.url.query, matching=matching,
                              count_cap=COUNT_CAP, **ctx, **charts_of(web, request, "/runs"))
        # What the page's reads cost, for a browser's network panel and the bench.
        response.headers["Server-Timing"] = f"runs;dur={ctx['took_ms']:.1f}"
        return response

    @readable(web)
    def run_page(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        try:
            page = reads.run_page(settings, check_id(run_id, "run id"))
        except InvalidIdError as exc:
            return web.render(request, "error.html", 400, message=str(exc))
        if page is None:
            return web.render(request, "error.html", 404,
                              message=f"no run with id {run_id!r} (finished runs are pruned "
                                      f"once their retention ends)")
        return web.render(request, "run.html", title=f"Run {run_id}", live="run",
                          live_query=urlencode({"id": run_id}), run=page, run_id=run_id)

    def run_action(name: str) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            run_id = request.path_params["run_id"]

            def do(form: dict[str, str]) -> str | tuple[str, str]:
                if name == "rerun":
                    new_id, message = web.actions.rerun(run_id, form.get("from_step"),
                                                        form.get("new_id"))
                    return f"/runs/{quote(new_id)}", message
                if name == "answer":
                    key = form.get("key", "")
                    decision = form.get("decision")
                    if decision in ("approve", "reject"):
                        return web.actions.answer(
                            run_id, key, {"approved": decision == "approve",
                                          "note": form.get("note") or None},
                            kind="approval", what="approved" if decision == "approve"
                            else "rejected")
                    value = form.get("value", "")
                    return web.actions.answer(run_id, key, value, kind="question",
                                              what=f"answered {value!r}")
                if name == "retry":
                    return web.actions.retry(run_id, form.get("input_patch") or None)
                if name == "fail":
                    return web.actions.fail(run_id, form.get("reason") or None)
                if name == "cancel":
                    return web.actions.cancel(run_id, compensate=form.get("compensate") == "1")
                action: Callable[[str], str] = getattr(web.actions, name)
                return action(run_id)

            return await write(web, request, do, f"/runs/{run_id}")
        return endpoint

    async def batch(request: Request) -> Response:
        """The batch bar: an action on the runs ticked (`ids`), or on every run the page's
        filter selects (`scope=all`), through the client's bulk call."""
        back = "/runs"

        def do(form: dict[str, str]) -> str:
            target: Any
            if form.get("scope") == "all":
                p = params_of(form)
                if p["tag_error"]:
                    raise TagError(p["tag_error"])
                # The page reads an unknown status or window as none; a batch must not.
                if (form.get("status") or None) not in (None, *STATUSES):
                    raise FilterError(f"unknown status {form['status'][:40]!r}")
                if (form.get("window") or "") not in ("", *WINDOWS):
                    raise FilterError(f"unknown window {form['window'][:40]!r}")
                target = run_filter(p)
                if target is None:
                    raise InputError("set a filter first: a batch never means every run")
                target = dataclasses.replace(target, until=time.time())
                if form.get("action") in ("approve", "reject") and form.get("key"):
                    target = dataclasses.replace(target, question=form["key"])
            else:
                target = (form.get("ids") or "").split()
                if not target:
                    raise InputError("tick some runs first (or select all matching)")
                if len(target) > MAX_TICKED:
                    raise InputError(f"at most {MAX_TICKED} runs at once")
                for run_id in target:
                    check_id(run_id, "run id")
            return web.actions.bulk(form.get("action", ""), target, key=form.get("key"),
                                    note=form.get("note"))

        return await write(web, request, do, back)

    return [
        Route("/runs", runs_page),
        Route("/runs/batch", batch, methods=["POST"]),
        Route("/runs/{run_id}", run_page),
        *[Route(f"/runs/{{run_id}}/{name}", run_action(name), methods=["POST"])
          for name in ("cancel", "pause", "resume", "rerun", "answer", "retry", "fail")],
    ]


def fragments(web: Web) -> dict[str, Callable[[Request], str]]:
    settings = web.settings

    def run_fragment(request: Request) -> str:
        run_id = check_id(request.query_params.get("id", ""), "run id")
        page = reads.run_page(settings, run_id)
        if page is None:
            return "<p class=empty>This run is gone (pruned).</p>"
        return web.fragment("_run.html", run=page, run_id=run_id, csrf=CSRF_MARK,
                            csrf_field=CSRF_FIELD)

    return {
        "runs": lambda r: web.fragment("_runs.html", **runs_context(web, r)),
        "run": run_fragment,
    }
