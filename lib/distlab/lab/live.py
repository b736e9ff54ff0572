"""What the live widgets share (the dashboard, the control panel, the explorers): reading a run
while it grows (its label, its loss curve, each rank's event of a step, where it stands), and
the plumbing every widget needs: a status line's words, an error as HTML, a stop that keeps the
kernel free, the note under a live widget, and a figure a page reload can draw again.
"""

from __future__ import annotations

import copy
import html
import json
import os
import re
import sys
import threading
import time
import uuid

import ipywidgets as W
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs_version
from IPython.display import Markdown, display
from plotly.io._base_renderers import MimetypeRenderer

from distlab.caller.run import Run


# -- reading a run -----------------------------------------------------------------------------
def run_label(run: Run, index: int | None = None) -> str:
    """'allreduce×2 fp32 #3': strategy×ranks precision (and a non-default all-reduce)."""
    cfg = run.cfg
    if cfg is None:
        name = os.path.basename(run.dir)
    else:
        name = f"{cfg.strategy}×{cfg.world_size} {cfg.precision}"
        if cfg.strategy == "allreduce" and cfg.allreduce != "torch":
            name += f" {cfg.allreduce}"
    return f"{name} #{index}" if index is not None else name


def loss_curve(run: Run) -> tuple[list[int], list[float]]:
    """Steps that every rank finished, and the loss at each averaged over ranks.

    Only whole steps are drawn: a step one rank logged and another not yet would show the
    loss of half a batch."""
    losses = run.losses()[: run.steps_done()]
    return list(range(len(losses))), losses


def step_events(run: Run, step: int) -> list[dict]:
    """Each rank's event of one step, in rank order."""
    return sorted((e for e in run.history("step") if e["step"] == step), key=lambda e: e["rank"])


def wire_sent(event: dict) -> int | None:
    """Bytes the kernel saw one rank write to the network in one step (distlab.wire), None
    where it cannot see them (NCCL, no /proc)."""
    return event.get("wire", {}).get("sent")


def describe(run: Run, label: str) -> str:
    """One line of plain text on where a run stands (escaped later for HTML), and what went
    wrong around it (Run.problems: simulated nodes that could not be made, a full disk)."""
    where = _stands(run, label)
    return where + "".join(f"; note: {p}" for p in list(run.problems))


def _stands(run: Run, label: str) -> str:
    steps = run.cfg.steps if run.cfg else "?"
    _, losses = loss_curve(run)
    loss = f", loss {losses[-1]:.3f}" if losses else ""
    if not run.done and not run.history("step"):  # no rank has finished a step yet
        return (f"starting {label}: {run.world_size} rank(s) starting, "
                f"{time.time() - run.started:.0f} s")
    if not run.done:
        return f"running {label}: step {len(losses)}/{steps}{loss}"
    if run.status == "done":
        took = (run.ended or time.time()) - run.started
        # a full disk may have kept the last steps' events out of the logs (Run.problems)
        which = "last recorded" if run.unrecorded_steps else "final"
        final = f", {which} loss {losses[-1]:.3f}" if losses else ""
        return f"done in {took:.1f} s{final}"
    if run.status == "failed" and run.error is not None:
        e = run.error
        return f"rank {e.rank} failed{_failed_where(e, run)}: {e.message}"
    return f"{run.status} at step {len(losses)}/{steps}{loss}"


def _failed_where(error, run: Run) -> str:
    """Where a rank failed: RunError.step is the step it was in; with no start event it never
    got to training."""
    if error.step is None:
        return ""
    if not run.history("start", rank=error.rank):
        return " during setup"
    if run.cfg is not None and error.step >= run.cfg.steps:
        return " after its last step"
    return f" at step {error.step}"


# -- what every live widget shares ---------------------------------------------------------------
def _stop_in_background(stop, say) -> None:
    """Call stop() in a thread: it waits for the ranks to exit (seconds), and the kernel stays
    free meanwhile. A failure goes to say() as a "stop failed" line (a thread's exception is
    seen by no one)."""
    def work():
        try:
            stop()
        except BaseException as e:  # noqa: BLE001 - never raise from a thread
            say(_error_html("stop failed", e))
    threading.Thread(target=work, daemon=True).start()


def status_text(widget) -> str:
    """An HTML status widget's words as a reader sees them (tags dropped, entities decoded):
    what a cell prints, where printing .value would show `&#x27;` for an apostrophe."""
    return html.unescape(re.sub(r"<[^>]+>", "", widget.value))


def keep_for_reload(fig) -> None:
    """Make what a new view of this FigureWidget starts from the figure as it is now.

    plotly's FigureWidget sends each change to the browser as a delta and keeps the state a new
    view is built from (`_widget_data`, `_widget_layout`) as it was when first displayed. A page
    reload with the kernel alive builds new views from that state: the run's figure came back
    as an empty, squashed grid (issue 25). Setting it again sends the whole figure once (the
    views already drawn ignore it), so it is done when a run ends, not on every redraw."""
    if isinstance(fig, go.FigureWidget) and hasattr(fig, "_widget_data"):
        fig._widget_layout = copy.deepcopy(fig._layout_obj._props)
        fig._widget_data = copy.deepcopy(fig._data)


# Under a widget that stays live (a panel, an explorer, a dashboard whose run outlasts its
# cell): the figure lives in the kernel, so a reload or a kernel restart loses it.
LIVE_NOTE = ("<br><small style='color:#666'>(this chart is live; after a reload or a kernel "
             "restart, run the cell again)</small>")


def live_note() -> Markdown:
    """The same note as a static output, shown under a live widget: it survives a reload
    that turns the widget into "Error displaying widget: model not found"."""
    return Markdown("<small style='color:#666'>Live widget: after a reload or a kernel "
                    "restart, run this cell again to bring it back. A page made from the saved "
                    "notebook (nbconvert) draws it only online: its widget manager comes from a "
                    "CDN.</small>")


def show_live(widget):
    """Display a widget that stays live (a panel, an explorer) and the note under it (a
    LiveBox says it itself)."""
    if isinstance(widget, LiveBox):
        display(widget)
    else:
        display(widget, live_note())


def _error_html(what: str, e: BaseException) -> str:
    return (f"<span style='color:#c00'><b>{html.escape(what)}</b>: "
            f"{html.escape(type(e).__name__)}: {html.escape(str(e))}</span>")


# -- what a page without a kernel shows ----------------------------------------------------------
# A notebook's saved outputs are read without a kernel too: by JupyterLab before the cells run
# (an untrusted notebook draws only "safe" outputs, and a widget is not one: it showed as
# "VBox(children=(HBox(...") and by `jupyter nbconvert --to html`, which draws neither a widget
# whose state is not saved nor plotly's own output type. So every figure also carries an HTML
# copy, and every live widget a static picture of its figure (issue 43).
PAGE_NOTE = ("This plotly figure needs plotly.js, which this page loads from cdn.plot.ly: "
             "offline, or where a page runs no scripts, it is not drawn. Open the notebook in "
             "JupyterLab, or read the workbook's site (tools/build_site.py), which carries "
             "plotly.js with it.")
WIDGET_NOTE = ("a live widget: in JupyterLab with a kernel, run this cell to use it. What "
               "follows is a static picture of its figure as the cell left it.")
PLOTLY_MIME = "application/vnd.plotly.v1+json"
# the plotly.js the installed plotly package draws with, from plotly's CDN (what pio.to_html's
# include_plotlyjs="cdn" writes)
PLOTLY_CDN = f"https://cdn.plot.ly/plotly-{get_plotlyjs_version()}.min.js"
# A FigureWidget's model carries plotly's whole widget bundle (`_esm`, 5.1 MB); a model whose
# view has been replaced by a static copy keeps this instead, so a saved notebook does not.
NO_VIEW_ESM = "export default { render() {} };  // distlab: no view left (a static copy)"


def page_html(fig, note: str = PAGE_NOTE) -> str:
    """A figure as HTML for a page without JupyterLab: the figure drawn by plotly.js from its
    CDN when the page can load it, the note (why it is missing) left in its place when not.
    Written from the figure's JSON: pio.to_html builds a Figure from it again, 0.4 s for a
    figure of 8 lines of 500 points, and every figure shown in a kernel gets this copy."""
    div = f"distlab-{uuid.uuid4().hex[:12]}"
    spec = pio.to_json(fig, validate=False).replace("</", "<\\/")  # no </script> inside
    why = f"<p id='{div}-why' style='color:#666'><small><i>{html.escape(note)}</i></small></p>"
    return (why + f"<div id='{div}' style='width:100%'></div>"
            f"<script src='{PLOTLY_CDN}'></script>"
            f"<script>(function () {{ if (!window.Plotly) {{ return; }} var f = {spec}; "
            f"Plotly.newPlot('{div}', f.data || [], f.layout || {{}}, {{responsive: true}}); "
            f"var n = document.getElementById('{div}-why'); if (n) {{ n.remove(); }} }})();"
            "</script>")


class _PageRenderer(MimetypeRenderer):
    """plotly's renderer for the HTML copy beside its own output type (page_html)."""

    def to_mimebundle(self, fig_dict):
        return {"text/html": page_html(fig_dict)}


class _NbformatVersion:
    """What plotly's show() reads of nbformat (its version), from the package's metadata; any
    other attribute imports nbformat itself."""

    def __init__(self, version: str):
        self.__version__ = version

    def __getattr__(self, name):
        import importlib
        return getattr(importlib.import_module("nbformat"), name)


def _renderers_without_nbformat() -> None:
    """Import plotly's renderers without importing nbformat, whose only use there is show()'s
    version check: the import costs 1.2 s of CPU in every kernel (jsonschema builds
    rfc3987_syntax's grammar), 30 s over CI's 26 kernels. Where plotly's internals differ from
    the version read here (7.1), plotly imports nbformat as it always did."""
    from importlib.metadata import PackageNotFoundError, version
    from _plotly_utils import optional_imports
    skip = getattr(optional_imports, "_not_importable", None)
    if "plotly.io._renderers" in sys.modules or "nbformat" in sys.modules or skip is None:
        return
    try:
        stand_in = _NbformatVersion(version("nbformat"))
    except PackageNotFoundError:
        return  # not installed: plotly says so at show()
    skip.add("nbformat")
    try:
        import plotly.io._renderers as renderers
    finally:
        skip.discard("nbformat")
    if getattr(renderers, "nbformat", False) is None:
        renderers.nbformat = stand_in


def use_page_copies() -> None:
    """In a kernel, figures carry an HTML copy beside plotly's output type: JupyterLab draws
    plotly's (its renderer ranks first), nbconvert and GitHub the copy. Only where plotly chose
    its plain kernel default: an environment's own choice (PLOTLY_RENDERER, VS Code, Colab)
    stands."""
    _renderers_without_nbformat()
    pio.renderers["distlab_page"] = _PageRenderer()
    if pio.renderers.default == "plotly_mimetype":
        pio.renderers.default = "plotly_mimetype+distlab_page"


def static_bundle(fig) -> dict:
    """A figure as a display's data: plotly's output type (JupyterLab draws it, trusted or
    not), its HTML copy (page_html) and a line of text."""
    fig = fig if isinstance(fig, dict) else fig.to_plotly_json()  # no copy: 0.4 s a figure
    return {PLOTLY_MIME: _plain(fig), "text/html": page_html(fig),
            "text/plain": f"<plotly figure: {len(fig.get('data', []))} traces>"}


def _plain(fig: dict) -> dict:
    """A figure's JSON with numpy arrays as lists (what a notebook's JSON can hold)."""
    return json.loads(pio.to_json(fig, validate=False))


class FigureView:
    """A figure shown in a widget as a static plotly output (an Output widget), for a figure
    redrawn when its work ends, not streamed: an explorer's. A FigureWidget would add plotly's
    5.1 MB widget bundle to every saved notebook that shows one; a static output is the
    figure's own size, and is what JupyterLab draws anyway. `show()` after each redraw."""

    def __init__(self, fig: go.Figure):
        self.fig = fig
        self.widget = W.Output()
        self._shown = None
        self.show()

    def show(self) -> None:
        """Put the figure as it is now in the view (from any thread: it only sets a widget's
        value); nothing is sent when it has not changed since the last call."""
        data = static_bundle(self.fig)
        key = json.dumps(data[PLOTLY_MIME], sort_keys=True)
        if key != self._shown:
            self._shown = key
            self.widget.outputs = ({"output_type": "display_data", "data": data,
                                    "metadata": {}},)


class LiveBox(W.VBox):
    """A live widget's outer box that leaves a picture where no kernel is: besides the widget,
    its display carries a static copy of its figure (plotly's output type, which an untrusted
    JupyterLab draws, and HTML for nbconvert) and a line of text instead of the VBox repr.
    `figure` returns the figure as it is now (None: nothing to picture); `what` names it."""

    def __init__(self, children, what: str, figure=None, **kwargs):
        super().__init__(children, **kwargs)
        self._what, self._figure = what, figure

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        fig = self._figure() if self._figure is not None else None
        note = f"{self._what}: {WIDGET_NOTE}"
        data["text/plain"] = note
        data["text/html"] = (f"<p style='color:#666'><i>{html.escape(note)}</i></p>"
                             + (page_html(fig) if fig is not None else ""))
        if fig is not None:
            data[PLOTLY_MIME] = _plain(fig if isinstance(fig, dict) else fig.to_plotly_json())
        return data

    def _ipython_display_(self):
        """The widget and the note under it (live_note), however it is shown: `panel`, or
        `explorer.widget` as a cell's last line."""
        display(self._repr_mimebundle_(), raw=True)
        display(live_note())


def retire(widget) -> None:
    """Close a widget whose view a static copy replaced, and its children: it lives on in the
    kernel and in a saved notebook's widget state otherwise. A FigureWidget first drops plotly's
    5.1 MB bundle (NO_VIEW_ESM): nbclient records the state a model was last sent and keeps it
    after the model closes."""
    for child in getattr(widget, "children", ()):
        retire(child)
    if isinstance(widget, go.FigureWidget):
        widget._esm = NO_VIEW_ESM
    widget.close()


def in_a_kernel() -> bool:
    """True in a Jupyter kernel (a notebook), False in scripts and tests, even those that have
    imported ipykernel (nbval does), and in the ranks and the fork server they start from."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


# Only in a kernel, where figures are shown: plotly's renderers cost 0.1 s to import (and, but
# for _renderers_without_nbformat, nbformat's 1.2 s), which every rank that ran a lab function,
# every fork server and every test worker paid otherwise
if in_a_kernel():
    use_page_copies()
