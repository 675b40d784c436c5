"""The dashboard's charts (marbles_rq/web/charts.py, chart_data.py) as pure functions: series
in, SVG out -- one bar per bin, stacked segments in the order asked, a title and description
for a screen reader, text escaped, gaps where nothing is known."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from marbles_rq.store.rollups import Durations, MinuteRollup
from marbles_rq.web import charts
from marbles_rq.web.chart_data import SPANS, build

NS = {"s": "http://www.w3.org/2000/svg"}
STACK = (("succeeded", "s-ok"), ("failed", "s-bad"))


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def test_stacked_bars_draws_one_bar_per_bin_with_its_segments() -> None:
    bars = [charts.Bar(f"10:0{i}", {"succeeded": i, "failed": 1 if i == 2 else 0})
            for i in range(5)]
    root = parse(charts.stacked_bars("c", "Runs <per minute>", bars, STACK))
    assert root.get("role") == "img"
    assert root.findtext("s:title", namespaces=NS) == "Runs <per minute>"
    assert "in all 10 succeeded, 1 failed" in (root.findtext("s:desc", namespaces=NS) or "")
    groups = root.findall("s:g[@class='bar']", NS)
    assert len(groups) == 5
    # An empty bin is a bar with no segment; bin 2 stacks failed on top of succeeded.
    assert groups[0].findall("s:rect", NS) == []
    seg = groups[2].findall("s:rect", NS)
    assert [r.get("class") for r in seg] == ["s-ok", "s-bad"]
    assert float(seg[1].get("y", 0)) < float(seg[0].get("y", 0))
    assert groups[2].findtext("s:title", namespaces=NS) == "10:02: 2 succeeded, 1 failed"
    # Heights are proportional: 4 succeeded is twice 2 succeeded.
    h = [float(g.findall("s:rect", NS)[0].get("height", 0)) for g in groups[1:5]]
    assert abs(h[3] - 2 * h[1]) < 0.2


def test_lines_leave_a_gap_where_nothing_is_known_and_escape_names() -> None:
    line = charts.Line("<b>wf</b> p95", [1000.0, None, 3000.0, 4000.0], "c1")
    svg = charts.lines("d", "Durations", ["a", "b", "c", "d"], [line], charts.seconds)
    assert "<b>" not in svg
    root = parse(svg)
    polylines = root.findall(".//s:polyline", NS)
    assert len(polylines) == 1  # the lone point before the gap is a dot, not a line
    assert len(polylines[0].get("points", "").split()) == 2
    assert len(root.findall(".//s:circle", NS)) == 3
    assert "latest: <b>wf</b> p95 4.0 s" in (root.findtext("s:desc", namespaces=NS) or "")


def test_build_bins_the_rollups_of_the_span() -> None:
    now = 29_000_000
    minutes = {now - 2: MinuteRollup(version=1, minute=now - 2, succeeded=3, failed=1,
                                     durations={"billing": Durations(3, 200, 900)},
                                     queued=4, waiting=2),
               now: MinuteRollup(version=1, minute=now, cancelled=2, queued=1, waiting=5)}
    c = build(minutes, now, "1h")
    runs = parse(str(c.runs))
    assert len(runs.findall("s:g[@class='bar']", NS)) == SPANS["1h"][0]
    assert "3 succeeded, 1 failed, 2 cancelled" in (runs.findtext("s:desc", namespaces=NS)
                                                    or "")
    assert c.legend_workflows == [("billing", "c1")]
    queues = parse(str(c.queues))
    assert "latest: queued 1; open questions no data; timed waits 5" in (
        queues.findtext("s:desc", namespaces=NS) or "")
    day = build(minutes, now, "24h")
    assert len(parse(str(day.runs)).findall("s:g[@class='bar']", NS)) == SPANS["24h"][0]
    assert build({}, now, "1h").empty
