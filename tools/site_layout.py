"""Check the layout of the plotly figures drawn on a page of the site (tools/build_site.py):
a figure whose plotting area is narrower than half the figure (a long legend or wide margins
squeezed it), or whose legend lies over the plotting area (where the data is drawn).

    .venv/bin/python tools/site_layout.py site        # every page of a built site
    # prints each page's problems; exit status 1 if there is any

From a playwright test, on a page whose figures are drawn:

    from site_layout import layout_problems           # tools/ on sys.path
    assert not layout_problems(page), layout_problems(page)

or over a whole built site, with a browser the test already launched:

    from site_layout import check_site
    assert not check_site(out, browser)

What is measured is what plotly.js drew, in the browser's own boxes (CSS pixels): the figure is
the `.main-svg` of each `.js-plotly-plot`; its plotting area is the union of its subplots'
drag rectangles (`.nsewdrag`: each subplot's axes' box, where the traces are drawn), so a
figure of two side-by-side subplots has the width of both and the gap between; the legend is
the `.legend` group's background box (what shows: a legend too long for its box scrolls, its
hidden entries are not counted). Why half: below it a figure's data gets less room than its decorations,
which is what a legend of a few dozen long entries does to a 1000-pixel figure. A legend may
touch the plotting area's edge (a rounding pixel, LEGEND_SLACK_PX); any more is an overlap.
Figures drawn with no size (a hidden output) are skipped.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update"]
MIN_PLOT_FRACTION = 0.5  # the plotting area's width over the figure's, at least
LEGEND_SLACK_PX = 2      # a legend may touch the plotting area by this much (rounding)
VIEWPORT = {"width": 1280, "height": 900}  # the site's pages are at most 1100 px wide
DRAW_TIMEOUT_MS = 30000

# One record per drawn figure: its boxes as plotly.js laid them out.
_MEASURE = """
els => els.map((el, i) => {
  const box = e => { const r = e.getBoundingClientRect();
                     return {x0: r.left, x1: r.right, y0: r.top, y1: r.bottom}; };
  const svg = el.querySelector('.main-svg');
  const lay = el.layout || {};
  const t = lay.title;
  const title = (t && (typeof t === 'string' ? t : t.text)) ||
                (el.querySelector('.gtitle') || {}).textContent || '';
  const lg = el.querySelector('.legend');
  const legend = lg && (lg.querySelector('.bg') || lg);  // the drawn box, not hidden entries
  return {index: i, id: el.id || '', title: title,
          figure: svg ? box(svg) : box(el),
          areas: [...el.querySelectorAll('.nsewdrag')].map(box),
          legend: legend ? box(legend) : null};
})
"""


@dataclass
class Problem:
    figure: int       # the figure's index on the page, in document order
    title: str
    kind: str         # "narrow plot" or "legend overlaps"
    detail: str

    def __str__(self) -> str:
        name = f"figure {self.figure}" + (f" ({self.title[:70]!r})" if self.title else "")
        return f"{name}: {self.kind}: {self.detail}"


def _overlap(a: dict, b: dict) -> tuple[float, float]:
    """The width and height of two boxes' intersection (0 where they do not meet)."""
    return (max(0.0, min(a["x1"], b["x1"]) - max(a["x0"], b["x0"])),
            max(0.0, min(a["y1"], b["y1"]) - max(a["y0"], b["y0"])))


def problems_of(fig: dict, min_plot_fraction: float = MIN_PLOT_FRACTION,
                legend_slack_px: float = LEGEND_SLACK_PX) -> list[Problem]:
    """The problems of one measured figure (a record of _MEASURE); pure, so testable alone."""
    out = []
    width = fig["figure"]["x1"] - fig["figure"]["x0"]
    areas = [a for a in fig["areas"] if a["x1"] > a["x0"] and a["y1"] > a["y0"]]
    if width <= 0 or not areas:  # not drawn (hidden), or no axes (a table, a pie)
        return out
    plot_w = max(a["x1"] for a in areas) - min(a["x0"] for a in areas)
    if plot_w / width < min_plot_fraction:
        out.append(Problem(fig["index"], fig["title"], "narrow plot",
                           f"plotting area {plot_w:.0f} px of the figure's {width:.0f} px "
                           f"({plot_w / width:.0%} < {min_plot_fraction:.0%})"))
    lg = fig["legend"]
    if lg and lg["x1"] > lg["x0"] and lg["y1"] > lg["y0"]:
        for k, a in enumerate(areas):
            w, h = _overlap(lg, a)
            if w > legend_slack_px and h > legend_slack_px:
                where = f"subplot {k}'s " if len(areas) > 1 else ""
                out.append(Problem(fig["index"], fig["title"], "legend overlaps",
                                   f"the legend covers {w:.0f} × {h:.0f} px of {where}plotting "
                                   "area"))
                break
    return out


def layout_problems(page, min_plot_fraction: float = MIN_PLOT_FRACTION,
                    legend_slack_px: float = LEGEND_SLACK_PX) -> list[Problem]:
    """Every layout problem of the plotly figures drawn on a playwright `page` (call it once
    they are drawn: wait_for_figures does that). An empty list: none found."""
    figures = page.locator(".js-plotly-plot").evaluate_all(_MEASURE)
    return [p for f in figures for p in problems_of(f, min_plot_fraction, legend_slack_px)]


def wait_for_figures(page, timeout_ms: int = DRAW_TIMEOUT_MS):
    """Wait until every figure of a site page (`.site-plot`, tools/build_site.py) is drawn."""
    page.wait_for_function(
        "() => [...document.querySelectorAll('.site-plot')].every(e => e.querySelector("
        "'.main-svg') && e.querySelector('.infolayer'))", timeout=timeout_ms)
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


def check_site(site_dir: Path, browser=None) -> dict[str, list[Problem]]:
    """Open each page of a built site from disk (every request that is not a file refused) and
    check its figures: {page name: its problems}, for the pages that have any. With no
    `browser`, one headless Chromium is launched for the pass and closed."""
    site_dir = Path(site_dir)
    pages = sorted(site_dir.glob("*.html"))
    if not pages:
        raise FileNotFoundError(f"no .html page in {site_dir}")
    if browser is None:
        from playwright.sync_api import sync_playwright
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                return check_site(site_dir, b)
            finally:
                b.close()
    found = {}
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:")
                   else r.abort())
        for path in pages:
            page.goto(path.as_uri())
            wait_for_figures(page)
            problems = layout_problems(page)
            if problems:
                found[path.name] = problems
    finally:
        page.close()
    return found


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("site", type=Path, help="a folder built by tools/build_site.py")
    args = ap.parse_args(argv)
    found = check_site(args.site)
    for name, problems in found.items():
        print(name)
        for p in problems:
            print(f"  {p}")
    n = sum(len(v) for v in found.values())
    print(f"{n} layout problem(s) on {len(found)} page(s)" if n else
          f"no layout problem on the {len(list(args.site.glob('*.html')))} pages")
    return 1 if n else 0


if __name__ == "__main__":
    sys.exit(main())
