"""Artifacts (docs/how-to/artifacts.md): a workflow that renders a weekly report and stores
it as the next version of a declared artifact, and one that appends a line to a shared log
with a compare-and-set, retrying when another run wrote first."""

from __future__ import annotations

import msgspec

import marbles_rq as mr

# Declared at module level: `marbles-rq artifacts` and the dashboard list it before any
# version exists.
weekly = mr.artifact("weekly-report", media_type="text/html")
changelog = mr.artifact("changelog", media_type="text/plain")


class Week(msgspec.Struct):
    week: str
    sales: int = 0


@mr.step
def render_report(week: str, sales: int) -> str:
    return f"<h1>Week {week}</h1><p>{sales} sales</p>"


@mr.workflow
def weekly_report(ctx: mr.RunContext, inp: Week) -> int:
    html = render_report(inp.week, inp.sales)
    # Recorded: a replay or a redelivery returns this version and writes none again.
    return weekly.put(html, meta={"week": inp.week})


@mr.step
def append_line(line: str) -> int:
    while True:
        latest = changelog.latest()  # 0: no version yet
        text = changelog.get().decode() if latest else ""
        try:
            return changelog.put(text + line + "\n", expect_version=latest)
        except mr.ArtifactConflict:
            continue  # another run wrote first: read its version and try again


@mr.workflow
def log_change(ctx: mr.RunContext, line: str) -> int:
    return append_line(line)
