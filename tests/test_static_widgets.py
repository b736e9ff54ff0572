"""What a notebook's saved outputs show without a kernel (issue 43): every live widget leaves a
static picture of its figure and a sentence, not "VBox(children=(...", a figure carries an HTML
copy that nbconvert can put in a page, a dashboard whose runs are over gives its place to a
static copy and drops plotly's 5.1 MB widget bundle from the saved state, and the site's pages
carry no widget state.

The first tests build the widgets in this process; the last executes a small notebook in a real
kernel (tools/claims_report.run_notebook, as the report does) and reads what it saved."""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import nbformat
import plotly.graph_objects as go
import plotly.io as pio
import pytest

from distlab.config import RunConfig
from distlab.lab.dashboard import LiveDashboard
from distlab.lab.live import (NO_VIEW_ESM, PLOTLY_MIME, FigureView, LiveBox, page_html, retire,
                              static_bundle, use_page_copies)
from distlab.lab.panel import ControlPanel
from distlab.lab.parallelism_nd import MeshND

REPO = Path(__file__).resolve().parent.parent
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
ESM_BYTES = 1_000_000  # plotly's widget bundle is 5.1 MB; a retired model's is a line


def _figure_of(bundle) -> go.Figure:
    return go.Figure(bundle[PLOTLY_MIME])


def test_a_panel_leaves_a_sentence_and_its_figure_beside_the_widget():
    panel = ControlPanel(steps=2)
    bundle = panel.widget._repr_mimebundle_()
    assert WIDGET_MIME in bundle  # live in JupyterLab: the widget ranks first there
    assert not bundle["text/plain"].startswith("LiveBox(") and "VBox(" not in bundle["text/plain"]
    assert "control panel" in bundle["text/plain"] and "run this cell" in bundle["text/plain"]
    # the picture is the dashboard's figure as it is now: three charts, the hint on top
    assert len(_figure_of(bundle).data) == len(panel.dashboard.fig.data) > 0
    assert "run this cell" in bundle["text/html"] and "Plotly.newPlot" in bundle["text/html"]


def test_an_explorer_picture_is_its_figure_after_each_redraw():
    mesh = MeshND(RunConfig(), tp=2)
    before = _figure_of(mesh.widget._repr_mimebundle_())
    mesh.knobs["tp"].value = 4  # redraws: the picture and the static view follow
    after = _figure_of(mesh.widget._repr_mimebundle_())
    assert before.layout.title.text != after.layout.title.text == mesh.fig.layout.title.text
    shown = mesh.view.widget.outputs[0]["data"][PLOTLY_MIME]
    assert shown["layout"]["title"]["text"] == mesh.fig.layout.title.text


def test_a_figure_view_sends_a_figure_only_when_it_changed():
    fig = go.Figure(go.Bar(x=[0, 1], y=[1, 2]))
    view = FigureView(fig)
    first = view.widget.outputs
    view.show()
    assert view.widget.outputs is first  # unchanged: nothing sent again
    fig.data[0].y = [3, 4]
    view.show()
    assert list(view.widget.outputs[0]["data"][PLOTLY_MIME]["data"][0]["y"]) == [3, 4]


def test_a_box_without_a_figure_still_says_what_it_is():
    import ipywidgets as W
    bundle = LiveBox([W.HTML("x")], "a drill list")._repr_mimebundle_()
    assert bundle["text/plain"].startswith("a drill list: a live widget")
    assert PLOTLY_MIME not in bundle


def test_page_copy_draws_from_the_cdn_or_leaves_the_reason():
    text = page_html(go.Figure(go.Scatter(x=[0, 1], y=[2, 3])))
    assert "https://cdn.plot.ly/" in text and "Plotly.newPlot" in text
    assert "needs plotly.js" in text and ".remove()" in text  # the note goes once drawn


def test_in_a_kernel_figures_carry_an_html_copy(monkeypatch):
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")  # plotly's kernel choice
    use_page_copies()
    bundle = go.Figure(go.Scatter(x=[0], y=[1]))._repr_mimebundle_()
    assert PLOTLY_MIME in bundle and "Plotly.newPlot" in bundle["text/html"]
    monkeypatch.setattr(pio.renderers, "default", "browser")  # another environment's choice
    use_page_copies()
    assert pio.renderers.default == "browser"


def test_a_dashboard_is_static_until_a_run_and_static_again_after():
    dash = LiveDashboard()
    assert not isinstance(dash.fig, go.FigureWidget)
    assert dash.widget.children[0] is dash._view.widget  # the static view
    with dash._lock:
        dash._go_live()
    live = dash.fig
    assert isinstance(live, go.FigureWidget) and dash.widget.children[0] is live
    live.add_scatter(x=[0, 1], y=[1, 0])
    with dash._lock:
        dash._go_static()
    assert not isinstance(dash.fig, go.FigureWidget) and len(dash.fig.data) == len(live.data)
    assert dash.widget.children[0] is dash._view.widget
    assert live._esm == NO_VIEW_ESM and live.comm is None  # retired: closed, bundle dropped


def test_retire_closes_a_box_and_everything_in_it():
    import ipywidgets as W
    fig = go.FigureWidget()
    box = W.VBox([fig, W.HTML("status")])
    inner = box.children[1]
    retire(box)
    assert box.comm is None and inner.comm is None and fig.comm is None
    assert len(fig._esm) < 100


def test_static_bundle_is_plain_json():
    import numpy as np
    bundle = static_bundle(go.Figure(go.Scatter(x=np.arange(3), y=np.ones(3))))
    json.dumps(bundle)  # numpy arrays would not serialise
    assert bundle["text/plain"] == "<plotly figure: 1 traces>"


NOTEBOOK = [
    "from distlab import lab\nfrom distlab.config import RunConfig\n"
    "from distlab.caller.launch import launch\nimport plotly.graph_objects as go",
    "panel = lab.ControlPanel(steps=2)\npanel",
    "go.Figure(go.Scatter(x=[0, 1], y=[1, 2]))",
    "run = launch(RunConfig(steps=2, timeout_s=120))\ndash = lab.watch(run)\nrun.wait()",
    "go.Figure(go.Bar(x=[0, 1], y=[2, 1])).show()\nimport sys\n"
    "print('nbformat imported:', 'nbformat' in sys.modules)",
]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The small notebook above, executed in a kernel as the report executes a notebook."""
    sys.path.insert(0, str(REPO / "tools"))
    import claims_report
    src = tmp_path_factory.mktemp("src") / "static_widgets.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK])
    nbformat.write(nb, src)
    out = tmp_path_factory.mktemp("executed")
    # what the kernel saved, kept before for_reading makes the copy for readers
    KERNEL_SAVED.clear()
    real = claims_report.for_reading

    def keep_then_read(nb):
        KERNEL_SAVED.append(copy.deepcopy(nb))
        return real(nb)
    claims_report.for_reading = keep_then_read
    try:
        result = claims_report.run_notebook(src, quick=True, timeout=180, executed=out)
    finally:
        claims_report.for_reading = real
    assert result["status"] == "pass", result
    return out / src.name


KERNEL_SAVED: list = []  # the executed notebook as the kernel left it (the fixture fills it)


def _outputs(nb, i):
    return nb.cells[i].outputs


def test_saved_notebook_shows_no_widget_repr_and_no_widget_bundle(executed):
    """The report's executed copy is for reading (claims_report.for_reading): the panel's
    output keeps its picture, note and HTML copy, marked as a widget's, and loses the view
    no kernel will drive; no widget state is saved."""
    nb = nbformat.read(executed, as_version=4)
    panel = [o for o in _outputs(nb, 1) if o.get("metadata", {}).get("distlab_widget")]
    assert len(panel) == 1 and PLOTLY_MIME in panel[0].data
    assert WIDGET_MIME not in panel[0].data and "VBox(" not in panel[0].data["text/plain"]
    assert any("run this cell again" in o.data.get("text/markdown", "") for o in _outputs(nb, 1))
    # the watched run's cell: its display is now the static copy, not the widget
    watched = [o for o in _outputs(nb, 3) if o.get("data")]
    assert any(PLOTLY_MIME in o.data for o in watched)
    assert not any(WIDGET_MIME in o.data for o in watched)
    assert "widgets" not in nb.metadata
    assert executed.stat().st_size < 1_000_000


def test_the_kernels_widget_state_holds_no_plotly_bundle(executed):
    """What a notebook saved from a kernel keeps (before for_reading): a retired
    FigureWidget's state holds the stub, not plotly's ~5 MB bundle."""
    (kept,) = KERNEL_SAVED
    state = kept.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]
    esm = [len(m["state"].get("_esm", "")) for m in state.values()]
    assert esm and max(esm) < ESM_BYTES  # the watch's FigureWidget existed, and was retired


def test_nbconvert_draws_every_figure_or_says_why(executed):
    from nbconvert import HTMLExporter
    nb = nbformat.read(executed, as_version=4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    assert not [w for w in seen if "not able to be represented" in str(w.message)]
    assert "VBox(children" not in body
    # the panel's picture (its view taken out by for_reading), the plain figure, the watched
    # run's copy
    assert body.count("Plotly.newPlot") >= 3
    assert "needs plotly.js" in body


def test_the_site_keeps_no_widget_state_and_draws_the_widgets_picture(executed):
    sys.path.insert(0, str(REPO / "tools"))
    import build_site
    nb = nbformat.read(executed, as_version=4)
    figures = build_site.prepare(nb)
    assert "widgets" not in nb.metadata
    panel = [o for o in _outputs(nb, 1) if "site-note" in o.get("data", {}).get("text/html", "")]
    assert len(panel) == 1 and "Plotly.newPlot" in panel[0].data["text/html"]
    assert figures == 4  # the panel's picture, the plain figure, the watched run's copy, the
    # shown one


def test_show_draws_without_importing_nbformat(executed):
    """fig.show() in a kernel gives plotly's output type and the HTML copy, and nbformat (1.2 s
    of CPU to import, for a version check) stays unimported (live._renderers_without_nbformat)."""
    nb = nbformat.read(executed, as_version=4)
    shown = [o for o in _outputs(nb, 4) if o.get("data")]
    assert any(PLOTLY_MIME in o.data and "text/html" in o.data for o in shown), shown
    printed = "".join(o.get("text", "") for o in _outputs(nb, 4) if o.output_type == "stream")
    assert "nbformat imported: False" in printed, printed
