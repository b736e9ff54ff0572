"""Debugging drills: a training bug switched on (RunConfig.bug, or a bad lr), its symptom in
the run's step events, and the check (distlab.debug.diagnose) that finds it, with the fix run beside.

    runs = run_drills(drill_base(steps=150))     # two launches: one rank, then two
    rows = drill_rows(runs)                      # per drill: checks fired, caught?, fixed?
    loss_figure(runs).show(); layers_figure(runs).show()
    DebugExplorer(drill_base(60)).widget         # a drill from a dropdown, live, then its findings
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from distlab.config import RunConfig
from distlab.data.dataset import make_data
from distlab.debug.diagnose import (
    HEALTHY_UPDATE_RATIO,
    Finding,
    Trace,
    findings,
    matches_reference,
)
from distlab.lab.common import RUN_COLORS, has_hint, html_table
from distlab.lab.live import LiveBox
from distlab.lab.panel import Explorer, LiveDashboard
from distlab.lab.runs import launch_together
from distlab.caller.launch import launch
from distlab.caller.run import Run

HEALTHY_COLOR = "#bbbbbb"
REFERENCE_LINES = (("loss_at_start", "ln V: uniform guess", "#c2255c", "dot"),
                   ("unigram_entropy", "unigram entropy: the marginal", "#e8590c", "dashdot"),
                   ("loss_floor", "loss floor: the data's entropy", "#555555", "dash"))


@dataclass(frozen=True)
class Drill:
    """A bug as RunConfig changes from the drill base, the check expected to catch it, and the
    run that fixes it (a key of drill_configs: the changes reverted or the remedy added)."""
    title: str
    changes: dict
    check: str  # a distlab.debug.diagnose check name
    signature: str  # what the symptom looks like, and why
    fix: str  # the config key of the fixed run
    fix_title: str
    reference: str | None = None  # compare step 0 with this run (diagnose.matches_reference)
    world: int = 1


# SGD for the drills where the step size is the point: AdamW divides by the gradient's own
# scale, so a gradient k times too large moves it (almost) as far as the right one.
_SGD = dict(optimizer="sgd", lr=0.3)
DRILLS = {
    "lr too high": Drill(
        "learning rate too high (lr 1.0 with AdamW)", dict(lr=1.0), "no_divergence",
        "loss jumps above ln V and stays there: steps overshoot into confident, wrong predictions",
        "healthy", "lr 1e-2"),
    "lr too low": Drill(
        "learning rate too low (lr 1e-5)", dict(lr=1e-5), "learning",
        "loss flat near ln V; update/weight ratio well under CS231n's 1e-3",
        "healthy", "lr 1e-2"),
    "shuffled labels": Drill(
        "labels shuffled apart from the inputs", dict(bug="shuffled_labels"), "unigram",
        "loss falls fast to the unigram entropy and stays: the marginal is all there is to learn",
        "healthy", "targets of the row's own sequence"),
    "zero init": Drill(
        "every Linear initialised to 0", dict(bug="zero_init"), "symmetry",
        "the blocks' units stay identical (all 0) and get no gradient; embeddings and head "
        "still learn a bigram model, which on a first-order chain hides the bug in the loss",
        "healthy", "random init (std 0.02)"),
    "zero_grad forgotten": Drill(
        "optimizer.zero_grad() left out", dict(bug="no_zero_grad"), "gradient_growth",
        "gradient norm climbs step after step (each .grad is the sum of all so far) while "
        "the loss turns back up", "healthy", "zero_grad every step"),
    "loss not divided by k": Drill(
        "grad_accum=4, loss not divided by 4 (SGD)",
        dict(**_SGD, grad_accum=4, bug="loss_not_divided"), "initial_loss",
        "step-0 loss 4 x ln V (the logged sum), gradient and SGD step 4 x the reference's",
        "divided", "loss / grad_accum", reference="sgd"),
    "exploding gradients": Drill(
        "SGD at lr 3.0, no clipping", dict(optimizer="sgd", lr=3.0), "finite",
        "loss and gradient norm grow for a few steps, then inf and NaN for the rest of the run",
        "clipped", "grad_clip=0.5"),
    "same rows on every rank": Drill(
        "a sampler that ignores the rank (2 ranks)",
        dict(strategy="allreduce", world_size=2, bug="same_rows"), "distinct_rows",
        "the loss looks fine; the ranks' batch fingerprints are equal at every step: half the "
        "global batch is never read", "per-rank rows", "rank r reads the r-th block", world=2),
}


def drill_base(steps: int, **changes) -> RunConfig:
    """The drills' model and data: a 2-layer GPT on the Markov chain, AdamW at lr 1e-2 (it
    reaches the floor in ~30 steps, so every drill shows its symptom in a short run), with
    the diagnostics on."""
    cfg = dict(steps=steps, n_layer=2, n_embd=32, n_head=2, seq_len=32, global_batch=8,
               vocab_size=64, lr=1e-2, threads_per_rank=1, diagnostics=True)
    return RunConfig(**{**cfg, **changes})


# The two-rank runs stop here: the fingerprints show the bug from step 0, and a two-rank step
# costs ~3x a one-rank one on 2 cores (an all-reduce per parameter tensor)
TWO_RANK_STEPS = 60


def drill_configs(base: RunConfig) -> dict[str, RunConfig]:
    """Every run the drills need: the healthy base, each drill, the fixes that are not the
    healthy run, the SGD reference, and "overfit one batch" (a finite dataset of one global
    batch read steps times: a correct loop memorises it)."""
    sgd = base.replace(**_SGD)
    cfgs = {"healthy": base, "sgd": sgd,
            "overfit": base.replace(dataset_size=base.global_batch, epochs=base.steps)}
    for name, d in DRILLS.items():
        steps = min(base.steps, TWO_RANK_STEPS) if d.world > 1 else base.steps
        cfgs[name] = base.replace(**d.changes, steps=steps)
    cfgs["divided"] = cfgs["loss not divided by k"].replace(bug="none")
    cfgs["clipped"] = cfgs["exploding gradients"].replace(grad_clip=0.5)
    cfgs["per-rank rows"] = cfgs["same rows on every rank"].replace(bug="none")
    return cfgs


def run_drills(base: RunConfig) -> dict[str, Run]:
    """Every drill config, in as few launches as the world sizes allow (one per world size)."""
    cfgs = drill_configs(base)
    runs: dict[str, Run] = {}
    for world in sorted({c.processes for c in cfgs.values()}):
        runs.update(launch_together({k: c for k, c in cfgs.items() if c.processes == world},
                                    name=f"drills-w{world}"))
    return {k: runs[k] for k in cfgs}  # in drill_configs' order


def drill_findings(runs: dict[str, Run]) -> dict[str, list]:
    """Every run's findings (with its reference where its drill has one)."""
    refs = {}
    for name, d in DRILLS.items():
        if d.reference:
            refs[name] = refs[d.fix] = d.reference
    return {name: findings(run, runs[refs[name]] if name in refs else None)
            for name, run in runs.items()}


def failed(found: list) -> list[str]:
    return [f.check for f in found if not f.passed]


def drill_results(runs: dict[str, Run]) -> dict[str, dict]:
    """Per drill, computed from the runs: the checks that failed on it, whether its own check
    was among them (caught), the fix run's failed checks and whether it passes every check
    (fixed: no false alarm either)."""
    found = drill_findings(runs)
    out = {}
    for name, d in DRILLS.items():
        mine = {f.check: f for f in found[name]}
        own = mine.get(d.check)
        out[name] = {"failed": failed(found[name]), "caught": d.check in failed(found[name]),
                     "evidence": own.evidence if own else "(check did not apply)",
                     "fix_failed": failed(found[d.fix]), "fixed": not failed(found[d.fix]),
                     "fix_evidence": next((f.evidence for f in found[d.fix]
                                           if f.check == d.check), "")}
    return out


def drill_rows(runs: dict[str, Run]) -> list[list[str]]:
    """The findings table: bug, signature, the check expected, what fired in this run, the
    evidence, and the fix's verdict."""
    res = drill_results(runs)
    rows = []
    for name, d in DRILLS.items():
        r = res[name]
        rows.append([name, d.title, d.signature, d.check, ", ".join(r["failed"]) or "none",
                     r["evidence"], "yes" if r["caught"] else "**no**",
                     f"{d.fix_title}: " + ("no finding" if r["fixed"] else
                                           "still " + ", ".join(r["fix_failed"]))])
    return rows


DRILL_HEADER = ["drill", "injected", "signature", "check", "checks that fired here",
                "evidence (measured)", "caught?", "fix"]


# -- figures --------------------------------------------------------------------------------------
def loss_figure(runs: dict[str, Run]) -> go.Figure:
    """One small chart per drill: its loss (and its fix's, where the fix is not the healthy
    run) over the healthy run in grey, with ln V, the unigram entropy and the floor. Log y:
    losses here span 0.002 (one batch memorised) to ~100 (lr too high); linear y, 2.5 to 4.6,
    for the two drills that stall at ln V and at the unigram entropy."""
    names = list(DRILLS) + ["overfit"]
    fig = make_subplots(rows=3, cols=3, subplot_titles=names, shared_xaxes=True,
                        vertical_spacing=0.09, horizontal_spacing=0.06)
    ref = runs["healthy"]
    shown: set[str] = set()  # each legend entry once
    for i, name in enumerate(names):
        row, col = i // 3 + 1, i % 3 + 1
        _loss(fig, ref, "healthy run", HEALTHY_COLOR, 6, row, col, shown)
        _loss(fig, runs[name], "the drill (bug on)", RUN_COLORS[0], 2, row, col, shown)
        fix = DRILLS[name].fix if name in DRILLS else None
        if fix and fix != "healthy":
            _loss(fig, runs[fix], "its fix", RUN_COLORS[2], 2, row, col, shown, dash="dot")
        _nan_marker(fig, runs[name], row, col)
        for key, label, color, dash in REFERENCE_LINES:
            value = ref.info(key)
            if value is not None:
                fig.add_scatter(x=[0, ref.cfg.steps - 1], y=[value, value], mode="lines",
                                name=label, legendgroup=label, showlegend=label not in shown,
                                line=dict(color=color, dash=dash, width=1), row=row, col=col)
                shown.add(label)
    ticks = [0.001, 0.01, 0.1, 0.5, 1, 2, 4, 10, 100]
    fig.update_yaxes(type="log", range=[math.log10(0.3), math.log10(300)], tickvals=ticks)
    fig.update_yaxes(range=[math.log10(1e-3), math.log10(300)], row=3, col=3)  # memorised
    # ln V (4.16) and the unigram entropy (3.79 on this chain) are 0.04 decades apart: a few
    # pixels on the shared log axis, so the two drills that stall on them looked alike. Their
    # panels get a linear axis around the two lines, where they sit apart.
    for name in ("lr too low", "shuffled labels"):
        i = names.index(name)
        fig.update_yaxes(type="linear", range=[2.5, 4.6], tickvals=[2.5, 3, 3.5, 4, 4.5],
                         row=i // 3 + 1, col=i % 3 + 1)
    for r in (1, 2, 3):
        fig.update_yaxes(title_text="loss (nats/token)", row=r, col=1)
    for c in (1, 2, 3):
        fig.update_xaxes(title_text="step", row=3, col=c)
    # The legend in rows under the charts, and no fixed width: a figure wider than the
    # notebook's output area (about 970 px in a 1400 px window) is cut at its right edge,
    # legend and all; this one takes the width it is given.
    fig.update_layout(height=800, template="plotly_white",
                      title="the drills' loss (mean over ranks) beside the healthy run",
                      margin=dict(l=60, r=20, t=70, b=120), legend=LEGEND_BELOW)
    return fig


# A horizontal legend under the bottom row's "step" titles (paper units: below 0 is under the
# plot area; the bottom margin holds it).
LEGEND_BELOW = dict(orientation="h", x=0, xanchor="left", y=-0.09, yanchor="top")


def _loss(fig, run, name, color, width, row, col, shown: set, dash="solid"):
    losses = [v if math.isfinite(v) else None for v in run.losses()]
    fig.add_scatter(y=losses, mode="lines", name=name, legendgroup=name,
                    showlegend=name not in shown,
                    line=dict(color=color, width=width, dash=dash), row=row, col=col)
    shown.add(name)


def _nan_marker(fig, run, row, col):
    """Where the loss stops being a number: a red cross at the last finite value."""
    losses = run.losses()
    bad = next((s for s, v in enumerate(losses) if not math.isfinite(v)), None)
    if bad:
        fig.add_scatter(x=[bad - 1], y=[losses[bad - 1]], mode="markers+text",
                        marker=dict(symbol="x", size=11, color="#c00"),
                        text=[f"NaN from step {bad}"], textposition="bottom right",
                        showlegend=False, row=row, col=col)


LAYER_GROUPS = (("embeddings", ("tok_emb", "pos_emb"), "#1f5fbf"),
                ("block 0", ("blocks.0.",), "#2b8a3e"), ("block 1", ("blocks.1.",), "#e8590c"),
                ("head", ("head",), "#c2255c"))


def _group(layer: str):
    return next((g for g in LAYER_GROUPS if layer.startswith(g[1])), ("other", (), "#868e96"))


def layers_figure(runs: dict[str, Run], names=("healthy", "lr too low", "zero init",
                                               "zero_grad forgotten")) -> go.Figure:
    """Per weight matrix over the steps, for a few drills (columns): gradient norm and the
    update/weight ratio ||dW||/||W|| (log axes, CS231n's 1e-3 as a line), and the units'
    spread (0: every unit of the layer identical). Zeros cannot sit on a log axis: a layer
    whose gradient is exactly 0 shows only in the spread row (and the chart title says how
    many)."""
    fig = make_subplots(rows=3, cols=len(names), shared_xaxes=True, vertical_spacing=0.07,
                        horizontal_spacing=0.05, subplot_titles=[
                            f"{n}<br><sup>{_zero_layers(runs[n])}</sup>" for n in names])
    shown = set()
    for c, name in enumerate(names, 1):
        events = sorted(runs[name].history("step", rank=0), key=lambda e: e["step"])
        for layer in events[0]["diag"]["grad_norm"]:
            label, _, color = _group(layer)
            for r, key in ((1, "grad_norm"), (2, "update_ratio"), (3, "unit_spread")):
                y = [e["diag"][key][layer] for e in events]
                if r < 3:
                    y = [v if v and math.isfinite(v) else None for v in y]
                fig.add_scatter(y=y, mode="lines", name=label, legendgroup=label,
                                showlegend=label not in shown, line=dict(color=color, width=1),
                                hovertemplate=f"{layer}: %{{y:.3g}}<extra></extra>",
                                row=r, col=c)
                shown.add(label)
        steps = len(events)
        fig.add_scatter(x=[0, steps - 1], y=[HEALTHY_UPDATE_RATIO] * 2, mode="lines",
                        name="1e-3 (CS231n heuristic)", legendgroup="h",
                        showlegend=c == 1, line=dict(color="#222", dash="dash"), row=2, col=c)
    fig.update_yaxes(type="log", row=1)
    fig.update_yaxes(type="log", row=2)
    fig.update_yaxes(range=[-0.05, 1.1], row=3)
    fig.update_yaxes(title_text="gradient norm", row=1, col=1)
    fig.update_yaxes(title_text="update / weight", row=2, col=1)
    fig.update_yaxes(title_text="unit spread", row=3, col=1)
    for c in range(1, len(names) + 1):
        fig.update_xaxes(title_text="step", row=3, col=c)
    fig.update_layout(height=800, template="plotly_white",  # no fixed width: see loss_figure
                      title="per weight matrix (rank 0), one line each, coloured by where it sits",
                      margin=dict(l=70, r=20, t=80, b=100), legend=LEGEND_BELOW)
    return fig


def _zero_layers(run: Run) -> str:
    last = max(run.history("step", rank=0), key=lambda e: e["step"])["diag"]["grad_norm"]
    zero = sum(v == 0 for v in last.values())
    return (f"{zero} of {len(last)} gradients exactly 0 (not drawn)" if zero
            else "no gradient exactly 0")


def fingerprint_rows(runs: dict[str, Run], names=("same rows on every rank", "per-rank rows"),
                     steps: int = 3) -> list[list[str]]:
    """Each rank's batch fingerprint at the first steps of the two-rank runs."""
    rows = []
    for name in names:
        for s in range(steps):
            ev = sorted((e for e in runs[name].history("step") if e["step"] == s),
                        key=lambda e: e["rank"])
            fps = [e["diag"]["batch"] for e in ev]
            rows.append([name, s, *fps, "same" if len(set(fps)) < len(fps) else "distinct"])
    return rows


# -- the explorer ---------------------------------------------------------------------------------
class DebugExplorer(Explorer):
    """A dropdown of drills and Run: the drill trains live in the workbook's dashboard (its
    loss over any earlier ones, ln V, the unigram entropy and the floor drawn in), and when
    it ends its findings appear under it, computed by distlab.debug.diagnose."""

    def __init__(self, base: RunConfig):
        super().__init__()  # Run, Stop, the status line
        self.base = base
        self.drill = W.Dropdown(options=["healthy", *DRILLS], value="healthy",
                                description="drill")
        self.status.value = "pick a drill and press Run"
        self.report = W.HTML()
        self.dashboard = LiveDashboard()
        self.dashboard.listeners.append(self._after_refresh)
        self.last: Run | None = None
        self._reported: Run | None = None
        self._labels: dict[int, str] = {}
        self._lines_drawn = False  # ln V and the unigram entropy: with the first step drawn
        self.widget = LiveBox([W.HBox([self.drill, self.button, self.stop_button]),
                               self.status, self.report, self.dashboard.widget],
                              "DebugExplorer (an explorer)", figure=lambda: self.dashboard.fig)

    def config(self) -> RunConfig:
        d = DRILLS.get(self.drill.value)
        return self.base.replace(**d.changes) if d else self.base

    def run(self, drill: str | None = None, wait: bool = False) -> Run | None:
        """Start a drill (the dropdown's, or `drill`); with wait=True block until it ends and
        show its findings (a notebook cell's way). Without, return the Run once its ranks
        started while it trains in a thread, as the Run button does (None if it could not
        start: the status line says why)."""
        values = {} if drill is None else {"drill": drill}
        if wait:
            return super().run(**values)
        self.start(**values)
        self._launched.wait()
        return self.live

    def _clear(self):
        super()._clear()
        self.report.value = ""  # the last drill's findings; its curve stays, to compare

    def _run(self, drill: str | None = None) -> Run:
        if drill is not None:
            self.drill.value = drill
        cfg = self.config()
        self._announce(f"running '{self.drill.value}' ...")
        run = launch(cfg)
        self.last = run
        self._labels[id(run)] = self.drill.value
        self._started(run)
        self.dashboard.watch(run, label=self.drill.value)
        run.wait()
        self.dashboard.refresh()  # its findings, once (_after_refresh)
        return run

    def findings(self) -> list:
        return findings(self.last) if self.last is not None and self.last.done else []

    def _after_refresh(self):
        """Called by the dashboard after each redraw (its thread, or refresh() from a cell):
        once the last drill has ended, its findings, once. The reference lines go in when the
        dashboard shows its axes (before, it shows a hint: lines there would float in space)."""
        if not self._lines_drawn and not has_hint(self.dashboard.fig):
            self._lines_drawn = True
            self._draw_reference_lines()
        run = self.last
        if run is None or not run.done or self._reported is run:
            return
        self._reported = run
        if run.status != "done":  # failed or stopped: Explorer's status says so, and why
            return
        found = findings(run)
        bad = [f for f in found if not f.passed]
        self._say(html.escape(
            f"'{self._labels[id(run)]}': " + (f"{len(bad)} finding(s): "
                                              + ", ".join(f.check for f in bad)
                                              if bad else "no finding: every check passed")))
        self.report.value = html_table(
            ["check", "verdict", "evidence", "points to"],
            [[f.check, "ok" if f.passed else "FAILED", f.evidence, "" if f.passed else f.suspect]
             for f in found])

    def _draw_reference_lines(self):
        """ln V and the unigram entropy (the dashboard draws the floor itself)."""
        data = make_data(self.base)
        steps = self.base.steps
        for key, label, color, dash in REFERENCE_LINES[:2]:
            value = getattr(data, key)
            self.dashboard.fig.add_scatter(x=[0, steps - 1], y=[value, value], mode="lines",
                                           name=f"{label} {value:.3f}",
                                           line=dict(color=color, dash=dash, width=1),
                                           row=1, col=1)
        self.dashboard.fig.update_yaxes(type="log", row=1, col=1)


# -- numbers the notebook quotes ------------------------------------------------------------------
def median_update_ratio(run: Run) -> float:
    """The median over steps of the median over weight matrices of ||dW||/||W|| (rank 0; the
    layers stuck at 0 count as 0)."""
    per_step = [sorted(e["diag"]["update_ratio"].values())
                for e in run.history("step", rank=0)]
    return float(np.median([np.median(v) for v in per_step]))


def update_ratio_rows(runs: dict[str, Run], names=("healthy", "sgd", "lr too low",
                                                   "lr too high", "clipped")) -> list[list]:
    """Per run: optimizer, lr, the median update/weight ratio and how far it is from CS231n's
    1e-3, with its last-quarter loss."""
    rows = []
    for n in names:
        cfg, r = runs[n].cfg, median_update_ratio(runs[n])
        loss = Trace.of(runs[n]).quarter(4)
        rows.append([n, cfg.optimizer, f"{cfg.lr:g}", f"{r:.1e}",
                     f"{r / HEALTHY_UPDATE_RATIO:.2g} x", f"{np.mean(loss):.3f}"])
    return rows


def last_quarter_loss(run: Run) -> float:
    """The mean loss over the run's last quarter: where a run that stalled has settled."""
    losses = Trace.of(run).quarter(4)
    return sum(losses) / len(losses)


def identical_units(run: Run) -> tuple[int, int]:
    """(weight matrices whose units are still identical at the last step, weight matrices):
    spread under 1e-6, diagnose.symmetry's threshold (rank 0)."""
    spread = Trace.of(run).rank0("unit_spread")[-1]
    return sum(v < 1e-6 for v in spread.values()), len(spread)


def finding(run: Run, check: str) -> Finding | None:
    """The named check's Finding on a run (None where the check does not apply to it)."""
    return next((f for f in findings(run) if f.check == check), None)


def accumulation_findings(runs: dict[str, Run]) -> dict[str, Finding]:
    """Step 0 of the two accumulation runs (k = 4, the loss divided by k and not) against the
    SGD run without accumulation (diagnose.matches_reference): the same init and rows, so
    their gradient norms agree with the division and differ by k without it."""
    sgd = Trace.of(runs["sgd"])
    return {name: matches_reference(Trace.of(runs[name]), sgd)
            for name in ("divided", "loss not divided by k")}


# The runs with no bug in them: the healthy base, the SGD reference, overfit one batch, and
# the fixes that are not the healthy run
CLEAN_RUNS = ("healthy", "sgd", "overfit", "divided", "clipped", "per-rank rows")


def clean_run_checks(runs: dict[str, Run]) -> tuple[int, int]:
    """(checks run, checks failed) over CLEAN_RUNS, each with its reference where its drill
    has one: on a run without a bug every failure is a false alarm."""
    found = drill_findings({name: runs[name] for name in CLEAN_RUNS})
    return (sum(map(len, found.values())),
            sum(not f.passed for fs in found.values() for f in fs))
