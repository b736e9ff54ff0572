"""Figures and table rows of the search section (hp_search.py, arch_search.py): every number in
them is read from the studies' trials, which hold what their runs measured."""

from __future__ import annotations

import math

import optuna
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from distlab.lab.arch_search import pareto_front, points
from distlab.lab.common import RUN_COLORS
from distlab.lab.search import (
    best_so_far,
    completed,
    measured,
    search_overhead_s,
    trials_to_reach,
)

LEGEND = dict(x=1.02, y=1, xanchor="left")  # beside the chart, not over it
NAMES = {"grid": "grid", "random": "random", "tpe": "TPE (Bayesian)", "gp": "GP (Bayesian)",
         "nsga2": "NSGA-II"}


FROM_TRIAL = 3  # the y axis starts at every method's best after this many trials


SYMBOLS = ("circle", "diamond", "square", "triangle-up", "x")
DASHES = ("solid", "dash", "dot", "dashdot")


def best_so_far_figure(studies: dict[str, optuna.Study], target: float) -> go.Figure:
    """Best held-out loss after each trial, per method, and the target loss line. The y axis
    spans what the methods reach from their FROM_TRIAL-th trial on: a first trial far above
    the rest (grid's corner of the space: 30 nats against 3) would otherwise squash every
    curve into a flat line at the bottom; it enters the chart from above."""
    fig, later = go.Figure(), [target]
    for i, (m, study) in enumerate(studies.items()):
        y = [v if math.isfinite(v) else None for v in best_so_far(study)]
        later += [v for v in y[FROM_TRIAL - 1:] if v is not None]
        # methods that found the same best trial draw the same steps: a dash and a marker
        # of their own, and a small offset, keep each one visible under the others
        off = (i - (len(studies) - 1) / 2) * 0.08
        fig.add_scatter(x=[k + 1 + off for k in range(len(y))], y=y, mode="lines+markers",
                        name=NAMES.get(m, m), marker=dict(symbol=SYMBOLS[i % len(SYMBOLS)],
                                                          size=7),
                        line=dict(color=RUN_COLORS[i], shape="hv",
                                  dash=DASHES[i % len(DASHES)]))
    fig.add_hline(y=target, line_dash="dash", line_color="#555",
                  annotation_text=f"target {target:.3f}", annotation_position="top right")
    pad = 0.08 * (max(later) - min(later) or abs(target) * 0.05 or 1.0)
    fig.update_yaxes(range=[min(later) - pad, max(later) + pad])
    fig.update_layout(title=f"Best loss so far against trials spent (y from trial {FROM_TRIAL})",
                      xaxis=dict(title="trials", dtick=1),  # whole trials (the offsets are
                      yaxis_title="best held-out loss (nats)", height=360,  # only to separate)
                      template="plotly_white", legend=LEGEND)
    return fig


def method_rows(studies: dict[str, optuna.Study], target: float) -> list[list]:
    """method, trials, best loss, its parameters, trials to the target, seconds per trial in the
    run and around it (sampler, storage)."""
    rows = []
    for m, s in studies.items():
        best = min(completed(s), key=lambda t: t.value)
        p = best.params
        runs = [measured(t)["wall_s"] for t in s.trials]
        rows.append([NAMES.get(m, m), len(s.trials), f"{best.value:.3f}",
                     f"lr {p['lr']:.2g}, warm-up {p['warmup_steps']}, batch "
                     f"{p['global_batch']}, wd {p['weight_decay']:.2g}",
                     trials_to_reach(s, target) or f"not in {len(s.trials)}",
                     f"{sum(runs) / len(runs):.2f}", f"{search_overhead_s(s):.3f}"])
    return rows


METHOD_HEADER = ["method", "trials", "best loss", "best trial", "trials to the target",
                 "run s / trial", "search s / trial"]


def random_vs_grid_figure(result: dict) -> go.Figure:
    """Left: where the trials sat in (lr, weight decay); right: their loss against lr, the
    parameter that matters. The grid tries 3 learning rates, random search one per trial."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("trials in the search space",
                                                        "held-out loss against lr"))
    sets = [("grid", result["grid"], "square")] + [
        (f"random (seed {i})", s, "circle") for i, s in enumerate(result["random"])]
    for i, (label, study, symbol) in enumerate(sets):
        ts = completed(study)
        x = [t.params["lr"] for t in ts]
        kw = dict(legendgroup=label, marker=dict(color=RUN_COLORS[i], symbol=symbol, size=9))
        fig.add_scatter(x=x, y=[t.params["weight_decay"] for t in ts], mode="markers",
                        name=label, row=1, col=1, **kw)
        fig.add_scatter(x=x, y=[t.value for t in ts], mode="markers", name=label, row=1, col=2,
                        showlegend=False, **kw)
    fig.update_xaxes(type="log", title_text="learning rate")
    fig.update_yaxes(title_text="weight decay", row=1, col=1)
    fig.update_yaxes(title_text="held-out loss (nats)", row=1, col=2)
    fig.update_layout(title="Grid against random search, the same number of trials",
                      height=380, template="plotly_white", legend=LEGEND)
    return fig


def pruning_figure(studies: dict[str, optuna.Study]) -> go.Figure:
    """The live loss each trial reported, per pruner: trials that ran to the end as lines, pruned
    ones ending in a cross where the pruner decided, then dotted to the rows the run really
    read before its stop arrived (the steps saved count those: with 8 ms steps a run can
    finish before the stop reaches it); the unpruned runs in grey behind."""
    pruned = {k: v for k, v in studies.items() if k != "unpruned"}
    fig = make_subplots(rows=1, cols=len(pruned), subplot_titles=list(pruned),
                        shared_yaxes=True)
    for col, (name, study) in enumerate(pruned.items(), start=1):
        for t in studies["unpruned"].trials:
            x, y = zip(*measured(t)["curve"])
            fig.add_scatter(x=x, y=y, mode="lines", line=dict(color="#ced4da", width=1),
                            showlegend=False, hoverinfo="skip", row=1, col=col)
        for t in study.trials:
            x, y = zip(*measured(t)["curve"])
            stopped = t.state == optuna.trial.TrialState.PRUNED
            kind = "pruned" if stopped else "ran to the end"
            fig.add_scatter(x=x, y=y, mode="lines+markers", name=kind, legendgroup=kind,
                            showlegend=col == 1 and t.number == _first(study, stopped),
                            line=dict(color=RUN_COLORS[1 if stopped else 0], width=1.5),
                            marker=dict(symbol=["circle"] * (len(x) - 1)
                                        + ["x" if stopped else "circle"],
                                        size=[4] * (len(x) - 1) + [10 if stopped else 4]),
                            row=1, col=col)
            ran = measured(t).get("rows_run", 0)
            if stopped and ran > x[-1]:  # the stop reached the run later: its steps ran on
                fig.add_scatter(x=[x[-1], ran], y=[y[-1], y[-1]], mode="lines",
                                name="ran on until the stop reached it", legendgroup="ran on",
                                showlegend=not _ran_on_shown(fig),
                                line=dict(color=RUN_COLORS[1], width=1, dash="dot"),
                                row=1, col=col)
    fig.update_xaxes(title_text="training rows seen")  # the legend says what dotted means
    fig.update_yaxes(title_text="live loss (mean over the window)", row=1, col=1)
    fig.update_layout(title="Early stopping: what each pruner let run (grey: every trial "
                      "unpruned)", height=380, template="plotly_white", legend=LEGEND)
    return fig


def _ran_on_shown(fig) -> bool:
    return any(tr.legendgroup == "ran on" and tr.showlegend for tr in fig.data)


def _first(study, pruned: bool) -> int | None:
    state = optuna.trial.TrialState.PRUNED if pruned else optuna.trial.TrialState.COMPLETE
    return next((t.number for t in study.trials if t.state == state), None)


def pareto_figure(studies: dict[str, optuna.Study]) -> go.Figure:
    """Every completed candidate of every method, loss against parameters, and the Pareto front
    of all of them together (the ringed points, joined)."""
    fig = go.Figure()
    everything = []
    for i, (m, study) in enumerate(studies.items()):
        ts = completed(study)
        everything += points(study)
        # one symbol per method, drawn smaller each time: a candidate two methods both found
        # shows both markers, one inside the other, not the last one's alone
        fig.add_scatter(x=[t.values[1] for t in ts], y=[t.values[0] for t in ts],
                        mode="markers", name=NAMES.get(m, m),
                        marker=dict(color=RUN_COLORS[i], size=max(13 - 4 * i, 5),
                                    symbol=SYMBOLS[i % len(SYMBOLS)]),
                        text=[_arch(t.params) for t in ts], hovertemplate="%{text}")
    front = sorted({everything[i] for i in pareto_front(everything)}, key=lambda p: p[1])
    fig.add_scatter(x=[p[1] for p in front], y=[p[0] for p in front], mode="lines+markers",
                    name="Pareto front (all)", line=dict(color="#222", dash="dot"),
                    marker=dict(symbol="circle-open", size=16, line=dict(width=2)))
    fig.update_layout(title="Architecture search: held-out loss against size",
                      xaxis=dict(title="parameters", type="log"),
                      yaxis_title="held-out loss (nats)", height=380, template="plotly_white",
                      legend=LEGEND)
    return fig


def _arch(p: dict) -> str:
    return (f"{p['n_layer']} layers x {p['n_embd']}, {p['n_head']} heads, "
            f"MLP x{p['mlp_ratio']}")
