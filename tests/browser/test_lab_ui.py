"""00_start_here in a real browser: Run All, then the control panel's Run button.

What only a browser shows: that the widgets render (no "Loading widget" / "Error displaying
widget"), that plotly really drew the points the kernel sent from its thread, and that a click
reaches the kernel and starts a run. Screenshots go to $DISTLAB_SHOTS (default: a temp folder);
the test prints their paths.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
# Headless, and nothing that reaches the network: this machine has none.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
NOTEBOOK = "workbook/00_start_here.ipynb"
QUICK_STEPS = 30  # STEPS in the notebook's parameters cell when WORKBOOK_QUICK=1
RUN_ALL_TIMEOUT_S = 120
PANEL_RUN_TIMEOUT_S = 60

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} is missing: apt-get install chromium"),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is missing")

# State of every code cell: its prompt ("[3]:", "[*]:", "[ ]:") and whether an output holds a
# traceback (an error renders as stderr text starting with the exception's traceback).
CELLS_JS = """() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')].map(c => ({
    prompt: (c.querySelector('.jp-InputArea-prompt') || {}).textContent || '',
    error: [...c.querySelectorAll('.jp-OutputArea-output')].some(
        o => /Traceback|Error:/.test(o.textContent) &&
             (o.dataset.mimeType || '').includes('stderr'))}))"""
# Points in each loss trace (the ones named after a run, "... #1") of a dashboard's plotly div.
TRACES_JS = """(gd) => gd.data.filter(t => / #\\d+$/.test(t.name || ''))
                                  .map(t => ({name: t.name, n: (t.x || []).length}))"""


# Bytes each rank sent in the latest step, from the bar traces of the bytes subplot: booked by
# distlab.comm, and on the wire (the kernel's count, Linux only).
SENT_JS = """(gd) => gd.data.find(t => t.name === 'booked').customdata"""
WIRE_JS = """(gd) => gd.data.find(t => t.name === 'on the wire').customdata"""


# After a restart: outputs that show "Error displaying widget", and how many of them have no
# note in the same cell saying to run the cell again (lab.panel.live_note).
MISSING_WIDGETS_JS = """() => {
    const cells = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')];
    let errors = 0, unexplained = 0;
    for (const c of cells) {
        const n = [...c.querySelectorAll('.jp-OutputArea-output')].filter(
            o => o.textContent.includes('Error displaying widget')).length;
        errors += n;
        if (n && !c.textContent.includes('run this cell again')) unexplained += n;
    }
    return {errors, unexplained};
}"""


def choose(scope, description: str, label: str):
    scope.locator(".widget-dropdown", has_text=description).locator("select").select_option(
        label=label)


def selected(scope, description: str) -> str:
    select = scope.locator(".widget-dropdown", has_text=description).locator("select")
    return select.evaluate("s => s.options[s.selectedIndex].text")


def wait_until(predicate, timeout_s: float, message: str):
    deadline = time.time() + timeout_s
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(message)
        time.sleep(0.2)


def code_cell_count(path: Path) -> int:
    return sum(c["cell_type"] == "code" for c in json.loads(path.read_text())["cells"])


def run_all_cells(page):
    page.locator(".jp-Notebook .jp-Cell").first.click()  # focus the notebook
    page.click('.lm-MenuBar-itemLabel:text-is("Run")')
    page.click('.lm-Menu-itemLabel:text-is("Run All Cells")')


def wait_cells_finished(page, n_code: int, timeout_s: float):
    """Until every code cell shows an execution count, failing at once on an error output."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        cells = page.evaluate(CELLS_JS)
        errors = [i for i, c in enumerate(cells) if c["error"]]
        assert not errors, f"code cells {errors} show a traceback"
        if len(cells) == n_code and all(re.match(r"\[\d+\]", c["prompt"]) for c in cells):
            return
        time.sleep(0.5)
    raise AssertionError(f"cells not finished after {timeout_s} s: "
                         f"{[c['prompt'] for c in page.evaluate(CELLS_JS)]}")


def loss_traces(page, scope: str) -> list[dict]:
    return page.locator(f"{scope} .js-plotly-plot").first.evaluate(TRACES_JS)


def shot(locator_or_page, path: Path, shots: list):
    locator_or_page.screenshot(path=str(path))
    shots.append(path)


def test_start_here_run_all_then_panel_run(lab_server, shots_dir):
    n_code = code_cell_count(lab_server.root / NOTEBOOK)
    shots: list[Path] = []
    t0 = time.time()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(lab_server.notebook_url(NOTEBOOK))
            page.wait_for_selector("#jp-main-statusbar >> text=Idle", timeout=60_000)

            run_all_cells(page)
            wait_cells_finished(page, n_code, RUN_ALL_TIMEOUT_S)
            t_run_all = time.time() - t0

            # The first dashboard (the `single` run): drawn live while its cell blocked, then,
            # the run over, left as a static plotly figure in the cell's output (what a reload
            # shows again); the only live dashboard left is the control panel's.
            first = page.locator(".jp-Notebook .js-plotly-plot").first
            first.scroll_into_view_if_needed()
            wait_until(lambda: [t["n"] for t in loss_traces(page, ".jp-Notebook")]
                       == [QUICK_STEPS], 15, "the first dashboard did not draw every step")
            assert page.locator(".distlab-dashboard").count() == 1  # the panel's
            shot(first, shots_dir / "00_first_run_dashboard.png", shots)

            # The control panel: a click must reach the kernel and start a run.
            panel = page.locator(".distlab-panel")
            panel.scroll_into_view_if_needed()
            panel.locator("button.jupyter-button", has_text="Run").click()
            status = panel.locator(".widget-html-content").first
            # "starting" while the ranks start (no step yet), "running" from the first step
            status.filter(has_text=re.compile("starting|running|done in")).wait_for(
                timeout=30_000)
            status.filter(has_text="done in").wait_for(timeout=PANEL_RUN_TIMEOUT_S * 1000)
            # plotly redraws asynchronously in the browser: the status text can arrive before
            # the last points are painted, so give the figure a moment to catch up
            wait_until(lambda: [t["n"] for t in loss_traces(page, ".distlab-panel")]
                       == [QUICK_STEPS], 15, "the panel's loss plot did not draw every step")
            panel_traces = loss_traces(page, ".distlab-panel")
            assert panel_traces and all(t["n"] > 0 for t in panel_traces), panel_traces

            # World size 2: the panel switches 'single' (one process) to 'allreduce', and the
            # second run overlays the first and draws bytes on the wire.
            choose(panel, "world size", "2")
            wait_until(lambda: selected(panel, "strategy") == "allreduce", 10,
                       "the strategy did not switch to allreduce")  # a round trip to the kernel
            panel.locator("button.jupyter-button", has_text="Run").click()
            runs_status = panel.locator(".distlab-dashboard .widget-html-content")
            runs_status.filter(has_text=re.compile(r"#2: done in")).wait_for(
                timeout=PANEL_RUN_TIMEOUT_S * 1000)
            wait_until(lambda: [t["n"] for t in loss_traces(page, ".distlab-panel")]
                       == [QUICK_STEPS] * 2, 15, "the second run's points were not all drawn")
            sent = panel.locator(".js-plotly-plot").first.evaluate(SENT_JS)
            assert len(sent) == 2 and all(b > 0 for b in sent), sent
            wire = panel.locator(".js-plotly-plot").first.evaluate(WIRE_JS)
            assert len(wire) == 2 and all(w >= b for w, b in zip(wire, sent)), (wire, sent)
            time.sleep(0.5)  # let plotly finish painting before the screenshot
            shot(panel, shots_dir / "01_control_panel_done.png", shots)
            shot(page, shots_dir / "02_page.png", shots)

            text = page.evaluate("() => document.body.textContent")
            assert "Loading widget" not in text
            assert "Error displaying widget" not in text

            # A page reload with the kernel alive: the widgets come back from the kernel's
            # state, the panel's figure with both runs' points at its full size.
            # (saved first, as JupyterLab's autosave would: a reload shows the saved file)
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.keyboard.press("Control+s")
            page.wait_for_function("() => !document.querySelector('.jp-mod-dirty')",
                                   timeout=30_000)
            page.reload()
            page.wait_for_selector("#jp-main-statusbar >> text=Idle", timeout=60_000)
            panel = page.locator(".distlab-panel")
            panel.scroll_into_view_if_needed()
            wait_until(lambda: [t["n"] for t in loss_traces(page, ".distlab-panel")]
                       == [QUICK_STEPS] * 2, 30, "after a reload the panel's runs were not drawn")
            box = panel.locator(".js-plotly-plot").first.bounding_box()
            time.sleep(0.5)
            shot(panel, shots_dir / "03_panel_after_reload.png", shots)
            assert box["height"] > 300 and box["width"] > 600, box

            # The kernel gone (a server restart): live widgets cannot come back without it.
            # The cell dashboards' static copies still show, and each live widget that cannot
            # come back says under it what to do.
            for k in lab_server.api("/api/kernels"):
                lab_server.api(f"/api/kernels/{k['id']}", method="DELETE")
            page.reload()
            # The first dashboard's static copy: plotly's figure, or the picture of it that
            # plotly's JupyterLab renderer saved beside it (what it shows until it draws).
            first_cell = page.locator(".jp-Notebook .jp-CodeCell").nth(2)  # the single run
            first_cell.scroll_into_view_if_needed()
            first_cell.locator(".js-plotly-plot, .jp-RenderedPlotly img").first.wait_for(
                timeout=30_000)
            # (the widget manager says so once the new kernel has answered that it has none)
            wait_until(lambda: page.evaluate(MISSING_WIDGETS_JS)["errors"] >= 1, 60,
                       "the panel's output never said its widget is gone")
            missing = page.evaluate(MISSING_WIDGETS_JS)
            assert missing["errors"] >= 1 and missing["unexplained"] == 0, missing
            broken = page.locator(".jp-OutputArea-child", has_text="Error displaying widget")
            broken.first.scroll_into_view_if_needed()
            shot(page, shots_dir / "04_page_after_restart.png", shots)
        finally:
            browser.close()

    # The click started exactly the run the panel's knobs describe, and it finished.
    runs = sorted(lab_server.runs.iterdir())
    assert len(runs) == 4, runs  # single and ddp×4 from the cells, two from the panel
    panel_run = sorted(runs, key=lambda d: (d / "config.json").stat().st_mtime)[-2]
    cfg = json.loads((panel_run / "config.json").read_text())
    assert (cfg["strategy"], cfg["world_size"], cfg["steps"]) == ("single", 1, QUICK_STEPS)
    assert cfg["lr"] == 3e-3  # RunConfig's default, unchanged by the slider's snapping
    assert json.loads((panel_run / "status.json").read_text())["status"] == "done"
    print(f"\nrun all: {t_run_all:.1f} s, whole browser session: {time.time() - t0:.1f} s")
    print("screenshots:\n" + "\n".join(f"  {s}" for s in shots))
