"""The live dashboard (LiveDashboard): the loss of every watched run, overlaid, and memory and
bytes per rank of the latest one; for a mixture of experts, the tokens each expert got from
each rank; `watch(run)` shows one under a cell, `dashboard_for(run)` makes one to display
yourself.

Why it is built this way:

* One plotly `FigureWidget` per dashboard, with subplots. Each FigureWidget sends plotly's whole
  JavaScript bundle (~5 MB) to the browser when it is created, so three figures per dashboard
  would cost three times that.
* The figure becomes a FigureWidget when the first run is watched: until then (a control
  panel nobody has pressed Run on) it is a static plotly output, and a saved notebook does not
  carry plotly's 5.1 MB widget bundle for an empty chart. When `watch()`'s cell ends with its
  runs over, a static copy takes the live figure's place and the widgets close (live.retire).
* A daemon thread polls the watched runs (at most `POLL_S` apart) and redraws inside
  `batch_update()`, so a cell that blocks in `run.wait()` still sees the figures move: widget
  messages from a thread reach the browser while the cell runs.
"""

from __future__ import annotations

import html
import threading
import time

import ipywidgets as W
import plotly.graph_objects as go
from IPython.display import Markdown, display
from plotly.subplots import make_subplots

from distlab.caller.run import Run
from distlab.lab.common import (MEMORY_CATEGORIES, MEMORY_COLORS, RUN_COLORS, byte_unit,
                                clear_hint, has_hint, md_escape, show_hint)
from distlab.lab.live import (LIVE_NOTE, FigureView, LiveBox, _error_html, describe,
                              keep_for_reload, loss_curve, retire, run_label, static_bundle,
                              step_events, wire_sent)
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
        # by index in fig.data: the figure object changes when it goes live or static
        self._loss_traces: dict[int, int] = {}  # id(run) -> its loss trace
        self._floor_traces: dict[float, int] = {}  # loss floor -> its dashed line
        self._names: dict[int, str] = {}  # id(run) -> a label given to watch()
        self._expert_traces: dict[int, int] = {}  # rank -> its bar of tokens per expert
        self.experts = False  # a fourth chart: the load per expert (from the first MoE run)
        self.fig = _make_figure()  # static until a run is watched (_go_live)
        self._view: FigureView | None = FigureView(self.fig)  # None while live
        self.outlives_cell = False  # the run outlasts its cell: the status says so (LIVE_NOTE)
        self.retired = False  # its cell ended and left a static copy: its widgets are closed
        self._handle = None  # watch()'s display, which a static copy replaces at cell end
        self._hooked = False  # a cell-end check is registered (_at_cell_end)
        self.status = W.HTML()
        self.widget = LiveBox([self._view.widget, self.status], "the live dashboard",
                              figure=lambda: self.fig)
        self.widget.add_class("distlab-dashboard")  # lets a browser test find this figure
        for run in runs or ():
            self.watch(run)

    def watch(self, run: Run, label: str | None = None) -> Run:
        """Add a run; `label` names it in the legend and status (default: run_label)."""
        if self.retired:
            raise ValueError("this dashboard's cell has ended and left a static copy in its "
                             "place: watch the run on a new dashboard (lab.watch(run))")
        with self._lock:
            if not self.experts and run.cfg is not None and run.cfg.n_experts:
                self._add_expert_chart()
            self._go_live()
            if run not in self.runs:
                self.runs.append(run)
                if label is not None:
                    self._names[id(run)] = label
                self._add_loss_trace(run, len(self.runs) - 1)
            start = self._thread is None and not run.done
            if start:  # decided under the lock, so the thread cannot exit in between
                self._thread = threading.Thread(target=self._poll, daemon=True,
                                                name="distlab-dashboard")
        self.refresh()
        if start:
            self._thread.start()
        return run

    def _add_loss_trace(self, run: Run, index: int):
        self.fig.add_scatter(x=[], y=[], mode="lines", name=self._label(run, index + 1),
                             line=_run_line(index), row=1, col=1)
        self._loss_traces[id(run)] = len(self.fig.data) - 1
        units = {loss_axis_title(r.cfg) for r in self.runs}
        self.fig.update_yaxes(title_text=units.pop() if len(units) == 1 else "loss",
                              row=1, col=1)

    def _add_expert_chart(self):
        """(Under the lock.) The first mixture-of-experts run watched: the figure is made again
        with a fourth chart, the runs' loss traces added back, in the old one's place."""
        self.experts = True
        old = self.fig
        self.fig = _make_figure(experts=True)
        self._loss_traces, self._floor_traces, self._expert_traces = {}, {}, {}
        for i, run in enumerate(self.runs):
            self._add_loss_trace(run, i)
        if self._view is None:  # live: a new FigureWidget where the old one was
            self.fig = go.FigureWidget(self.fig)
            self.widget.children = (self.fig, *self.widget.children[1:])
            retire(old)
        else:
            self._view.fig = self.fig

    def _go_live(self):
        """(Under the lock.) The static figure becomes a FigureWidget in the same place: the
        runs are drawn on it live from now on, until a cell ends with them over."""
        if self._view is None:
            return
        self.fig = go.FigureWidget(self.fig)
        old, self._view = self._view, None
        self.widget.children = (self.fig, *self.widget.children[1:])
        old.widget.close()
        self._check_at_cell_end()

    def _go_static(self):
        """(Under the lock.) The live figure, its runs over, becomes a static view again and
        its FigureWidget retires (live.retire): what a saved notebook keeps of it is the
        figure, not plotly's 5.1 MB widget bundle. The next run watched goes live again."""
        if self._view is not None:
            return
        live, self.fig = self.fig, go.Figure(self.fig)
        self._view = FigureView(self.fig)
        self.widget.children = (self._view.widget, *self.widget.children[1:])
        retire(live)

    def _check_at_cell_end(self):
        """After the cell now running (IPython's post_run_cell, on the kernel's main thread,
        while the cell's messages still count as its own: nbclient records them): with every
        run over, the figure goes static (watch()'s display: a static copy in its place).
        Runs still going are checked again at the next cell's end. A click's run, between
        cells, stays live until then."""
        from IPython import get_ipython
        shell = get_ipython()
        if shell is None or self._hooked:
            return
        self._hooked = True

        def at_cell_end(_result=None):
            shell.events.unregister("post_run_cell", at_cell_end)
            self._hooked = False
            self._at_cell_end()
        shell.events.register("post_run_cell", at_cell_end)

    def _at_cell_end(self):
        if self.retired:
            return
        if not self.runs or not all(r.done for r in self.runs):
            if self._handle is not None:  # watch()'s run outlasts its cell: the status says so
                self.outlives_cell = True
                self.refresh()
            with self._lock:
                if self._view is None:
                    self._check_at_cell_end()
            return
        thread = self._thread
        if thread is not None:  # its last redraw: let it finish, then draw once more here
            thread.join(timeout=5 * self.poll_s + 5)
        self.refresh()
        if self._handle is not None:
            self._leave_static_copy()
        else:
            with self._lock:
                self._go_static()

    def _leave_static_copy(self):
        """watch()'s display, its runs over: a static copy in the live figure's place (the last
        redraw as a plain plotly figure, which JupyterLab draws again from the saved notebook,
        with its HTML copy for nbconvert) and the status lines as Markdown; then the widgets
        close (live.retire), since nothing shows them any more. A live FigureWidget lives in
        the kernel: after a reload or a kernel restart it comes back as "Error displaying
        widget: model not found"."""
        self._handle.update(static_bundle(self.fig), raw=True)
        if not self.outlives_cell:  # a later cell's end: its output is not this run's place
            display(Markdown("  \n".join(self.status_lines())))
        self.retired = True
        retire(self.widget)

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
            moe_runs = [r for r in self.runs if r.cfg is not None and r.cfg.n_experts]
            if self.experts and moe_runs:
                self._draw_experts(moe_runs[-1], labels[id(moe_runs[-1])])
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
            if self._view is not None:  # not live yet (no run watched): the static view
                self._view.show()

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
                trace = self.fig.data[self._loss_traces[id(run)]]
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
            self.fig.add_scatter(
                x=[], y=[], mode="lines", line=dict(dash="dash", color=FLOOR_COLOR, width=1.5),
                name=f"loss floor {floor:.3f} (best achievable)",
                hovertemplate=("loss floor %{y:.4f}: the best achievable loss, the entropy of "
                               "the data<extra></extra>"),
                row=1, col=1)
            self._floor_traces[floor] = len(self.fig.data) - 1
        return self.fig.data[self._floor_traces[floor]]

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

    def _draw_experts(self, run: Run, label: str):
        """Block 0's tokens per expert at the latest step all ranks finished, stacked by the
        rank that routed them; each block's MaxVio under the chart."""
        step = run.steps_done() - 1
        events = [e for e in (step_events(run, step) if step >= 0 else []) if e.get("moe")]
        with self.fig.batch_update():
            for e in sorted(events, key=lambda e: e["rank"]):
                load = e["moe"][0]["tokens_per_expert"]
                if e["rank"] not in self._expert_traces:
                    self.fig.add_bar(x=[], y=[], name=f"rank {e['rank']}", legend="legend4",
                                     marker_color=RUN_COLORS[e["rank"] % len(RUN_COLORS)],
                                     row=4, col=1)
                    self._expert_traces[e["rank"]] = len(self.fig.data) - 1
                self.fig.data[self._expert_traces[e["rank"]]].update(
                    x=[f"expert {i}" for i in range(len(load))], y=load,
                    hovertemplate=f"rank {e['rank']}: %{{y}} tokens to %{{x}}<extra></extra>")
            self.fig.layout.xaxis4.title.text = expert_title(label, step, events)

    def __repr__(self):
        return f"LiveDashboard({len(self.runs)} runs)"


def expert_title(label: str, step: int, events: list[dict]) -> str:
    """Under the experts' chart: the run and step, each block's MaxVio (the busiest expert's
    load over the mean, minus 1; Wang et al. 2024) over all ranks, and the choices dropped."""
    if not events:
        return f"{label}: no step yet"
    from distlab.models.moe import max_violation
    blocks = range(len(events[0]["moe"]))
    vio = [max_violation([sum(c) for c in zip(*(e["moe"][b]["tokens_per_expert"]
                                                for e in events))]) for b in blocks]
    dropped = sum(m["dropped"] for e in events for m in e["moe"])
    return (f"{label}, step {step}, block 0 · MaxVio per block "
            f"{', '.join(f'{v:.2f}' for v in vio)} · dropped {dropped}")


def _make_figure(experts: bool = False) -> go.Figure:
    """Three charts, one above the other, each with its legend beside it (plotly's several
    legends): the loss of every run on top, memory and bytes per rank of the latest run
    underneath. Side by side, the lower two would share one legend column at the right, the
    memory categories beside the bytes chart. `experts`: a fourth, the tokens per expert of
    the latest mixture-of-experts run, stacked by rank."""
    titles = ("loss per step (mean over ranks)",
              "memory per rank: bytes by category (the step's peak: track_peak)",
              "bytes sent per rank in one step")
    fig = make_subplots(
        rows=4 if experts else 3, cols=1, vertical_spacing=0.1 if experts else 0.125,
        row_heights=[0.34, 0.22, 0.22, 0.22] if experts else [0.44, 0.28, 0.28],
        subplot_titles=titles + (("tokens routed to each expert, by the rank that sent them",)
                                 if experts else ()))
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
    rows = (1, 2, 3, 4) if experts else (1, 2, 3)
    tops = [fig.layout[f"yaxis{i if i > 1 else ''}"].domain[1] for i in rows]
    legends = {f"legend{i if i > 1 else ''}": dict(
        font=dict(size=11), x=1.02, xanchor="left", y=top, yanchor="top",
        traceorder="normal")  # "normal": stacked bars would otherwise list bottom-up
        for i, top in zip(rows, tops)}
    fig.update_layout(barmode="stack", height=1040 if experts else 800, width=960,
                      template="plotly_white", margin=dict(l=70, r=20, t=40, b=50), **legends)
    if experts:
        fig.update_yaxes(title_text="tokens", rangemode="nonnegative", row=4)
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
    # the widget's bundle, raw: a LiveBox displays itself with a note (no display id), and
    # this display is the one the static copy replaces at the cell's end
    dash._handle = display(dash.widget._repr_mimebundle_(), raw=True, display_id=True)
    return dash
