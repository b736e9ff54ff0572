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

import html
import os
import threading
import time

import ipywidgets as W
import plotly.graph_objects as go
from IPython.display import display
from plotly.subplots import make_subplots

from distlab import factory
from distlab.config import ALLREDUCE_ALGORITHMS, PRECISIONS, STRATEGIES, RunConfig
from distlab.lab.common import MEMORY_CATEGORIES, MEMORY_COLORS, MiB, RUN_COLORS
from distlab.launch import launch
from distlab.run import Run

# At most four redraws a second: each redraw sends every trace's data to the browser again
# (plotly 7 has no streaming API), and a faster rate only adds traffic, not information.
POLL_S = 0.25
WORLD_SIZES = (1, 2, 4)
FLOOR_COLOR = "#555555"
PEAK_COLOR = "#222222"
BOOKED_COLOR = "#a5d8d3"  # what the algorithm books (distlab.comm), lighter ...
WIRE_COLOR = "#0b7285"  # ... than what the kernel saw written (distlab.wire)
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


def bytes_sent(event: dict) -> int:
    """Bytes one rank's collectives booked in one step (distlab.comm's formulas and counts),
    summed over the kinds it used, the mesh groups' included."""
    groups = [event.get("comm", {}), *event.get("mesh", {}).get("comm", {}).values()]
    return sum(c["bytes_sent"] for g in groups for c in g.values())


def wire_sent(event: dict) -> int | None:
    """Bytes the kernel saw one rank write to the network in one step (distlab.wire), None
    where it cannot see them (NCCL, no /proc)."""
    return event.get("wire", {}).get("sent")


def describe(run: Run, label: str) -> str:
    """One line of plain text on where a run stands (escaped later for HTML)."""
    steps = run.cfg.steps if run.cfg else "?"
    _, losses = loss_curve(run)
    loss = f", loss {losses[-1]:.3f}" if losses else ""
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


# -- the dashboard -----------------------------------------------------------------------------
class Explorer:
    """What every notebook's explorer widget shares. A subclass builds `self.widget` (with a
    Run button whose click calls `_safe_run`) and `self.status` (a W.HTML line), and defines
    `run(**values)`, which notebooks also call directly so nbval exercises it."""

    def _safe_run(self):
        try:
            self.run()
        except Exception as e:  # noqa: BLE001 - shown in the status line: an exception raised
            # in a click handler would only reach the kernel's log, not the user
            self.status.value = (f"<b style='color:#c00'>{html.escape(type(e).__name__)}</b>: "
                                 f"{html.escape(str(e))}")

    def _ipython_display_(self):
        display(self.widget)


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
            self.status.value = "<br>".join(
                f"<b>{html.escape(labels[id(r)])}</b>: {html.escape(describe(r, labels[id(r)]))}"
                for r in self.runs)
            for fn in list(self.listeners):  # under the lock: one thread sets widgets at a time
                fn()

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
                name=f"loss floor {floor:.3f}: best achievable (entropy of the data)",
                hovertemplate="best achievable loss: %{y:.4f}<extra></extra>",
                row=1, col=1).data[-1]
        return self._floor_traces[floor]

    def _draw_ranks(self, run: Run, label: str):
        """Memory by category and bytes sent, per rank, at the latest step all ranks finished."""
        step = run.steps_done() - 1
        events = step_events(run, step) if step >= 0 else []
        ranks = [f"rank {e['rank']}" for e in events]
        where = f"{label}, step {step}" if events else f"{label}, no step yet"
        sent = [bytes_sent(e) for e in events]
        wire = [wire_sent(e) for e in events]
        blind = next((e["wire"].get("why") for e in events if wire_sent(e) is None
                      and "wire" in e), None)
        with self.fig.batch_update():
            for trace, (key, _) in zip(self.fig.data[:len(MEMORY_CATEGORIES)], MEMORY_CATEGORIES):
                b = [e["memory"].get(key, 0) for e in events]
                trace.update(x=ranks, y=[v / MiB for v in b], customdata=b)
            comm = self.fig.data[len(MEMORY_CATEGORIES)]
            comm.update(x=ranks, y=[v / MiB for v in sent], customdata=sent,
                        hovertext=[_comm_breakdown(e) for e in events])
            seen = [w for w in wire if w is not None]
            self.fig.data[len(MEMORY_CATEGORIES) + 2].update(
                x=ranks if seen else [], y=[(w or 0) / MiB for w in wire] if seen else [],
                customdata=wire if seen else [],
                hovertext=[_wire_breakdown(e) for e in events] if seen else [])
            # With track_peak, each rank's peak of aten allocations in the step: a bar stacks
            # what is held at the step's end, the marker what the step needed at its worst.
            peaks = [e["memory"].get("peak") for e in events]
            has_peak = any(p is not None for p in peaks)
            self.fig.data[len(MEMORY_CATEGORIES) + 1].update(
                x=ranks if has_peak else [], showlegend=has_peak,
                y=[p / MiB if p is not None else None for p in peaks] if has_peak else [],
                customdata=peaks if has_peak else [])
            # Which run and step the bars show goes under them: titles above have no room.
            self.fig.layout.xaxis2.title.text = where
            self.fig.layout.xaxis3.title.text = (
                (where if not blind else f"{where}; on the wire: not seen ({blind})")
                if any(sent) or any(seen) or not events else
                f"{label} sent nothing: one process")

    def __repr__(self):
        return f"LiveDashboard({len(self.runs)} runs)"


def _make_figure() -> go.FigureWidget:
    """Loss on top (all runs); memory and bytes per rank of the latest run underneath."""
    fig = make_subplots(
        rows=2, cols=2, specs=[[{"colspan": 2}, None], [{}, {}]],
        row_heights=[0.55, 0.45], vertical_spacing=0.16, horizontal_spacing=0.12,
        subplot_titles=("loss per step (mean over ranks)", "memory per rank by category",
                        "bytes sent per rank in one step"))
    fig = go.FigureWidget(fig)
    for (key, name), color in zip(MEMORY_CATEGORIES, MEMORY_COLORS):
        fig.add_bar(x=[], y=[], name=name, legend="legend2", marker_color=color,
                    offsetgroup="held",
                    hovertemplate=f"{name}: %{{y:.3f}} MiB (%{{customdata:,}} bytes)<extra></extra>",
                    row=2, col=1)
    fig.add_bar(x=[], y=[], name="booked", legend="legend3", marker_color=BOOKED_COLOR,
                offsetgroup="booked",
                hovertemplate="booked: %{customdata:,} bytes<br>%{hovertext}<extra></extra>",
                row=2, col=2)
    # The peak (RunConfig.track_peak) as its own bar beside each rank's stack: bars of another
    # offsetgroup sit side by side with the stacked ones instead of stacking on them.
    fig.add_bar(x=[], y=[], name=PEAK_NAME, legend="legend2", showlegend=False,
                offsetgroup="peak", marker=dict(color="rgba(0,0,0,0)",
                                                line=dict(width=2.5, color=PEAK_COLOR)),
                hovertemplate=("peak in the step: %{y:.3f} MiB (%{customdata:,} bytes)<br>"
                               "aten allocations; the CPU stand-in for "
                               "torch.cuda.max_memory_allocated<extra></extra>"),
                row=2, col=1)
    # Beside each rank's booked bytes, what the kernel saw it write (distlab.wire).
    fig.add_bar(x=[], y=[], name="on the wire", legend="legend3", marker_color=WIRE_COLOR,
                offsetgroup="wire",
                hovertemplate="on the wire: %{customdata:,} bytes<br>%{hovertext}<extra></extra>",
                row=2, col=2)
    # Two legends: runs beside the loss plot, memory categories beside the memory bars.
    fig.update_layout(barmode="stack", height=640, width=960, margin=dict(l=60, r=20, t=40, b=50),
                      template="plotly_white",
                      # "normal": stacked bars would otherwise reverse this legend too
                      legend=dict(font=dict(size=11), y=1.0, yanchor="top", traceorder="normal"),
                      legend2=dict(font=dict(size=11), y=0.0, yanchor="bottom",
                                   traceorder="reversed"),
                      # bytes: booked vs on the wire, right of the bytes chart, at its top
                      legend3=dict(font=dict(size=11), x=1.02, xanchor="left", y=0.44,
                                   yanchor="top", title=dict(text="bytes"), traceorder="normal"))
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_yaxes(title_text="loss (nats/token)", row=1, col=1)
    fig.update_yaxes(title_text="MiB", row=2, col=1)
    fig.update_yaxes(title_text="MiB sent", row=2, col=2)
    fig.update_yaxes(rangemode="nonnegative", row=2)  # bytes are never negative, even when 0
    return fig


def _run_line(i: int) -> dict:
    """Later runs draw thinner lines, so a run that retraces an earlier one (the point of most
    comparisons here) shows as a thin line inside a thick one instead of hiding it."""
    return dict(color=RUN_COLORS[i % len(RUN_COLORS)], width=max(1.5, 4.0 - 1.25 * i))


def _wire_breakdown(event: dict) -> str:
    by_kind = event.get("wire", {}).get("by_kind") or {}
    return "<br>".join(f"{k}: {v:,} B" for k, v in by_kind.items()) or "nothing written"


def _comm_breakdown(event: dict) -> str:
    groups = {"": event.get("comm", {}),
              **{f"{g}.": c for g, c in event.get("mesh", {}).get("comm", {}).items()}}
    parts = [f"{g}{k}: {v['calls']} calls, {v['bytes_sent']:,} B"
             for g, kinds in groups.items() for k, v in kinds.items() if v["calls"]]
    return "<br>".join(parts) or "no collectives"


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
    display(dash.widget)
    return dash


show_run = watch


# -- the control panel ---------------------------------------------------------------------------
class ControlPanel:
    """Knobs for a RunConfig, Run and Stop buttons, progress, status and a live dashboard.

    `ControlPanel(steps=50, n_layer=2)` sets the defaults: any RunConfig field; those without a
    widget are passed through unchanged. `extra_widgets={"successors": W.IntSlider(...)}` adds
    knobs: a key names the RunConfig field the widget's value goes to.
    """

    def __init__(self, dashboard: LiveDashboard | None = None, extra_widgets: dict | None = None,
                 **defaults):
        self.base = RunConfig(**defaults)  # bad defaults fail here, with RunConfig's message
        if factory.is_spec(self.base.model):  # a model of your own: import it, one forward
            factory.check(self.base)
        self.dashboard = dashboard or LiveDashboard()
        self.runs: list[Run] = []
        self.last_run: Run | None = None
        self.knobs = _make_knobs(self.base)
        for name, widget in (extra_widgets or {}).items():
            self.add_knob(name, widget)
        self.run_button = W.Button(description="Run", button_style="success", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop",
                                    disabled=True)
        self.progress = W.IntProgress(value=0, min=0, max=self.base.steps, description="steps")
        self.status = W.HTML("ready: pick the knobs and press Run")
        self.details = W.HTML()  # a failing rank's traceback
        self.run_button.on_click(self._on_run_click)
        self.stop_button.on_click(self._on_stop_click)
        self.knobs["world_size"].observe(self._on_world_size, names="value")
        self.knobs["strategy"].observe(self._on_strategy, names="value")
        self._on_strategy({"new": self.knobs["strategy"].value})
        self.dashboard.listeners.append(self._show_progress)
        self.controls = W.HBox([], layout=W.Layout(flex_flow="row wrap"))
        self._layout_controls()
        self.widget = W.VBox([
            self.controls, W.HBox([self.run_button, self.stop_button, self.progress]),
            self.status, self.details, self.dashboard.widget])
        self.widget.add_class("distlab-panel")

    def add_knob(self, name: str, widget: W.Widget):
        """Add a widget whose value goes to RunConfig field `name`."""
        if name not in self.base.to_dict():
            raise ValueError(f"{name!r} is not a RunConfig field")
        self.knobs[name] = widget
        if hasattr(self, "controls"):
            self._layout_controls()

    def _layout_controls(self):
        self.controls.children = tuple(self.knobs.values())

    # -- building and starting runs ------------------------------------------------------------
    def config(self, **overrides) -> RunConfig:
        """The RunConfig the knobs describe now (overrides win). Raises ValueError if invalid."""
        values = self.base.to_dict()
        for name, widget in self.knobs.items():
            if not getattr(widget, "disabled", False):  # a knob this strategy does not read
                values[name] = widget.value
        values["lr"] = float(f"{values['lr']:.3g}")  # undo the slider's snapping (see _make_knobs)
        values.update(overrides)
        return RunConfig.from_dict(values)

    def run(self, **overrides) -> Run:
        """Start a run of the knobs' config (with overrides) without blocking; returns it."""
        if self.last_run is not None and not self.last_run.done:
            raise RuntimeError("the last run is still going: wait for it or press Stop")
        cfg = self.config(**overrides)
        run = launch(cfg)
        self.runs.append(run)
        self.last_run = run
        self.progress.max, self.progress.value, self.progress.bar_style = cfg.steps, 0, ""
        self.run_button.disabled, self.stop_button.disabled = True, False
        self.details.value = ""
        self.status.value = html.escape(f"starting {run_label(run)}: spawning "
                                        f"{cfg.world_size} process(es)")
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
        # stop() waits for the ranks to exit (seconds); a thread keeps the kernel free.
        threading.Thread(target=self._stop, args=(run,), daemon=True).start()

    def _stop(self, run: Run):
        try:
            run.stop()
        except BaseException as e:  # noqa: BLE001 - never raise from a thread
            self.status.value = _error_html("stop failed", e)

    # -- keeping knobs consistent ----------------------------------------------------------------
    def _on_world_size(self, change):
        # 'single' is one process by definition: more ranks means a parallel strategy.
        strategy = self.knobs["strategy"]
        if change["new"] > 1 and strategy.value == "single":
            parallel = next(s for s in self.knobs["strategy"].options if s != "single")
            strategy.value = parallel
            self.status.value = html.escape(f"strategy set to '{parallel}': 'single' runs "
                                            f"exactly one process")

    def _on_strategy(self, change):
        if change["new"] == "single" and self.knobs["world_size"].value != 1:
            self.knobs["world_size"].value = 1
            self.status.value = "world size set to 1: 'single' runs exactly one process"
        # The all-reduce algorithm only matters to the strategy that all-reduces gradients.
        self.knobs["allreduce"].disabled = change["new"] != "allreduce"

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
        self.run_button.disabled, self.stop_button.disabled = False, True
        self.progress.bar_style = {"done": "success", "failed": "danger"}.get(run.status, "warning")
        if run.status == "failed" and run.error is not None:
            self.status.value = f"<span style='color:#c00'>{self.status.value}</span>"
            self.details.value = (f"<b>traceback of rank {run.error.rank}</b><pre>"
                                  f"{html.escape(run.error.traceback or '(none recorded)')}</pre>")

    def __repr__(self):
        return f"ControlPanel({len(self.runs)} runs)"


def strategies_for(cfg: RunConfig) -> tuple[str, ...]:
    """The strategies that can run cfg's model: all of them for distlab's GPT; for a model of
    your own (RunConfig.model="package.module:function") those that do not reach into the GPT's
    layers (Strategy.any_model)."""
    from distlab.parallel import strategy_class
    if not factory.is_spec(cfg.model):
        return STRATEGIES
    return tuple(s for s in STRATEGIES if strategy_class(s).any_model)


def _make_knobs(cfg: RunConfig) -> dict:
    """One widget per RunConfig field the panel exposes, keyed by the field's name."""
    style = {"description_width": "initial"}
    return {
        "strategy": W.Dropdown(options=strategies_for(cfg), value=cfg.strategy,
                               description="strategy", style=style),
        "world_size": W.Dropdown(options=sorted({*WORLD_SIZES, cfg.world_size}),
                                 value=cfg.world_size, description="world size", style=style),
        "steps": W.BoundedIntText(value=cfg.steps, min=1, max=100_000, description="steps",
                                  style=style, layout=W.Layout(width="150px")),
        # The browser snaps a slider's value to its step and sends it back, so a coarse step
        # would silently change the default (3e-3 became 10**-2.5); 1e-4 of a decade moves a
        # value by at most 0.012%, which config() then rounds away.
        "lr": W.FloatLogSlider(value=cfg.lr, base=10, min=-5, max=0, step=1e-4,
                               readout_format=".2e", description="learning rate", style=style),
        "precision": W.Dropdown(options=PRECISIONS, value=cfg.precision, description="precision",
                                style=style),
        "allreduce": W.Dropdown(options=ALLREDUCE_ALGORITHMS, value=cfg.allreduce,
                                description="all-reduce", style=style),
    }
