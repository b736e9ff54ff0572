"""Widgets for the workbook: a live dashboard of runs and a control panel that launches them.

    run = launch(cfg)       # returns at once; the ranks train in the background
    dash = lab.watch(run)   # shows the live figures under this cell
    run.wait()

    panel = lab.ControlPanel(steps=50)
    panel.widget            # knobs, Run / Stop, progress, and its own dashboard

Why it is built this way:

* One plotly `FigureWidget` per dashboard, with subplots. Each FigureWidget sends plotly's whole
  JavaScript bundle (~5 MB) to the browser when it is created, so three figures per dashboard
  would cost three times that.
* A daemon thread polls the watched runs (at most `POLL_S` apart) and redraws inside
  `batch_update()`, so a cell that blocks in `run.wait()` still sees the figures move: widget
  messages from a thread reach the browser while the cell runs.
* The thread only sets widget state. `print()` or `display()` from a thread lands in whichever
  cell happens to be executing, so this module never does either outside the main thread.
* Button handlers return at once (the run is non-blocking). Messages from the browser reach the
  kernel only between cells, so a Stop button works only while no cell blocks.
* Nothing here raises into the kernel from the thread: an error ends up in a status widget.
"""

from __future__ import annotations

import copy
import dataclasses
import html
import itertools
import os
import re
import threading
import time

import ipywidgets as W
import plotly.graph_objects as go
from IPython.display import Markdown, display
from plotly.subplots import make_subplots

from distlab.models import factory
from distlab.config import PRECISIONS, SCHEDULES, STRATEGIES, RunConfig, declarations
from distlab.config.reads import FEATURE_FIELDS, reads, strategy_knobs
from distlab.lab.common import (MEMORY_CATEGORIES, MEMORY_COLORS, RUN_COLORS, byte_unit,
                                clear_hint, has_hint, md_escape, show_hint)
from distlab.caller.launch import launch
from distlab.parallel import DEGREES, knobs, strategy_class
from distlab.caller.run import Run
from distlab.step_event import bytes_sent, comm, memory

# At most four redraws a second: each redraw sends every trace's data to the browser again
# (plotly 7 has no streaming API), and a faster rate only adds traffic, not information.
POLL_S = 0.25
FLOOR_COLOR = "#555555"
PEAK_COLOR = "#222222"
BOOKED_COLOR = "#a5d8d3"  # what the algorithm books (distlab.comm), lighter ...
WIRE_COLOR = "#0b7285"  # ... than what the kernel saw written (distlab.wire)
LINK_COLOR = "#e8590c"  # a node's link: the slow tier, set apart from the ranks' bars
LINK_NAME = "node's link (interface counter)"
PEAK_NAME = "peak in the step"  # memory["peak"] (RunConfig.track_peak), drawn beside the bars


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
        final = f", final loss {losses[-1]:.3f}" if losses else ""
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


# -- the explorers' base ------------------------------------------------------------------------
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


class ExplorerBusy(RuntimeError):
    """Run was asked for while the explorer's last run is still going."""


class Explorer:
    """What every notebook's explorer widget shares: Run and Stop buttons, a status line, and
    work that never blocks the kernel when Run is clicked.

    A subclass calls `super().__init__()` first (it makes `self.button`, `self.stop_button` and
    `self.status`), lays out `self.widget` with them, and defines two hooks:

    * `_run(**values)`: the work. Set the knobs from `values`, say what runs with
      `self._announce(text)`, launch (passing `on_start=self._started` to launch_together or
      run_ranks; after launch(), call `self._started(run)`), wait, draw the result (the one
      place the figure is drawn), say it with `self._say(html)`, return the result.
    * `_clear()`: the stale result goes at once (its figure emptied, its numbers blanked).

    `run(**values)` does the work and returns its result, blocking: what a notebook cell calls,
    so nbval exercises it. A click on Run clears the stale result at once, does the same work
    in a thread, shows the live run's progress line in the status (Run.progress_line: ranks
    starting, then step k/n, tokens/s and the ETA) and enables Stop, which ends the run
    (Run.stop) and says "stopped". One run at a time: another click meanwhile is refused with
    a message. Errors show in the status: a click handler's exception would only reach the
    kernel's log.

    Threads: the worker and a ticker (at most every TICK_S) only set widget values, which
    ipywidgets sends from any thread; status writes take one lock, so the ticker's progress
    line never lands after the result it precedes. Messages from the browser reach the kernel
    only between cells, so Stop works for a run started by a click, not by a blocking cell.
    """

    TICK_S = 0.5  # the progress line's refresh: the run's events arrive every POLL_S at most

    @property
    def status_text(self) -> str:
        """The status line's words, as printed text (lab.panel.status_text)."""
        return status_text(self.status)

    def __init__(self):
        self.button = W.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop",
                                    disabled=True)
        self.status = W.HTML()
        self.live: Run | None = None  # the run going now (set by _started)
        self.error: BaseException | None = None  # what the last click's work raised
        self._status_lock = threading.RLock()
        self._busy = False
        self._generation = 0  # one ticker per run: an older one exits when this moves on
        self._stop_asked = False
        self._heading = ""  # what runs, said before its progress line
        self._said = False  # the outcome (or a message) is in the status: no progress line
        self._note = ""  # a refused click, said under the progress line
        self._worker: threading.Thread | None = None
        self._launched = threading.Event()  # set once the live run exists (or the work ended)
        self._claimed = 0.0  # when the work was asked for
        self.button.on_click(self._on_run_click)
        self.stop_button.on_click(self._on_stop_click)

    # -- the hooks a subclass defines -----------------------------------------------------------
    def _run(self, **values):
        raise NotImplementedError

    def _clear(self):
        """The stale result goes; a subclass empties its figure too (and calls this)."""
        self._say("starting: the previous result is cleared")

    # -- running -------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether a run (started by a click or a cell) is still going."""
        return self._busy

    def run(self, **values):
        """Do the work with these knob values and return its result, blocking (a cell's way).
        Raises ExplorerBusy while another run is going, and whatever the work raised."""
        self._claim()
        self._clear()
        return self._guarded(values)

    def start(self, **values) -> threading.Thread:
        """What a click on Run does: clear the stale result, then the work in a thread; returns
        the thread at once. Raises ExplorerBusy while another run is going."""
        self._claim()
        self._clear()
        self._worker = threading.Thread(target=self._background, args=(values,), daemon=True,
                                        name=f"distlab-{type(self).__name__}")
        self._worker.start()
        return self._worker

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the work a click (or start) began; True once it has ended."""
        if self._worker is not None:
            self._worker.join(timeout)
        return not self.busy

    def stop(self):
        """End the live run (what Stop does); its work then ends with the status "stopped".
        Asked before the ranks started, the run is stopped as soon as they have."""
        with self._status_lock:
            if not self._busy:
                return
            self._stop_asked = True
            run = self.live
            self.stop_button.disabled = True
            if run is None or not run.done:  # a finished run's result is on its way: keep it
                self.status.value = "stopping: ending every rank"
        if run is not None:
            run.stop()

    def _started(self, run: Run):
        """The live run exists (launch_together's / run_ranks' on_start, or after launch())."""
        with self._status_lock:
            self.live = run
            stop = self._stop_asked
        self._launched.set()
        if stop:  # Stop came while the ranks were starting
            run.stop()

    def _announce(self, text: str):
        """Say what runs (plain text); the progress line follows it while the run goes."""
        with self._status_lock:
            self._heading, self._said = text, False
            self.status.value = html.escape(text)

    def _say(self, html_text: str):
        """Set the status line (HTML): the result, or a message. The progress line stops here:
        it never lands after what it was the progress of."""
        with self._status_lock:
            self._said = True
            self.status.value = html_text

    # -- the machinery ---------------------------------------------------------------------------
    def _claim(self):
        with self._status_lock:
            if self._busy:
                raise ExplorerBusy("one run at a time: the last one is still going "
                                   "(press Stop to end it)")
            self._busy, self._stop_asked, self.live, self.error = True, False, None, None
            self._heading, self._note = "", ""
            self._generation += 1
            self._claimed = time.time()
            self._launched.clear()
            self.stop_button.disabled = False
        threading.Thread(target=self._tick, args=(self._generation,), daemon=True,
                         name=f"distlab-{type(self).__name__}-progress").start()

    def _guarded(self, values: dict):
        """The work, its outcome in the status line, and the explorer idle again after it."""
        try:
            result = self._run(**values)
            if self._stop_asked and self.live is not None and self.live.status == "stopped":
                self._say_stopped()  # launch()'s runs: stopped, yet the work ended normally
            return result
        except BaseException as e:
            if self._stop_asked:
                self._say_stopped()
            elif isinstance(e, KeyboardInterrupt):  # Run.wait stopped the ranks first
                self._say("interrupted: every rank ended")
            else:
                self._say(_error_html("failed", e))
            raise
        finally:
            with self._status_lock:
                self._busy = False
                self.stop_button.disabled = True
            self._launched.set()
            for fig in (getattr(self, "fig", None),
                        getattr(getattr(self, "dashboard", None), "fig", None)):
                keep_for_reload(fig)  # the figure a reload draws: this run's

    def _background(self, values: dict):
        try:
            self._guarded(values)
        except BaseException as e:  # noqa: BLE001 - shown in the status line by _guarded;
            self.error = e  # a thread's exception would vanish into the kernel's log

    def _say_stopped(self):
        run = self.live
        what = self._heading.rstrip(" .…").removeprefix("running ") or "the run"
        after = f" after {len(run.history('step', rank=0))} step(s)" if run is not None else ""
        self._say(html.escape(f"stopped {what}{after}: every rank ended; press Run to start "
                              "again"))

    def _tick(self, generation: int):
        """The live run's progress line under its heading, until the work ends."""
        while True:
            with self._status_lock:
                if generation != self._generation or not self._busy:
                    return
                if self._heading and not (self._said or self._stop_asked):
                    self._show_progress()
            time.sleep(self.TICK_S)

    def _show_progress(self):
        """(Under the status lock.) The heading, the live run's progress line, a refusal."""
        text, run = self._heading.rstrip(" .…"), self.live
        if run is None:  # checks, a fresh fork server (seconds on the first launch)
            line = f"launching... {time.time() - self._claimed:.0f} s"
        else:
            line = run.progress_line(time.time() - run.started).strip()
        text = f"{text}: {line}" if text else line
        note = f"<br><small>{html.escape(self._note)}</small>" if self._note else ""
        self.status.value = html.escape(text) + note

    def _on_run_click(self, _button):
        try:
            self.start()
        except ExplorerBusy as e:  # refused: said under the progress line, which goes on
            with self._status_lock:
                self._note = f"Run refused: {e}"
                if self._heading and not (self._said or self._stop_asked):
                    self._show_progress()
                else:
                    self.status.value += f"<br><small>{html.escape(self._note)}</small>"
        except Exception as e:  # noqa: BLE001 - a click handler's exception is invisible
            self._say(_error_html("not started", e))

    def _on_stop_click(self, _button):
        _stop_in_background(self.stop, self._say)

    def _ipython_display_(self):
        show_live(self.widget)


# -- the dashboard -----------------------------------------------------------------------------
class LiveDashboard:
    """Loss of every watched run (overlaid), and memory and bytes per rank of the latest one.

    `watch(run)` adds a run; `.widget` is what to display. A daemon thread redraws while any
    watched run is still going, draws once more after the last one ends, and exits; watching
    another run starts it again.
    """

    def __init__(self, runs=None, poll_s: float = POLL_S):
        self.runs: list[Run] = []
        self.poll_s = poll_s
        self.listeners = []  # callables run after each redraw (the control panel's progress)
        self.error: BaseException | None = None
        self._lock = threading.RLock()  # one redraw at a time, and `runs` stays consistent
        self._thread: threading.Thread | None = None
        self._loss_traces: dict[int, object] = {}  # id(run) -> its loss trace
        self._floor_traces: dict[float, object] = {}  # loss floor -> its dashed line
        self._names: dict[int, str] = {}  # id(run) -> a label given to watch()
        self.fig = _make_figure()
        self.outlives_cell = False  # the run outlasts its cell: the status says so (LIVE_NOTE)
        self.status = W.HTML()
        self.widget = W.VBox([self.fig, self.status])
        self.widget.add_class("distlab-dashboard")  # lets a browser test find this figure
        for run in runs or ():
            self.watch(run)

    def watch(self, run: Run, label: str | None = None) -> Run:
        """Add a run; `label` names it in the legend and status (default: run_label)."""
        with self._lock:
            if run not in self.runs:
                self.runs.append(run)
                if label is not None:
                    self._names[id(run)] = label
                self._loss_traces[id(run)] = self.fig.add_scatter(
                    x=[], y=[], mode="lines", name=self._label(run, len(self.runs)),
                    line=_run_line(len(self.runs) - 1), row=1, col=1).data[-1]
                units = {loss_axis_title(r.cfg) for r in self.runs}
                self.fig.update_yaxes(title_text=units.pop() if len(units) == 1 else "loss",
                                      row=1, col=1)
            start = self._thread is None and not run.done
            if start:  # decided under the lock, so the thread cannot exit in between
                self._thread = threading.Thread(target=self._poll, daemon=True,
                                                name="distlab-dashboard")
        self.refresh()
        if start:
            self._thread.start()
        return run

    # -- polling (the only code that runs outside the kernel's main thread) -----------------
    def _poll(self):
        try:
            while True:
                with self._lock:
                    # Read `done` before redrawing: a finished run has read all its events, so
                    # this redraw is complete and can be the last.
                    finished = all(r.done for r in self.runs)
                self.refresh()
                with self._lock:
                    if finished and all(r.done for r in self.runs):  # none added meanwhile
                        self._thread = None
                        keep_for_reload(self.fig)
                        return
                time.sleep(self.poll_s)
        except BaseException as e:  # noqa: BLE001 - a thread's exception would vanish or leak
            self.error = e
            with self._lock:
                self._thread = None
            self.status.value = _error_html("the live dashboard stopped updating", e)

    def refresh(self):
        """Redraw from the runs' events now (the thread calls this; so may a cell)."""
        with self._lock:
            labels = {id(r): self._label(r, i + 1) for i, r in enumerate(self.runs)}
            self._draw_losses()
            if self.runs:
                self._draw_ranks(self.runs[-1], labels[id(self.runs[-1])])
            if any(r.steps_done() > 0 for r in self.runs):
                clear_hint(self.fig)
            elif self.runs and has_hint(self.fig):  # still empty: axes with the first step
                show_hint(self.fig, f"starting {labels[id(self.runs[-1])]}: its loss, memory "
                                    "and bytes appear here after its first step")
            self.status.value = "<br>".join(
                f"<b>{html.escape(label)}</b>: {html.escape(where)}"
                for label, where in self._where(labels)) + (
                LIVE_NOTE if self.outlives_cell else "")
            for fn in list(self.listeners):  # under the lock: one thread sets widgets at a time
                fn()

    def status_lines(self) -> list[str]:
        """The status as Markdown lines: each run's label in bold, then where it stands."""
        labels = {id(r): self._label(r, i + 1) for i, r in enumerate(self.runs)}
        return [f"**{md_escape(label)}**: {md_escape(where)}"
                for label, where in self._where(labels)]

    def _where(self, labels: dict) -> list[tuple[str, str]]:
        """(label, where it stands) for each run, in order."""
        return [(labels[id(r)], describe(r, labels[id(r)])) for r in self.runs]

    def _label(self, run: Run, index: int) -> str:
        return self._names.get(id(run)) or run_label(run, index)

    def _draw_losses(self):
        floors = {}
        with self.fig.batch_update():
            for run in self.runs:
                steps, losses = loss_curve(run)
                trace = self._loss_traces[id(run)]
                trace.x, trace.y = steps, losses
                floor = run.info("loss_floor")
                if floor is not None:
                    floors[round(floor, 6)] = max(floors.get(round(floor, 6), 1),
                                                  run.cfg.steps if run.cfg else len(steps))
            for floor, last in floors.items():
                self._floor_trace(floor).update(x=[0, last - 1], y=[floor, floor])

    def _floor_trace(self, floor: float):
        """The dashed line of a loss floor (one per distinct dataset among the runs)."""
        if floor not in self._floor_traces:
            self._floor_traces[floor] = self.fig.add_scatter(
                x=[], y=[], mode="lines", line=dict(dash="dash", color=FLOOR_COLOR, width=1.5),
                name=f"loss floor {floor:.3f} (best achievable)",
                hovertemplate=("loss floor %{y:.4f}: the best achievable loss, the entropy of "
                               "the data<extra></extra>"),
                row=1, col=1).data[-1]
        return self._floor_traces[floor]

    def _draw_ranks(self, run: Run, label: str):
        """Memory by category and bytes sent, per rank, at the latest step all ranks finished."""
        step = run.steps_done() - 1
        events = step_events(run, step) if step >= 0 else []
        memories = [memory(e) for e in events]  # a pipeline's activations too (step_event)
        ranks = [f"rank {e['rank']}" for e in events]
        where = f"{label}, step {step}" if events else f"{label}, no step yet"
        sent = [bytes_sent(e) for e in events]
        wire = [wire_sent(e) for e in events]
        blind = next((e["wire"].get("why") for e in events if wire_sent(e) is None
                      and "wire" in e), None)
        peaks = [m.get("peak") for m in memories]
        has_peak = any(p is not None for p in peaks)
        # One unit per chart (common.byte_unit): the tallest stack or peak; the larger of booked
        # and on the wire.
        mem_scale, mem_unit = byte_unit([sum(m.get(k, 0) for k, _ in MEMORY_CATEGORIES)
                                         for m in memories], peaks)
        links = run.link_bytes_per_step() if hasattr(run, "link_bytes_per_step") else None
        sent_scale, sent_unit = byte_unit(sent, wire + (links or []))
        with self.fig.batch_update():
            for trace, (key, name) in zip(self.fig.data[:len(MEMORY_CATEGORIES)],
                                          MEMORY_CATEGORIES):
                b = [m.get(key, 0) for m in memories]
                trace.update(x=ranks, y=[v / mem_scale for v in b], customdata=b,
                             showlegend=any(b),  # in the legend only what is drawn
                             hovertemplate=_bytes_hover(name, mem_unit))
            comm = self.fig.data[len(MEMORY_CATEGORIES)]
            comm.update(x=ranks, y=[v / sent_scale for v in sent], customdata=sent,
                        hovertext=[_comm_breakdown(e) for e in events], showlegend=any(sent),
                        hovertemplate=_bytes_hover("booked", sent_unit, "<br>%{hovertext}"))
            seen = [w for w in wire if w is not None]
            self.fig.data[len(MEMORY_CATEGORIES) + 2].update(
                x=ranks if seen else [], y=[(w or 0) / sent_scale for w in wire] if seen else [],
                customdata=wire if seen else [], showlegend=any(seen),
                hovertext=[_wire_breakdown(e) for e in events] if seen else [],
                hovertemplate=_bytes_hover("on the wire", sent_unit, "<br>%{hovertext}"))
            nodes = [f"node {i}'s link" for i in range(len(links or []))]
            self.fig.data[len(MEMORY_CATEGORIES) + 3].update(
                x=nodes, y=[b / sent_scale for b in links or []], customdata=links or [],
                showlegend=bool(links),
                hovertemplate=_bytes_hover(LINK_NAME, sent_unit, "<br>mean per step so far"))
            # With track_peak, each rank's peak of aten allocations in the step: a bar stacks
            # what is held at the step's end, the marker what the step needed at its worst.
            self.fig.data[len(MEMORY_CATEGORIES) + 1].update(
                x=ranks if has_peak else [], showlegend=has_peak,
                y=[p / mem_scale if p is not None else None for p in peaks] if has_peak else [],
                customdata=peaks if has_peak else [],
                hovertemplate=_bytes_hover(PEAK_NAME, mem_unit,
                                           "<br>aten allocations; the CPU stand-in for "
                                           "torch.cuda.max_memory_allocated"))
            self.fig.layout.yaxis2.title.text = f"held ({mem_unit})"
            self.fig.layout.yaxis3.title.text = f"sent ({sent_unit})"
            # Which run and step the bars show goes under them: titles above have no room.
            self.fig.layout.xaxis2.title.text = where
            self.fig.layout.xaxis3.title.text = _bytes_title(run, label, where, events, blind)

    def __repr__(self):
        return f"LiveDashboard({len(self.runs)} runs)"


def _make_figure() -> go.FigureWidget:
    """Three charts, one above the other, each with its legend beside it (plotly's several
    legends): the loss of every run on top, memory and bytes per rank of the latest run
    underneath. Side by side, the lower two would share one legend column at the right, the
    memory categories beside the bytes chart."""
    fig = make_subplots(
        rows=3, cols=1, row_heights=[0.44, 0.28, 0.28], vertical_spacing=0.125,
        subplot_titles=("loss per step (mean over ranks)",
                        "memory per rank: bytes by category (the step's peak: track_peak)",
                        "bytes sent per rank in one step"))
    fig = go.FigureWidget(fig)
    for (key, name), color in zip(MEMORY_CATEGORIES, MEMORY_COLORS):
        fig.add_bar(x=[], y=[], name=name, legend="legend2", marker_color=color,
                    offsetgroup="held", row=2, col=1)
    fig.add_bar(x=[], y=[], name="booked", legend="legend3", marker_color=BOOKED_COLOR,
                offsetgroup="booked", row=3, col=1)
    # The peak (RunConfig.track_peak) as its own bar beside each rank's stack: bars of another
    # offsetgroup sit side by side with the stacked ones instead of stacking on them.
    fig.add_bar(x=[], y=[], name=PEAK_NAME, legend="legend2", showlegend=False,
                offsetgroup="peak", marker=dict(color="rgba(0,0,0,0)",
                                                line=dict(width=2.5, color=PEAK_COLOR)),
                row=2, col=1)
    # Beside each rank's booked bytes, what the kernel saw it write (distlab.wire).
    fig.add_bar(x=[], y=[], name="on the wire", legend="legend3", marker_color=WIRE_COLOR,
                offsetgroup="wire", row=3, col=1)
    # Across simulated nodes: what each node's link carried per step (its interface's counter).
    fig.add_bar(x=[], y=[], name=LINK_NAME, legend="legend3", marker_color=LINK_COLOR,
                offsetgroup="wire", row=3, col=1)
    # Each legend right of its own chart, at the chart's top (plotly >= 5.15: legend2, ...).
    tops = [fig.layout[f"yaxis{i or ''}"].domain[1] for i in ("", 2, 3)]
    legends = {name: dict(font=dict(size=11), x=1.02, xanchor="left", y=top, yanchor="top",
                          # "normal": stacked bars would otherwise list bottom-up
                          traceorder="normal")
               for name, top in zip(("legend", "legend2", "legend3"), tops)}
    fig.update_layout(barmode="stack", height=800, width=960, template="plotly_white",
                      margin=dict(l=70, r=20, t=40, b=50), **legends)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_yaxes(title_text="loss (nats/token)", row=1, col=1)
    fig.update_yaxes(rangemode="nonnegative", row=2)  # bytes are never negative, even when 0
    fig.update_yaxes(rangemode="nonnegative", row=3)
    show_hint(fig, EMPTY_HINT)
    return fig


EMPTY_HINT = "press Run: the loss, memory per rank and bytes per rank appear here"


def loss_axis_title(cfg) -> str:
    """What the loss is a mean over: the GPT's tokens, bnnet's samples; a model of your own
    says nothing about it (10's classifier was labelled nats/token, issue 25)."""
    model = getattr(cfg, "model", "gpt")
    return {"gpt": "loss (nats/token)", "bnnet": "loss (nats/sample)"}.get(model, "loss")


def _bytes_hover(name: str, unit: str, extra: str = "") -> str:
    return f"{name}: %{{y:.3f}} {unit} (%{{customdata:,}} bytes){extra}<extra></extra>"


def _run_line(i: int) -> dict:
    """Later runs draw thinner lines, so a run that retraces an earlier one (the point of most
    comparisons here) shows as a thin line inside a thick one instead of hiding it."""
    return dict(color=RUN_COLORS[i % len(RUN_COLORS)], width=max(1.5, 4.0 - 1.25 * i))


def _wire_breakdown(event: dict) -> str:
    by_kind = event.get("wire", {}).get("by_kind") or {}
    return "<br>".join(f"{k}: {v:,} B" for k, v in by_kind.items()) or "nothing written"


def _comm_breakdown(event: dict) -> str:
    parts = [f"{k}: {v['calls']} calls, {v['bytes_sent']:,} B"
             for k, v in comm(event).items() if v["calls"]]
    return "<br>".join(parts) or "no collectives"


def _bytes_title(run: Run, label: str, where: str, events: list[dict], blind: str | None) -> str:
    """Under the bytes chart: which run and step, and why a bar may be missing. "One process"
    only where the run has one (single, dp's threads), not wherever no byte was booked."""
    unseen = f"; on the wire: not seen ({blind})" if blind else ""
    if events and not any(bytes_sent(e) or wire_sent(e) for e in events):
        if run.cfg is not None and run.cfg.processes == 1:
            return f"{label} sent nothing: one process"
        return f"{where}: nothing booked{unseen}"
    return where + unseen


def _plotly_bundle(fig: go.Figure) -> dict:
    """fig as a mime bundle, to update a display in place. display(fig) would not do: a
    plotly figure displays itself (_ipython_display_), as a new output, whatever display_id
    it is given. The notebook's renderers make the bundle; plotly's own mimetype if none is
    set (outside Jupyter)."""
    return fig._repr_mimebundle_() or {"application/vnd.plotly.v1+json": fig.to_plotly_json(),
                                       "text/plain": f"<{len(fig.data)} traces>"}


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


# -- showing a run from a cell -------------------------------------------------------------------
def dashboard_for(*runs: Run) -> LiveDashboard:
    """A dashboard watching these runs; display its `.widget` yourself."""
    return LiveDashboard(runs)


def watch(*runs: Run, dashboard: LiveDashboard | None = None) -> LiveDashboard:
    """Show a live dashboard of these runs under the current cell and return it.

    Call it from a cell (it displays, so it must run on the main thread): `run = launch(cfg);
    dash = lab.watch(run); run.wait()`."""
    dash = dashboard or LiveDashboard()
    for run in runs:
        dash.watch(run)
    handle = display(dash.widget, display_id=True)
    _leave_static_copy(dash, handle)
    return dash


def _leave_static_copy(dash: LiveDashboard, handle):
    """When the cell that showed the dashboard ends with its runs over (`run.wait()` in the
    same cell), put a static copy in the live figure's place: the last redraw as a plain plotly
    figure (the notebook's plotly output, which JupyterLab draws again from the saved notebook)
    and the status lines as Markdown. A live FigureWidget lives in the kernel: after a reload
    or a kernel restart it comes back as "Error displaying widget: model not found". A run
    still going when the cell ends keeps the live figure (the status says so)."""
    from IPython import get_ipython
    shell = get_ipython()
    if shell is None or handle is None:  # not in IPython: nothing to keep
        return

    def at_cell_end(_result=None):
        shell.events.unregister("post_run_cell", at_cell_end)
        if not dash.runs or not all(r.done for r in dash.runs):
            dash.outlives_cell = True
            dash.refresh()
            return
        thread = dash._thread
        if thread is not None:  # its last redraw: let it finish, then draw once more here
            thread.join(timeout=5 * dash.poll_s + 5)
        dash.refresh()
        handle.update(_plotly_bundle(go.Figure(dash.fig)), raw=True)
        display(Markdown("  \n".join(dash.status_lines())))

    shell.events.register("post_run_cell", at_cell_end)



# -- the control panel ---------------------------------------------------------------------------
# Which knobs a strategy reads is the registry's to say (distlab.config.reads: each class's
# knobs, degrees and supports); which widget a field has, its declaration's (distlab.config:
# Declared.widget). Its strategy knobs: every knob, the degrees tp and pp, and the features
# whose field has a widget, those that shape the parallelism itself (the others, LoRA, EWC, a
# finite dataset, belong to their notebooks).
PANEL_FEATURES = tuple(f for f in FEATURE_FIELDS.values() if declarations()[f].widget)
# Knobs whose options are narrowed to what RunConfig accepts, in this order: each is fitted with
# the earlier ones fixed and the later ones free ("layout" is tp and pp together, from
# Strategy.layouts). Changing one may move a later one (1f1b at pp=4 raises micro-batches to 4).
FITTED = ("layout", "schedule", "microbatches", "virtual_stages", "param_dtype")
MICROBATCHES = declarations()["microbatches"].widget.offer
VIRTUAL_STAGES = declarations()["virtual_stages"].widget.offer


class ControlPanel:
    """Knobs for a RunConfig, Run and Stop buttons, progress, status and a live dashboard.

    `ControlPanel(steps=50, n_layer=2)` sets the defaults: any RunConfig field; those without a
    widget are passed through unchanged. `extra_widgets={"successors": W.IntSlider(...)}` adds
    knobs: a key names the RunConfig field the widget's value goes to (a built-in knob of that
    name is replaced).

    Only what runs is offered. The knobs a strategy does not read (distlab.config.reads) are
    hidden and left at RunConfig's defaults; tp and pp offer the strategy's layouts at the world
    size (Strategy.layouts); the schedule, micro-batches, virtual stages and ZeRO-3's parameter
    dtype offer the values RunConfig accepts with the other knobs as they are (a knob with one
    value left is disabled, its tooltip says why). Whatever RunConfig still refuses (a global
    batch the workers cannot split) is shown in the status line and Run is disabled until a knob
    changes; launch()'s own checks (distlab.caller.preflight) are shown there when Run is pressed.
    """

    @property
    def status_text(self) -> str:
        """The status line's words, as printed text (lab.panel.status_text). Once the last run
        has ended, redrawn first: the dashboard thread's last redraw may not have come yet, and
        a cell printing this right after run.wait() read "running ... step 70/80" (issue 25)."""
        if self.last_run is not None and self.last_run.done:
            self.dashboard.refresh()
        return status_text(self.status)

    def __init__(self, dashboard: LiveDashboard | None = None, extra_widgets: dict | None = None,
                 **defaults):
        self.base = RunConfig(**defaults)  # bad defaults fail here, with RunConfig's message
        if factory.is_spec(self.base.model):  # a model of your own: import it, one forward
            factory.check(self.base)
        self.dashboard = dashboard or LiveDashboard()
        self.runs: list[Run] = []
        self.last_run: Run | None = None
        self.valid = True  # whether the knobs describe a config RunConfig accepts
        self._syncing = False
        self.knobs: dict[str, W.Widget] = {}
        self._own: set[str] = set()  # knobs this panel built (their options are its to set)
        self.run_button = W.Button(description="Run", button_style="success", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop",
                                    disabled=True)
        self.progress = W.IntProgress(value=0, min=0, max=self.base.steps, description="steps")
        self.status = W.HTML("ready: pick the knobs and press Run")
        self.details = W.HTML()  # a failing rank's traceback
        self.controls = W.HBox([], layout=W.Layout(flex_flow="row wrap"))
        for name, widget in _make_knobs(self.base).items():
            self.add_knob(name, widget, _own=True)
        for name, widget in (extra_widgets or {}).items():
            self.add_knob(name, widget)
        self.run_button.on_click(self._on_run_click)
        self.stop_button.on_click(self._on_stop_click)
        self.dashboard.listeners.append(self._show_progress)
        self._sync(None)
        self.widget = W.VBox([
            self.controls, W.HBox([self.run_button, self.stop_button, self.progress]),
            self.status, self.details, self.dashboard.widget])
        self.widget.add_class("distlab-panel")

    def add_knob(self, name: str, widget: W.Widget, _own: bool = False):
        """Add a widget whose value goes to RunConfig field `name` (replacing the panel's own
        knob of that name, if any)."""
        if name not in self.base.to_dict():
            raise ValueError(f"{name!r} is not a RunConfig field")
        self.knobs[name] = widget
        (self._own.add if _own else self._own.discard)(name)
        widget.observe(lambda change, n=name: self._on_change(n, change), names="value")
        self.controls.children = tuple(self.knobs.values())
        if hasattr(self, "widget"):  # built: show the new knob under the strategy's rules
            self._sync(name)

    # -- building and starting runs ------------------------------------------------------------
    def config(self, **overrides) -> RunConfig:
        """The RunConfig the knobs describe now (overrides win). Raises ValueError if invalid."""
        values = {**self._values(), **overrides}
        return RunConfig.from_dict(values)

    def shown(self) -> list[str]:
        """The knobs on display now: every general one, and the strategy knobs it reads."""
        return [n for n, w in self.knobs.items() if w.layout.display != "none"]

    def _values(self) -> dict:
        """RunConfig fields from the knobs: those the chosen strategy reads from their widgets;
        a strategy knob it does not read at RunConfig's default (as RunConfig.replace does)."""
        strategy = self.knobs["strategy"].value
        values = self.base.to_dict()
        for name in strategy_knobs():
            if not reads(strategy, name) and (name in self.knobs or name in knobs()
                                               or name in DEGREES):
                values[name] = _DEFAULTS[name]
        for name, widget in self.knobs.items():
            if name not in strategy_knobs() or reads(strategy, name):
                values[name] = widget.value
        values["lr"] = float(f"{values['lr']:.3g}")  # undo the slider's snapping (see _make_knobs)
        return values

    def run(self, **overrides) -> Run:
        """Start a run of the knobs' config (with overrides) without blocking; returns it."""
        if self.last_run is not None and not self.last_run.done:
            raise RuntimeError("the last run is still going: wait for it or press Stop")
        cfg = self.config(**overrides)
        run = launch(cfg)  # distlab.caller.preflight's checks first: a ValueError starts nothing
        self.runs.append(run)
        self.last_run = run
        self.progress.max, self.progress.value, self.progress.bar_style = cfg.steps, 0, ""
        self.run_button.disabled, self.stop_button.disabled = True, False
        self.details.value = ""
        self.status.value = html.escape(f"starting {run_label(run)}: spawning "
                                        f"{cfg.processes} process(es)")
        self.dashboard.watch(run)  # its thread now drives _show_progress
        return run

    def _on_run_click(self, _button):
        # Runs in the kernel's main thread when the click arrives; returns at once because
        # launch() does not wait. Exceptions from a widget callback go to a log the reader never
        # sees, so every one is shown in the status line instead.
        try:
            self.run()
        except Exception as e:  # noqa: BLE001
            self.status.value = _error_html("not started", e)

    def _on_stop_click(self, _button):
        run = self.last_run
        if run is None or run.done:
            return
        self.stop_button.disabled = True
        self.status.value = "stopping: ending every rank"
        _stop_in_background(run.stop, lambda line: setattr(self.status, "value", line))

    # -- keeping knobs consistent ----------------------------------------------------------------
    def _on_change(self, name: str, change):
        if self._syncing:  # the panel's own updates, not the user's
            return
        note = ""
        strategy, world = self.knobs["strategy"], self.knobs["world_size"]
        # 'single' is one process by definition: more ranks means a parallel strategy, and
        # picking 'single' means one rank.
        if name == "world_size" and change["new"] > 1 and strategy.value == "single":
            parallel = next(s for s in strategy.options if s != "single")
            strategy.value = parallel  # fits the knobs to it (this observer, called again)
            note = f"strategy set to '{parallel}': 'single' runs exactly one process"
        if name == "strategy" and change["new"] == "single" and world.value != 1:
            world.value = 1
            note = "world size set to 1: 'single' runs exactly one process"
        self._sync(name, note)

    def _sync(self, changed: str | None, note: str = ""):
        """Show the knobs the strategy reads, fit the fitted ones, check the whole config."""
        self._syncing = True
        try:
            strategy = self.knobs["strategy"].value
            for name, widget in self.knobs.items():
                read = name not in strategy_knobs() or reads(strategy, name)
                widget.layout.display = None if read else "none"
            if "link_mbit" in self.knobs and "nodes" in self.knobs:  # a link only between nodes
                one = self.knobs["nodes"].value == 1
                self.knobs["link_mbit"].layout.display = "none" if one else None
            self._fit(changed)
        finally:
            self._syncing = False
        self._validate(note)

    def _fit(self, changed: str | None):
        values = self._values()
        order = [k for k in FITTED if self._fitted(k)]
        moved_pp = False
        for i, k in enumerate(order):
            options = self._options(k, values)
            if not options:  # a knob of someone else's offers none of them: RunConfig says why
                continue
            later = [self._options(d, values) for d in order[i + 1:]]
            verdicts = [(o, _refusal({**values, **o}, later)) for o in options]
            ok = [o for o, why in verdicts if why is None] or options  # none: say why below
            pick = self._pick(k, ok, values, changed, moved_pp)
            moved_pp |= "pp" in pick and pick["pp"] != values["pp"]
            values.update(pick)
            refused = next((why for _, why in verdicts if why is not None), None)
            self._show(k, options, ok, pick, refused)

    def _fitted(self, k: str) -> bool:
        strategy = self.knobs["strategy"].value
        names = DEGREES if k == "layout" else (k,)
        return any(reads(strategy, n) and n in self.knobs for n in names)

    def _options(self, k: str, values: dict) -> list[dict]:
        """The values knob k may take, as RunConfig fields: tp and pp from the strategy's
        layouts at this world size, the others from the panel's lists."""
        if k == "layout":
            layouts = strategy_class(values["strategy"]).layouts(values["world_size"])
            return [d for d in layouts if all(self._can_show(n, d[n]) for n in DEGREES)]
        base = {"schedule": SCHEDULES, "param_dtype": PRECISIONS,
                "microbatches": sorted({*MICROBATCHES, self.base.microbatches}),
                "virtual_stages": sorted({*VIRTUAL_STAGES, self.base.virtual_stages})}[k]
        return [{k: v} for v in base if self._can_show(k, v)]

    def _can_show(self, name: str, value) -> bool:
        """A knob someone else built (extra_widgets) keeps its own options."""
        widget = self.knobs.get(name)
        return (widget is None or name in self._own or not hasattr(widget, "options")
                or value in _option_values(widget))

    def _pick(self, k, ok, values, changed, moved_pp) -> dict:
        current = ({n: values[n] for n in DEGREES} if k == "layout" else {k: values[k]})
        if k == "layout" and changed in ("strategy", "world_size"):
            return ok[0]  # the strategy's preferred layout at this world size
        if k == "layout" and current not in ok:  # keep the degree just picked, move the other
            lead = "pp" if changed == "pp" else "tp"
            return next((o for o in ok if o[lead] == current[lead]), ok[0])
        if k == "microbatches":  # a pipeline of p stages gets at least p micro-batches
            want = max(values["microbatches"], values["pp"]) if moved_pp else current[k]
            return next((o for o in ok if o[k] >= want), ok[-1])
        return current if current in ok else ok[0]

    def _show(self, k, options, ok, pick, refused):
        names = DEGREES if k == "layout" else (k,)
        for n in names:
            widget = self.knobs.get(n)
            if widget is None:
                continue
            if n in self._own:  # pp: the layouts with the tp picked
                values = sorted({o[n] for o in ok if n != "pp" or o["tp"] == pick["tp"]})
                if tuple(_option_values(widget)) != tuple(values):
                    widget.options = values
                widget.disabled = len(values) == 1
                widget.tooltip = _why_not(k, refused, self.knobs, widget.disabled)
            if not hasattr(widget, "options") or pick[n] in _option_values(widget):
                widget.value = pick[n]

    def _validate(self, note: str = ""):
        """RunConfig's verdict on the knobs, in the status line; Run only when it accepts."""
        try:
            cfg = self.config()
        except ValueError as e:
            self.valid = False
            self.status.value = _error_html("cannot run", e)
        else:
            self.valid = True
            self.status.value = html.escape(
                f"{note + '; ' if note else ''}ready: {cfg.strategy} on {cfg.world_size} "
                f"rank(s), {cfg.processes} process(es); press Run")
        going = self.last_run is not None and not self.last_run.done
        self.run_button.disabled = going or not self.valid

    # -- progress (called from the dashboard's thread) ------------------------------------------
    def _show_progress(self):
        run = self.last_run
        if run is None:
            return
        done = run.done  # before reading steps: a finished run has all its events
        self.progress.value = min(run.steps_done(), self.progress.max)
        self.status.value = html.escape(describe(run, run_label(run)))
        if not done:
            return
        self.run_button.disabled, self.stop_button.disabled = not self.valid, True
        self.progress.bar_style = {"done": "success", "failed": "danger"}.get(run.status, "warning")
        if run.status == "failed" and run.error is not None:
            self.status.value = f"<span style='color:#c00'>{self.status.value}</span>"
            self.details.value = (f"<b>traceback of rank {run.error.rank}</b><pre>"
                                  f"{html.escape(run.error.traceback or '(none recorded)')}</pre>")

    def _ipython_display_(self):
        show_live(self.widget)

    def __repr__(self):
        return f"ControlPanel({len(self.runs)} runs)"


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)}


def _refusal(values: dict, later: list[list[dict]]) -> str | None:
    """None if some choice of the later knobs' options makes `values` a config RunConfig
    accepts (tried with the current choices first), else its message for the current ones."""
    first = None
    for combo in itertools.product(*[lst or [{}] for lst in later]):
        try:
            RunConfig.from_dict({**values, **{k: v for o in combo for k, v in o.items()}})
            return None
        except ValueError as e:
            first = first or str(e)
    return first


def _why_not(k: str, refused: str | None, knobs: dict, disabled: bool) -> str:
    """A fitted knob's tooltip: why values are missing or it cannot be changed."""
    if refused:
        return f"not offered: {refused}"
    if disabled and k == "layout":
        strategy, world = knobs["strategy"].value, knobs["world_size"].value
        return f"the only layout of {strategy!r} at world size {world} (Strategy.layouts)"
    return ""


def _option_values(widget) -> list:
    """A selection widget's values (options may be labels or (label, value) pairs)."""
    return [o[1] if isinstance(o, tuple) else o for o in widget.options]


def strategies_for(cfg: RunConfig) -> tuple[str, ...]:
    """The strategies that can run cfg's model: all of them for distlab's GPT; for a model of
    your own (RunConfig.model="package.module:function") those that do not reach into the GPT's
    layers (Strategy.any_model)."""
    if not factory.is_spec(cfg.model):
        return STRATEGIES
    return tuple(s for s in STRATEGIES if strategy_class(s).any_model)


def _make_knobs(cfg: RunConfig) -> dict:
    """One widget per RunConfig field that declares one (Declared.widget), keyed by the field's
    name: the general ones first, then every strategy knob (shown only under the strategies
    that read it), each in RunConfig's order."""
    made = {name: _widget(d.widget, name, d, cfg) for name, d in declarations().items()
            if d.widget is not None}
    general = [n for n in made if n not in strategy_knobs()]
    return {n: made[n] for n in general + [n for n in made if n not in general]}


def _widget(w, name: str, d, cfg: RunConfig) -> W.Widget:
    value, style = getattr(cfg, name), {"description_width": "initial"}
    if w.kind == "check":
        return W.Checkbox(value=value, description=w.label, indent=False)
    if w.kind == "text":
        return W.Text(value=value, description=w.label, placeholder=w.hint, style=style)
    if w.kind == "log":
        # The browser snaps a slider's value to its step and sends it back, so a coarse step
        # would silently change the default (3e-3 became 10**-2.5); 1e-4 of a decade moves a
        # value by at most 0.012%, which config() then rounds away.
        return W.FloatLogSlider(value=value, base=10, min=w.low, max=w.high, step=w.step,
                                readout_format=".2e", description=w.label, style=style)
    if w.kind in ("int", "float"):  # each its own Layout: _sync hides them apart
        box = W.BoundedIntText if w.kind == "int" else W.BoundedFloatText
        step = {} if w.step is None else {"step": w.step}
        return box(value=value, min=w.low, max=w.high, description=w.label, style=style,
                   layout=W.Layout(width="190px"), **step)
    # a menu: the panel's offer (with the value it starts at), else the field's choices (the
    # strategies that can run cfg's model), else the value alone (tp and pp: the panel fits
    # them to the strategy's layouts)
    if name == "strategy":
        options = list(strategies_for(cfg))
    elif w.offer:
        options = sorted({*w.offer, value})
    else:
        options = list(d.options() or [value])
    labels = dict(w.labels)
    if labels:
        options = [(labels.get(o, o), o) for o in options]
    return W.Dropdown(options=options, value=value, description=w.label, style=style)
