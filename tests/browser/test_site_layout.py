"""tools/site_layout.py, the site's figure-layout checker, on two tiny pages drawn in Chromium
with the plotly.js the site ships (the installed plotly package's, as tools/build_site.py
copies it): one good figure, which it must pass, and two bad ones it must flag (a legend of
long entries that squeezes the plotting area under half the figure, and a legend placed over
the plotting area). One browser launch; a few seconds."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import site_layout  # noqa: E402

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(site_layout.CHROMIUM),
                       reason=f"{site_layout.CHROMIUM} is missing: apt-get install chromium"),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is missing")

X = [0, 1, 2, 3, 4]


def _page(figures: list[dict]) -> str:
    """A page as tools/build_site.py writes one: plotly.min.js beside it, a `.site-plot` div
    and a newPlot call per figure, in a body at most 1100 px wide."""
    divs = "".join(
        f"<div id='plot-{i}' class='site-plot'></div><script>(function(){{var f={json.dumps(f)};"
        f"Plotly.newPlot('plot-{i}',f.data,f.layout,{{responsive:true}});}})();</script>"
        for i, f in enumerate(figures))
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            "<script src='plotly.min.js'></script></head>"
            f"<body style='max-width:1100px;margin:2em auto'>{divs}</body></html>")


GOOD = [
    {"data": [{"x": X, "y": [3, 2.5, 2.2, 2.0, 1.9], "name": "loss", "type": "scatter"},
              {"x": X, "y": [3, 2.7, 2.5, 2.4, 2.3], "name": "baseline", "type": "scatter"}],
     "layout": {"title": {"text": "good: a short legend beside the plot"}, "height": 360}},
    # two subplots side by side: together they fill the figure
    {"data": [{"x": X, "y": X, "name": "left", "xaxis": "x", "yaxis": "y"},
              {"x": X, "y": X[::-1], "name": "right", "xaxis": "x2", "yaxis": "y2"}],
     "layout": {"title": {"text": "good: two subplots"}, "height": 360,
                "xaxis": {"domain": [0, 0.45]}, "xaxis2": {"domain": [0.55, 1]},
                "yaxis2": {"anchor": "x2"}, "legend": {"orientation": "h", "y": -0.2}}},
]
BAD = [
    # 12 entries with long names (~600 px of text): plotly widens the right margin for the
    # legend, leaving the plot under half of an 1100 px figure
    {"data": [{"x": X, "y": [v * (k + 1) for v in X], "type": "scatter",
               "name": f"B={8 * (k + 1)} linear rule lr={0.1 * (k + 1):.2f} with 15 warm-up "
                       f"steps, run {k} of the grid, seed 0, loss measured at 480 samples, "
                       "not diverged"} for k in range(12)],
     "layout": {"title": {"text": "bad: squeezed by its legend"}, "height": 420}},
    {"data": [{"x": X, "y": X, "name": "up"}, {"x": X, "y": X[::-1], "name": "down"}],
     "layout": {"title": {"text": "bad: legend over the data"}, "height": 360,
                "legend": {"x": 0.4, "y": 0.6}}},
]


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    import plotly
    good, bad = tmp_path_factory.mktemp("good"), tmp_path_factory.mktemp("bad")
    for folder, figures in ((good, GOOD), (bad, BAD)):
        shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", folder)
        (folder / "page.html").write_text(_page(figures), encoding="utf-8")
    return good, bad


def test_the_checker_passes_a_good_figure_and_flags_squeezed_and_covered_ones(pages):
    good, bad = pages
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=site_layout.CHROMIUM,
                                    args=site_layout.CHROMIUM_ARGS)
        try:
            assert site_layout.check_site(good, browser) == {}
            found = site_layout.check_site(bad, browser)
            # and on one page directly, as a test that already holds a drawn page calls it
            page = browser.new_page(viewport=site_layout.VIEWPORT)
            page.goto((bad / "page.html").as_uri())
            site_layout.wait_for_figures(page)
            direct = site_layout.layout_problems(page)
            page.close()
        finally:
            browser.close()
    problems = found["page.html"]
    assert [str(p) for p in problems] == [str(p) for p in direct]
    kinds = {(p.figure, p.kind) for p in problems}
    assert kinds == {(0, "narrow plot"), (1, "legend overlaps")}, [str(p) for p in problems]
    assert "squeezed by its legend" in problems[0].title


def test_problems_of_reads_the_boxes():
    """The rules on measured boxes, without a browser: half the width is the bar, and a legend
    touching the plotting area by the slack is not an overlap."""
    def fig(plot_x1, legend):
        return {"index": 0, "title": "t", "figure": {"x0": 0, "x1": 1000, "y0": 0, "y1": 400},
                "areas": [{"x0": 80, "x1": plot_x1, "y0": 60, "y1": 340}], "legend": legend}
    assert site_layout.problems_of(fig(600, None)) == []          # 52% of the width
    assert [p.kind for p in site_layout.problems_of(fig(560, None))] == ["narrow plot"]  # 48%
    touching = {"x0": 599, "x1": 700, "y0": 60, "y1": 120}
    assert site_layout.problems_of(fig(600, touching)) == []
    over = {"x0": 500, "x1": 700, "y0": 60, "y1": 120}
    assert [p.kind for p in site_layout.problems_of(fig(600, over))] == ["legend overlaps"]
