"""The workbook as a static site (tools/build_site.py), opened from disk in Chromium with every
request that is not a file refused: one notebook executed in quick mode (14_long_context:
plotly figures and an explorer widget), the others from their sources. The figures draw
(plotly.js from the site itself), the widget is a note above its figure's picture, the page
keeps no widget state (issue 43: it was most of a page's weight), no page asks the network
for anything, and every link of the index, the interview index and the reference pages
(docs/) reaches a page (and its anchor)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update"]
NOTEBOOK = "14_long_context"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} is missing: apt-get install chromium"),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is missing")
sys.path.insert(0, str(REPO / "tools"))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    import build_site
    import claims_report
    executed = tmp_path_factory.mktemp("executed")
    out = tmp_path_factory.mktemp("site")
    os.environ.setdefault("DISTLAB_RUNS", str(tmp_path_factory.mktemp("runs")))
    result = claims_report.run_notebook(REPO / "workbook" / f"{NOTEBOOK}.ipynb", quick=True,
                                        timeout=300, executed=executed)
    assert result["status"] == "pass", result
    pages = build_site.build(executed, out)
    return out, pages


def _links(page) -> list[str]:
    return page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")


def test_the_site_reads_offline_with_figures_drawn_and_links_resolving(site):
    out, pages = site
    assert pages[NOTEBOOK] >= 2  # its plotly figures, turned into drawable divs
    # one story: the executed page names its run, the claims page says it is the report's
    import re
    html_text = (out / f"{NOTEBOOK}.html").read_text()
    assert re.search(r"This page shows the run of \d{4}-\d\d-\d\d \d\d:\d\d UTC", html_text)
    assert "widget-state+json" not in html_text  # no page draws a widget: its state is weight
    if (out / "claims.html").exists():
        assert "not the run each notebook page shows" in (out / "claims.html").read_text()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page()
        asked = []
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:")
                   else (asked.append(r.request.url), r.abort()))
        page.goto((out / f"{NOTEBOOK}.html").as_uri())
        page.wait_for_selector(".site-plot .main-svg", timeout=30000)
        time.sleep(1)
        drawn = page.locator(".site-plot").evaluate_all(
            "els => els.filter(e => e.querySelector('.main-svg')).length")
        assert drawn == pages[NOTEBOOK], (drawn, pages[NOTEBOOK])
        assert page.locator(".site-note").count() >= 1  # the explorer: a note, not a repr
        # every figure's plotting area at least half its width, no legend over the data
        import site_layout
        site_layout.wait_for_figures(page)
        problems = site_layout.layout_problems(page)
        assert not problems, [str(p) for p in problems]
        checked = 0
        reference = [f"{md.stem}.html" for md in sorted((REPO / "docs").glob("*.md"))
                     if md.stem != "interview_index"]
        assert reference, "docs/ holds no reference page"
        for start in ("index.html", "interview_index.html", *reference):
            page.goto((out / start).as_uri())
            for href in _links(page):
                url = urlparse(href)
                if url.scheme != "file":
                    continue
                target = Path(unquote(url.path))
                assert target.exists(), f"{start} links to {target.name}, which is not built"
                if url.fragment:  # the browser finds the id as written, or decoded
                    text = target.read_text(encoding="utf-8")
                    assert (f'id="{url.fragment}"' in text
                            or f'id="{unquote(url.fragment)}"' in text), \
                        f"{start} links to {target.name}#{url.fragment}: no such anchor"
                checked += 1
        browser.close()
    assert not asked, f"pages asked the network for {asked[:3]}"
    assert checked > 20  # the index's notebooks and the interview index's sections
