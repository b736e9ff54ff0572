"""Widgets for the workbook: a live dashboard of runs and a control panel that launches them.

    run = launch(cfg)       # returns at once; the ranks train in the background
    dash = lab.watch(run)   # shows the live figures under this cell
    run.wait()

    panel = lab.ControlPanel(steps=50)
    panel.widget            # knobs, Run / Stop, progress, and its own dashboard

One widget a module; this one holds the control panel, and every name the others hold is
importable from here as it always was (distlab.lab.panel re-exports them):

    live.py        reading a run while it grows; what every live widget shares
    dashboard.py   LiveDashboard, watch(run), dashboard_for(run); why one figure and a thread
    explorer.py    Explorer: the base of every notebook's explorer widget
    panel.py       ControlPanel: knobs for a RunConfig, Run and Stop, progress, its dashboard

Why they are built this way (the dashboard's figure and thread: dashboard.py):

* The thread only sets widget state. `print()` or `display()` from a thread lands in whichever
  cell happens to be executing, so these modules never do either outside the main thread.
* Button handlers return at once (the run is non-blocking). Messages from the browser reach the
  kernel only between cells, so a Stop button works only while no cell blocks.
* Nothing here raises into the kernel from the thread: an error ends up in a status widget.
"""

from __future__ import annotations

import dataclasses
import html
import itertools

import ipywidgets as W

from distlab.models import factory
from distlab.config import SCHEDULES, STRATEGIES, RunConfig, declarations
from distlab.config.reads import FEATURE_FIELDS, reads, strategy_knobs
from distlab.caller.launch import launch
from distlab.parallel import DEGREES, knobs, strategy_class
from distlab.caller.run import Run
from distlab.lab.dashboard import (BOOKED_COLOR, EMPTY_HINT, FLOOR_COLOR, LINK_COLOR, LINK_NAME,
                                   PEAK_COLOR, PEAK_NAME, POLL_S, WIRE_COLOR, LiveDashboard,
                                   dashboard_for, loss_axis_title, watch)
from distlab.lab.explorer import Explorer, ExplorerBusy
from distlab.lab.live import (LIVE_NOTE, LiveBox, _error_html, _stop_in_background, describe,
                              keep_for_reload, live_note, loss_curve, run_label, show_live,
                              status_text, step_events, wire_sent)
from distlab.step_event import bytes_sent
from distlab.units import DTYPES

# what distlab.lab.panel has always offered: the control panel's names and, re-exported, the
# dashboard's, the explorers' and the shared ones
__all__ = ["ControlPanel", "PANEL_FEATURES", "FITTED", "MICROBATCHES", "VIRTUAL_STAGES",
           "strategies_for", "LiveDashboard", "watch", "dashboard_for", "loss_axis_title",
           "EMPTY_HINT", "POLL_S", "FLOOR_COLOR", "PEAK_COLOR", "BOOKED_COLOR", "WIRE_COLOR",
           "LINK_COLOR", "LINK_NAME", "PEAK_NAME", "Explorer", "ExplorerBusy", "run_label",
           "loss_curve", "step_events", "wire_sent", "bytes_sent", "describe", "status_text",
           "keep_for_reload", "LIVE_NOTE", "live_note", "show_live"]


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
# `ep` picked on a dense base: the experts it places, per block (every world size offered, 1, 2
# and 4, divides it)
EP_EXPERTS = 4


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
        self.widget = LiveBox([
            self.controls, W.HBox([self.run_button, self.stop_button, self.progress]),
            self.status, self.details, self.dashboard.widget], "the control panel",
            figure=lambda: self.dashboard.fig)
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
        if strategy == "ep" and not values["n_experts"]:  # ep places a mixture's experts
            values["n_experts"] = EP_EXPERTS
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
        base = {"schedule": SCHEDULES, "param_dtype": tuple(DTYPES),
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
