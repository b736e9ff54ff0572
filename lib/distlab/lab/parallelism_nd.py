"""Notebook 07's N-D part: the mesh of every dimension (distlab.parallel.parallelize), who talks
to whom per dimension, each group's bytes against its formula, and the planner's long-context
layout.

    mesh_figure(cfg)          one row per group kind, one column per rank: the group each rank
                              is in along that kind (same colour, same group: they talk)
    MeshND                    widgets for pp, dp_replicate, dp_shard, cp, tp, ep and the ZeRO
                              stage; redraws the figure and the group table, or says why the
                              mesh cannot be built (RunConfig's own check)
    dimension_rows(cfg, run)  per group kind, the bytes its members booked in a step against
                              distlab.theory.mesh_bytes
    long_context_plan()       the planner (modelled) on an 8B model at 256k tokens on 64 A100s
"""

from __future__ import annotations

import html

import ipywidgets as W
import plotly.graph_objects as go

from distlab.config import RunConfig
from distlab.lab.common import html_table
from distlab.lab.live import FigureView, LiveBox, show_live
from distlab.parallel.parallelize import CARRIES, layout, mesh_string, order_of, sizes
from distlab.theory.mesh_bytes import mesh_bytes

DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


def group_index(cfg: RunConfig) -> dict[str, list[int]]:
    """Per group kind the run builds, each rank's group number along it."""
    out = {}
    for kind, groups in layout(sizes(cfg), cfg.zero_stage, order_of(cfg)).items():
        where = [0] * cfg.world_size
        for i, members in enumerate(groups):
            for r in members:
                where[r] = i
        out[kind] = where
    return out


def mesh_figure(cfg: RunConfig, height: int = 300) -> go.Figure:
    """Ranks across, group kinds down; a cell's number is the rank's group along that kind."""
    index = group_index(cfg)
    kinds = list(index)
    fig = go.Figure(go.Heatmap(
        z=[index[k] for k in kinds], x=[str(r) for r in range(cfg.world_size)], y=kinds,
        text=[[str(g) for g in index[k]] for k in kinds], texttemplate="%{text}",
        colorscale="Turbo", showscale=False,
        customdata=[[CARRIES[k]] * cfg.world_size for k in kinds],
        hovertemplate="rank %{x}: %{y} group %{text}<br>%{customdata}<extra></extra>"))
    fig.update_layout(title=f"{mesh_string(sizes(cfg))}: each rank's group, per kind "
                            "(same number on a row: they talk)",
                      xaxis_title="rank", height=height, margin=dict(l=100, r=20, t=50, b=40))
    fig.update_yaxes(autorange="reversed")
    return fig


def group_rows(cfg: RunConfig) -> list[list]:
    """(kind, groups, members of each, what it carries) for a table."""
    return [[kind, len(groups), " ".join(str(g) for g in groups), CARRIES[kind]]
            for kind, groups in layout(sizes(cfg), cfg.zero_stage, order_of(cfg)).items()]


class MeshND:
    """The mesh explorer: move a degree, see every group; nothing is launched."""

    def __init__(self, base: RunConfig, **degrees):
        style = {"description_width": "initial"}
        start = {d: getattr(base, d) for d in DEGREES} | degrees
        self.base = base
        self.knobs = {d: W.Dropdown(options=[0, 1, 2, 4, 8] if d == "dp_shard" else [1, 2, 4, 8],
                                    value=start[d], description=d, style=style,
                                    layout=W.Layout(width="150px")) for d in DEGREES}
        self.knobs["zero_stage"] = W.Dropdown(options=[0, 1, 2, 3], value=base.zero_stage,
                                              description="ZeRO stage", style=style,
                                              layout=W.Layout(width="150px"))
        self.status = W.HTML()
        self.groups = W.HTML()
        self.fig = mesh_figure(self.config())
        self.view = FigureView(self.fig)  # static: redrawn per knob change, not streamed
        for w in self.knobs.values():
            w.observe(lambda _change: self.redraw(), names="value")
        self.widget = LiveBox([W.HBox(list(self.knobs.values())), self.status,
                               self.view.widget, self.groups], "the mesh explorer",
                              figure=lambda: self.fig)
        self.redraw()

    def config(self, **changes) -> RunConfig:
        """The knobs' mesh on the base's model (ValueError, naming why, if it cannot run)."""
        values = {k: w.value for k, w in self.knobs.items()} | changes
        return self.base.replace(strategy="mesh", world_size=1, **values)

    def redraw(self):
        try:
            cfg = self.config()
        except ValueError as e:
            self.status.value = f"<b>cannot run</b>: {html.escape(str(e))}"
            return
        self.status.value = html.escape(f"{mesh_string(sizes(cfg))}: {cfg.world_size} ranks, "
                                        f"{cfg.dp_degree} data-parallel")
        new = mesh_figure(cfg)
        with self.fig.batch_update():
            self.fig.data[0].update(new.data[0])
            self.fig.layout.title = new.layout.title
        self.view.show()
        self.groups.value = html_table(["group kind", "groups", "members", "carries"],
                                       group_rows(cfg))

    def _ipython_display_(self):
        show_live(self.widget)


def dimension_rows(cfg: RunConfig, run) -> list[dict]:
    """Per group kind: bytes its members booked in one step (summed over ranks, the run's last
    step) against theory.mesh_bytes; ep's all-to-alls follow the routing (no formula)."""
    last = max(e["step"] for e in run.history("step"))
    events = {e["rank"]: e for e in run.history("step") if e["step"] == last}
    rows = {}
    for r, e in events.items():
        want = mesh_bytes(cfg, r)
        for kind, kinds in e["mesh"]["comm"].items():
            row = rows.setdefault(kind, {"kind": kind, "measured": 0, "predicted": 0})
            row["measured"] += sum(v["bytes_sent"] for v in kinds.values())
            row["predicted"] += sum(want.get(kind, {}).values())
    for row in rows.values():
        row["ratio"] = row["measured"] / row["predicted"] if row["predicted"] else None
    return list(rows.values())


def long_context_plan(gpus: int = 64, seq: int = 262144) -> dict:
    """The planner (modelled): an 8B Llama-shaped model (32 layers, width 4096, 32 heads) at
    `seq` tokens on `gpus` A100s of 80 GB, 8 sequences a step: the fastest layout that fits
    with dp x tp x pp only, and with cp up to 16."""
    from distlab.theory.plan import Cluster, Model, best
    llama = Model(32, 4096, 32, seq=seq, vocab=128256, n_params=8.0e9)
    return {name: best(llama, Cluster(gpus=gpus), global_batch=8, cps=cps)
            for name, cps in (("3D only", (1,)), ("with cp", (1, 2, 4, 8, 16)))}
