"""What the live widgets share (the dashboard, the control panel, the explorers): reading a run
while it grows (its label, its loss curve, each rank's event of a step, where it stands), and
the plumbing every widget needs: a status line's words, an error as HTML, a stop that keeps the
kernel free, the note under a live widget, and a figure a page reload can draw again.
"""

from __future__ import annotations

import copy
import html
import os
import re
import threading
import time

import plotly.graph_objects as go
from IPython.display import Markdown, display

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
                    "restart, run this cell again to bring it back.</small>")


def show_live(widget):
    """Display a widget that stays live (a panel, an explorer) and the note under it."""
    display(widget, live_note())


def _error_html(what: str, e: BaseException) -> str:
    return (f"<span style='color:#c00'><b>{html.escape(what)}</b>: "
            f"{html.escape(type(e).__name__)}: {html.escape(str(e))}</span>")
