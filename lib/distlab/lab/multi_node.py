"""Notebook 17's helpers: DDP across simulated nodes over a sweep of link speeds, and the
model the sweep tests, t(L) = t0 + (bits each link carries per step) / L.

    rows = link_sweep(cfg, links=(25, 50, 100, 200), warmup=2)
    fit = fit_link(rows)          # t0, the measured slope, the slope the counted bytes predict
    link_figure(rows, fit).show()

Every figure is measured: the step time is rank 0's step_s (a median after warm-up), the bytes
are each node's link interface counter per step (distlab.caller.cluster_run). The model's one
free number is t0 (the fit's intercept); its slope is not fitted to the times but counted on
the links, so the fit's own slope can disagree with it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import plotly.graph_objects as go

from distlab.caller.launch import launch


@dataclass
class LinkRow:
    link_mbit: float
    step_s: float  # rank 0's median step time after warm-up
    link_bytes: float  # bytes each node's link sent per step (mean over the nodes)
    grad_bytes: int  # the model's gradients (fp32): what one all-reduce reduces
    run_dir: str


@dataclass
class LinkFit:
    t0: float  # seconds: the intercept, the step with an infinitely fast link
    slope: float  # seconds per step per (1 / Mbit/s), fitted to the times
    counted: float  # Mbit each link carries per step: the model's slope

    @property
    def ratio(self) -> float:
        """Fitted slope over counted: 1.0 when the step gets the link's whole rate."""
        return self.slope / self.counted

    def predict(self, link_mbit: float) -> float:
        return self.t0 + self.counted / link_mbit


def link_sweep(cfg, links, warmup: int = 2, done=()) -> list[LinkRow]:
    """Train cfg (nodes >= 2) once per link speed; each run ends before the next starts.
    `done`: finished runs of the same model across nodes to reuse as points (their own link
    speed), so a notebook's earlier run is not trained again."""
    if cfg.nodes < 2:
        raise ValueError(f"cfg.nodes={cfg.nodes}: a link sweep needs at least 2 nodes")
    if cfg.steps <= warmup:
        raise ValueError(f"steps={cfg.steps} must exceed warmup={warmup}")
    have = {r.cfg.link_mbit: r for r in done}
    runs = [have.get(float(link)) or launch(cfg.replace(link_mbit=float(link)), block=True)
            for link in links]
    return [link_row(run, warmup) for run in runs]


def link_row(run, warmup: int) -> LinkRow:
    """A finished run across nodes as one point of the sweep."""
    steps = [e["step_s"] for e in run.history("step", rank=0)][warmup:]
    per_step = run.link_bytes_per_step()
    if per_step is None:  # fewer than two counter readings with steps between them
        raise RuntimeError(f"link {run.cfg.link_mbit:g} Mbit/s: the run was too short to count "
                           "its links' bytes per step; give it more steps")
    return LinkRow(run.cfg.link_mbit, statistics.median(steps), statistics.mean(per_step),
                   run.info("n_params") * 4, run.dir)


def fit_link(rows: list[LinkRow]) -> LinkFit:
    """Least squares of t = t0 + slope / L over the rows; the counted slope beside it."""
    import numpy as np
    if len(rows) < 2:
        raise ValueError("a fit needs at least two link speeds")
    slope, t0 = np.polyfit([1 / r.link_mbit for r in rows], [r.step_s for r in rows], 1)
    counted = statistics.mean(r.link_bytes for r in rows) * 8 / 1e6
    return LinkFit(float(t0), float(slope), counted)


def link_figure(rows: list[LinkRow], fit: LinkFit) -> go.Figure:
    """Step time against link speed: the runs, and t0 + counted bits / L."""
    speeds = sorted(r.link_mbit for r in rows)
    grid = [speeds[0] * (speeds[-1] / speeds[0]) ** (i / 40) for i in range(41)]
    fig = go.Figure()
    fig.add_scatter(x=grid, y=[1e3 * fit.predict(L) for L in grid], mode="lines",
                    name=f"modelled: t0 + {fit.counted:.2f} Mbit / L", line=dict(dash="dash"))
    fig.add_scatter(x=[r.link_mbit for r in rows], y=[1e3 * r.step_s for r in rows],
                    mode="markers", marker=dict(size=10), name="measured step (median)",
                    customdata=[r.link_bytes / r.grad_bytes for r in rows],
                    hovertemplate="%{x} Mbit/s: %{y:.1f} ms<br>each link sent %{customdata:.2f}"
                                  "x the gradients per step<extra></extra>")
    fig.update_layout(template="plotly_white", height=420, width=760,
                      title="DDP over two nodes: the step against the link's speed",
                      xaxis=dict(title="link speed (Mbit/s, log)", type="log"),
                      yaxis=dict(title="step time (ms, log)", type="log"))
    return fig
