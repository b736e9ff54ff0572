"""Notebook 17's helpers: DDP across simulated nodes over a sweep of link speeds, and the
model the sweep tests, t(L) = t0 + (bits each link carries per step) / L; then the ways of
sending fewer bytes over the link, raced as loss against time.

    rows = link_sweep(cfg, links=(25, 50, 100, 200), warmup=2)
    fit = fit_link(rows)          # t0, the measured slope, the slope the counted bytes predict
    link_figure(rows, fit).show()

    race = slow_link_race(slow_link_ways(cfg))     # ddp, top-k, PowerSGD, local SGD, DiLoCo
    race_figure(race, cfg.link_mbit).show()

Every figure is measured: the step time is rank 0's step_s (a median after warm-up), the bytes
are each node's link interface counter per step (distlab.caller.cluster_run). The model's one
free number is t0 (the fit's intercept); its slope is not fitted to the times but counted on
the links, so the fit's own slope can disagree with it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import plotly.graph_objects as go

from distlab.caller.launch import launch
from distlab.lab.timed import all_of, below, in_order, within


@dataclass
class LinkRow:
    link_mbit: float
    step_s: float  # rank 0's median step time after warm-up
    link_bytes: float  # bytes each node's link sent per step (mean over the nodes)
    grad_bytes: int  # the model's gradients (fp32): what one all-reduce reduces
    run_dir: str
    steps: list[float] = field(default_factory=list)  # rank 0's step seconds after warm-up


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


# legends under the plot: on its right, 17's long trace names took about 60% of the width
LEGEND_BELOW = dict(orientation="h", yanchor="top", y=-0.18, x=0, xanchor="left")


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


def step_samples(run, warmup: int) -> list[float]:
    """Rank 0's step seconds after `warmup` steps (all of them if there are no more): the
    repeats a timing verdict is decided on (distlab.lab.timed)."""
    steps = [e["step_s"] for e in run.history("step", rank=0)]
    return steps[warmup:] or steps


def median_step(run, warmup: int) -> float:
    """Rank 0's median step time after `warmup` steps (all of them if there are no more)."""
    return statistics.median(step_samples(run, warmup))


def link_row(run, warmup: int) -> LinkRow:
    """A finished run across nodes as one point of the sweep."""
    per_step = run.link_bytes_per_step()
    if per_step is None:  # fewer than two counter readings with steps between them
        raise RuntimeError(f"link {run.cfg.link_mbit:g} Mbit/s: the run was too short to count "
                           "its links' bytes per step; give it more steps")
    return LinkRow(run.cfg.link_mbit, median_step(run, warmup), statistics.mean(per_step),
                   run.info("n_params") * 4, run.dir, step_samples(run, warmup))


def fit_link(rows: list[LinkRow]) -> LinkFit:
    """Least squares of t = t0 + slope / L over the rows; the counted slope beside it."""
    import numpy as np
    if len(rows) < 2:
        raise ValueError("a fit needs at least two link speeds")
    slope, t0 = np.polyfit([1 / r.link_mbit for r in rows], [r.step_s for r in rows], 1)
    counted = statistics.mean(r.link_bytes for r in rows) * 8 / 1e6
    return LinkFit(float(t0), float(slope), counted)


def slope_ratios(rows: list[LinkRow], fit: LinkFit) -> list[float]:
    """The fit repeated once per step: the k-th step after warm-up of every link speed, fitted
    as fit_link fits the medians, each fit's slope over the counted one. Their spread is what
    one run's noise does to the fitted slope."""
    import numpy as np
    x = [1 / r.link_mbit for r in rows]
    n = min(len(r.steps) for r in rows)
    return [float(np.polyfit(x, [r.steps[k] for r in rows], 1)[0]) / fit.counted
            for k in range(n)]


def transfer_shares(row: LinkRow, fit: LinkFit) -> list[float]:
    """The share of each step (after warm-up) that the counted bits take at the link's rate."""
    return [fit.counted / row.link_mbit / s for s in row.steps]


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
    fig.update_layout(template="plotly_white", legend=LEGEND_BELOW, height=420, width=760,
                      title="DDP over two nodes: the step against the link's speed",
                      xaxis=dict(title="link speed (Mbit/s, log)", type="log"),
                      yaxis=dict(title="step time (ms, log)", type="log"))
    return fig


@dataclass
class RaceRow:
    """One way of training over the slow link, measured."""
    name: str
    seconds: list[float]  # rank 0's wall clock at each step's end, from the first step's start
    losses: list[float]  # per step, the mean over the ranks (each its own rows)
    link_bytes: float  # bytes each node's link sent per step (mean over the nodes and steps)
    grad_bytes: int
    run_dir: str
    averages: int  # diloco: steps after the first that averaged (the bytes' window); else 0

    @property
    def step_s(self) -> float:
        """Seconds per step over the whole run (averaging steps included)."""
        return self.seconds[-1] / len(self.seconds)

    def final_loss(self, last: int = 5) -> float:
        """The mean of the last `last` steps' losses (one step's loss is one batch's: noisy)."""
        return statistics.mean(self.losses[-last:])

    def step_seconds(self) -> list[float]:
        """Each step's own seconds, from the wall clock at the steps' ends."""
        return [b - a for a, b in zip([0.0, *self.seconds], self.seconds)]


def slow_link_ways(base, names=None) -> dict:
    """The ways of training the race compares (name -> RunConfig), all from `base` (its
    model, batch, steps, nodes and link): `names` picks some, in this order."""
    ways = {
        "ddp": base.replace(strategy="ddp"),
        "ddp, top-k 1%": base.replace(strategy="ddp", compress="topk", topk_ratio=0.01),
        "ddp-torch, PowerSGD r=2": base.replace(strategy="ddp-torch", compress="powersgd",
                                                powersgd_rank=2),
        "local SGD, H=8": base.replace(strategy="diloco", sync_every=8, outer_lr=1.0,
                                       outer_momentum=0.0),
        "DiLoCo, H=8": base.replace(strategy="diloco", sync_every=8),  # outer 0.7, Nesterov 0.9
    }
    return ways if names is None else {n: ways[n] for n in names}


def slow_link_race(ways: dict, done: dict | None = None) -> list[RaceRow]:
    """Train each RunConfig of `ways` (name -> config across nodes) in turn; `done`: name ->
    a finished run to reuse. Every way trains the same model on the same global batches."""
    done = done or {}
    rows = []
    for name, cfg in ways.items():
        if cfg.nodes < 2:
            raise ValueError(f"{name}: nodes={cfg.nodes}; the race runs across nodes (>= 2)")
        run = done.get(name) or launch(cfg, block=True)
        rows.append(race_row(name, run))
    return rows


def race_row(name: str, run) -> RaceRow:
    events = run.history("step", rank=0)
    start = events[0]["time"] - events[0]["step_s"]
    per_step = steps_link_bytes(run)
    if per_step is None:
        raise RuntimeError(f"{name}: its step events carry no link counters (a run across "
                           "simulated nodes logs them) or it ran fewer than 2 steps")
    averages = sum(1 for e in events[1:] if e.get("diloco", {}).get("synced"))
    return RaceRow(name, [e["time"] - start for e in events], run.losses(),
                   statistics.mean(per_step), run.info("n_params") * 4, run.dir, averages)


def steps_link_bytes(run) -> list[float] | None:
    """Bytes each node's link sent per step, from the counters its ranks read at each step's
    end (distlab.caller.cluster_run.rank_link_bytes_per_step)."""
    from distlab.caller.cluster_run import rank_link_bytes_per_step
    return rank_link_bytes_per_step(run)


def race_figure(rows: list[RaceRow], link_mbit: float, target: float | None = None) -> go.Figure:
    """Loss against wall-clock time, one line per way of training; `target`: a loss to race
    to, drawn as a dotted line."""
    fig = go.Figure()
    if target is not None:
        fig.add_hline(y=target, line=dict(dash="dot", color="gray"),
                      annotation_text=f"target {target:.3f}", annotation_position="top right")
    for r in rows:
        fig.add_scatter(x=r.seconds, y=r.losses, mode="lines+markers", marker=dict(size=4),
                        name=f"{r.name}: {r.link_bytes / r.grad_bytes:.3f}x gradients per step",
                        hovertemplate="%{x:.1f} s: loss %{y:.3f}<extra>" + r.name + "</extra>")
    fig.update_layout(template="plotly_white", legend=LEGEND_BELOW, height=440, width=820,
                      title=f"Training over a {link_mbit:g} Mbit/s link: loss against time "
                            "(measured)",
                      xaxis=dict(title="wall-clock seconds since the first step"),
                      yaxis=dict(title="loss (mean over the ranks' rows)"))
    return fig


def race_target(row: RaceRow, window: int = 5) -> float:
    """A loss the row's run reached: its loss half-way through, averaged over `window` steps
    (the mean of the window ending at the middle step)."""
    middle = max(len(row.losses) // 2, min(window, len(row.losses))) - 1
    return statistics.mean(row.losses[max(0, middle - window + 1):middle + 1])


def reach_step(row: RaceRow, target: float, window: int = 5) -> int | None:
    """The index of the first step where the loss, averaged over the last `window` steps, is
    at most `target`; None if it never is."""
    window = min(window, len(row.losses))
    for i in range(window - 1, len(row.losses)):
        if statistics.mean(row.losses[i - window + 1:i + 1]) <= target:
            return i
    return None


def reach_time(row: RaceRow, target: float, window: int = 5) -> float | None:
    """Wall-clock seconds at the first step where the loss, averaged over the last `window`
    steps, is at most `target`; None if it never is."""
    i = reach_step(row, target, window)
    return None if i is None else row.seconds[i]


def reach_samples(row: RaceRow, target: float, warmup: int = 2,
                  window: int = 5) -> list[float] | None:
    """The time to reach `target` as (steps it took) × (one step's seconds), once per step
    after warm-up: the steps to reach it do not depend on the clock, the step's seconds do, and
    their spread is the verdict's. None if the row never reaches it. (Uniform steps only: a
    way whose steps differ by kind, DiLoCo's averaging steps, is not timed this way.)"""
    i = reach_step(row, target, window)
    if i is None:
        return None
    return [(i + 1) * s for s in row.step_seconds()[warmup:]]


def hsdp_study(nodes: int = 2, ranks: int = 2, link_mbit: float = 100.0, steps: int = 6,
               timeout_s: float = 600) -> dict:
    """distlab.studies.hsdp in simulated nodes: one torchrun agent per node, the four ways of
    sharding (ours and FSDP2's, HSDP and over all ranks) timed with node 0's link counted.
    Returns the study's result per way ("seconds", "frames", "payload", "formula", "losses");
    raises RuntimeError with the nodes' output if one failed. Needs root (the cluster)."""
    from distlab.studies import run_in_nodes
    return run_in_nodes("distlab.studies.hsdp", ["--steps", str(steps)], nodes, ranks,
                        link_mbit, timeout_s)["ways"]


def hsdp_figure(ways: dict) -> go.Figure:
    """Each way's link payload per step (measured bars) beside HSDP's formula (markers)."""
    names = list(ways)
    fig = go.Figure()
    fig.add_bar(x=names, y=[ways[n]["payload"] / 2**20 for n in names],
                name="payload on node 0's link per step (measured)",
                customdata=[1e3 * ways[n]["seconds"] for n in names],
                hovertemplate="%{x}: %{y:.2f} MiB a step, step %{customdata:.0f} ms<extra></extra>")
    formula = [n for n in names if ways[n]["formula"]]
    fig.add_scatter(x=formula, y=[ways[n]["formula"] / 2**20 for n in formula], mode="markers",
                    marker=dict(symbol="line-ew-open", size=40, line=dict(width=3)),
                    name="modelled: g · 2(n−1)/n · shard bytes")
    fig.update_layout(template="plotly_white", legend=LEGEND_BELOW, height=400, width=760,
                      title="What crosses the slow link per step: HSDP against sharding over "
                            "every rank",
                      yaxis=dict(title="MiB per step"))
    return fig


def node_fault_study(cfg, kill_after: int):
    """distlab.studies.node_fault in a folder of the runs root (node-fault-<time>/uninterrupted
    and node-killed): cfg uninterrupted, then with node 1 killed after `kill_after` steps and
    replaced. Needs root (the cluster)."""
    import os
    import time

    from distlab.caller.launch import runs_root
    from distlab.studies.node_fault import node_fault
    folder = os.path.join(runs_root(cfg.runs_root), time.strftime("node-fault-%Y%m%d-%H%M%S"))
    return node_fault(cfg, kill_after, folder)


def node_fault_figure(r) -> go.Figure:
    """Loss per step: the uninterrupted run, the recovered one (lines), and the steps the first
    try ran before node 1 died (markers): they and their re-run after the resume coincide."""
    steps = sorted(r.uninterrupted)
    fig = go.Figure()
    fig.add_scatter(x=steps, y=[r.uninterrupted[s] for s in steps], name="uninterrupted",
                    line=dict(width=6, color="lightgray"))
    fig.add_scatter(x=steps, y=[r.recovered[s] for s in steps], name="node 1 killed, replaced",
                    line=dict(width=2, color="firebrick"))
    fig.add_scatter(x=r.rerun, y=[r.first_try[s] for s in r.rerun], mode="markers",
                    marker=dict(symbol="x", size=10, color="black"),
                    name="steps lost with the node (run again after the resume)")
    fig.add_vline(x=r.killed_after_step + 0.5, line_dash="dot",
                  annotation_text=f"node 1 killed; resumed from step {r.resumed_from}")
    fig.update_layout(template="plotly_white", legend=LEGEND_BELOW, height=380, width=760,
                      title="A node dies mid-run: the elastic restart resumes from the last "
                            "checkpoint", xaxis_title="step", yaxis_title="loss")
    return fig


# -- where each kind of parallelism sits: inside a node or across the link ----------------------
# Each layout is `3d` on 2 ranks, so one formula (distlab.theory.comm_bytes.predicted_bytes)
# counts what each sends: ZeRO-1 data parallel, Megatron tensor parallel, a 2-stage pipeline
# (the theory's ring bytes, with gloo's reduce-scatter counted as gloo writes it).
PLACEMENTS = {"DP (ZeRO-1)": {}, "TP": {"tp": 2}, "PP, 4 micro-batches": {"pp": 2,
                                                                          "microbatches": 4}}


@dataclass
class PlacementRow:
    name: str
    inside_s: float  # median step, both ranks in one node (its loopback)
    across_s: float  # median step, one rank on each of two nodes (the link between)
    link_bytes: float  # bytes each node's link sent per step (ranks' counters; nodes' mean)
    formula_bytes: float  # what rank 0 writes per step, by formula: all of it crosses the link
    link_mbit: float
    planner_added_s: float = float("nan")  # distlab.theory.plan: comm across − comm inside
    inside_steps: list[float] = field(default_factory=list)  # each step after warm-up (s)
    across_steps: list[float] = field(default_factory=list)

    @property
    def planner_s(self) -> float:
        """Modelled by the planner: the step inside a node plus what its two-tier α-β model
        says the link adds (its ring formulas, fp32)."""
        return self.inside_s + self.planner_added_s

    @property
    def predicted_s(self) -> float:
        """Modelled: the step inside a node plus the formula's bytes at the link's rate (β
        only: this link has no added delay)."""
        return self.inside_s + 8 * self.formula_bytes / (self.link_mbit * 1e6)

    @property
    def added_s(self) -> float:
        """What the link adds to the step: the cost of placing this layout across nodes."""
        return self.across_s - self.inside_s

    def added_samples(self) -> list[float]:
        """What the link adds, once per step after warm-up: step k across less step k inside
        (two runs, so a pair shares no moment: the difference carries both runs' spread)."""
        return [a - b for a, b in zip(self.across_steps, self.inside_steps)]


def placement_study(base, link_mbit: float, warmup: int = 2,
                    node_Bps: float = float("inf")) -> list[PlacementRow]:
    """Each of PLACEMENTS on 2 ranks: inside one node, then across two over `link_mbit`.
    node_Bps: the planner's fast tier, bytes per second inside a node (measured elsewhere)."""
    from distlab.theory.comm_bytes import predicted_bytes
    rows = []
    for name, knobs in PLACEMENTS.items():
        cfg = base.replace(strategy="3d", world_size=2, **knobs)
        rows.append(placement_row(
            name, cfg, link_mbit, warmup,
            sum(b * GLOO_WRITES.get(kind, 1) for kinds in predicted_bytes(cfg, 0).values()
                for kind, b in kinds.items()),
            planner_comm_s(cfg, 1, link_mbit, node_Bps) - planner_comm_s(cfg, 2, link_mbit,
                                                                         node_Bps)))
    return rows


def placement_row(name: str, cfg, link_mbit: float, warmup: int, formula_bytes: float,
                  planner_added_s: float = float("nan")) -> PlacementRow:
    """cfg run twice, all its ranks in one node and then over cfg.processes // 2 ranks per
    node across two nodes joined by `link_mbit`, as one row."""
    inside = launch(cfg.replace(nodes=1)).wait(progress=False)
    across = launch(cfg.replace(nodes=2, link_mbit=link_mbit)).wait(progress=False)
    per_node = steps_link_bytes(across) or [float("nan")]
    return PlacementRow(name, median_step(inside, warmup), median_step(across, warmup),
                        statistics.mean(per_node), formula_bytes, link_mbit, planner_added_s,
                        step_samples(inside, warmup), step_samples(across, warmup))


# 3d at dp = tp = 2 on two nodes of two ranks: the rank order decides which group's two
# members sit on different nodes, i.e. whose traffic crosses the link (distlab.parallel.mesh)
ORDERS_ACROSS = {"TP inside, DP across": "tp-dp-pp", "TP across, DP inside": "dp-tp-pp"}


def order_study(base, link_mbit: float, warmup: int = 2) -> list[PlacementRow]:
    """`3d` with dp = tp = 2 on 4 ranks in each order of ORDERS_ACROSS: all four ranks in one
    node, then two nodes of two ranks over `link_mbit`. The same degrees, the same compute;
    only which group crosses the link differs."""
    rows = []
    for name, order in ORDERS_ACROSS.items():
        cfg = base.replace(strategy="3d", world_size=4, tp=2, pp=1, mesh_order=order)
        rows.append(placement_row(name, cfg, link_mbit, warmup, node_link_formula(cfg, 2)))
    return rows


def node_link_formula(cfg, ranks_per_node: int) -> int:
    """Bytes per step the first node's ranks send to other nodes, by formula
    (theory.comm_bytes.predicted_bytes, gloo's writes): a group with a member on another node
    sends all of it across when, as here, each node holds one member of the group. torchrun
    gives each node a block of consecutive ranks (which block is the rendezvous's choice; the
    layouts here are the same from either node)."""
    from distlab.parallel.mesh import layout
    from distlab.theory.comm_bytes import predicted_bytes
    groups = layout(cfg.dp_degree, cfg.tp, cfg.pp, cfg.mesh_order)
    total = 0
    for rank in range(ranks_per_node):
        for kind, sent in predicted_bytes(cfg, rank).items():
            group = next(g for g in groups[kind] if rank in g)
            if any(member // ranks_per_node != 0 for member in group):
                total += sum(b * GLOO_WRITES.get(k, 1) for k, b in sent.items())
    return total


def planner_comm_s(cfg, gpus_per_node: int, link_mbit: float, node_Bps: float) -> float:
    """distlab.theory.plan's communication seconds per step for cfg's `3d` layout on
    cfg.world_size ranks, `gpus_per_node` to a node: inside a node at node_Bps, between nodes
    at the link's rate (no α: tc's tbf adds no delay), fp32 values, ZeRO-1 for dp."""
    from distlab.comm import Link
    from distlab.theory import plan as P
    model = P.Model(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.seq_len, cfg.vocab_size)
    cluster = P.Cluster(cfg.world_size, gpus_per_node=gpus_per_node,
                        intra=Link("inside a node", 0.0, node_Bps, "measured"),
                        inter=Link("the link", 0.0, link_mbit * 1e6 / 8, "tc tbf"))
    dp = cfg.world_size // (cfg.tp * cfg.pp)
    micro = cfg.global_batch // dp // cfg.microbatches
    row = P.evaluate(model, cluster, cfg.global_batch, dp, cfg.tp, cfg.pp, 1, micro, "none",
                     mfu=1.0, value_bytes=4)
    return row.dp_comm_s + row.tp_comm_s + row.pp_comm_s


# gloo's reduce-scatter writes what an all-reduce does, 2(N-1)/N of the buffer, twice the
# ring's (measured: tests/test_wire.py); the other collectives write the ring's bytes
GLOO_WRITES = {"reduce_scatter": 2}


def ranking(values: dict) -> list[str]:
    """Names from the smallest value to the largest."""
    return sorted(values, key=values.get)


def placement_figure(rows: list[PlacementRow], title: str = "Where each kind of parallelism "
                     "sits: 2 ranks inside a node or across the link") -> go.Figure:
    """Step time inside a node and across the link, measured, beside the modelled one."""
    names = [r.name for r in rows]
    fig = go.Figure()
    fig.add_bar(x=names, y=[1e3 * r.inside_s for r in rows], name="inside one node (measured)")
    fig.add_bar(x=names, y=[1e3 * r.across_s for r in rows],
                name=f"across a {rows[0].link_mbit:g} Mbit/s link (measured)",
                customdata=[r.link_bytes / 2**20 for r in rows],
                hovertemplate="%{x}: %{y:.0f} ms, %{customdata:.2f} MiB over the link a step"
                              "<extra></extra>")
    fig.add_scatter(x=names, y=[1e3 * r.predicted_s for r in rows], mode="markers",
                    marker=dict(symbol="line-ew-open", size=40, line=dict(width=3)),
                    name="modelled: inside + formula bytes / link rate")
    if any(math.isfinite(r.planner_s) for r in rows):  # the order study has no planner term
        fig.add_scatter(x=names, y=[1e3 * r.planner_s for r in rows], mode="markers",
                        marker=dict(symbol="diamond-open", size=12, line=dict(width=2)),
                        name="planner (distlab.theory.plan): inside + its comm across − inside")
    fig.update_layout(template="plotly_white", legend=LEGEND_BELOW, barmode="group", height=400, width=760,
                      title=title, yaxis=dict(title="ms per step"))
    return fig


def fast_tier_Bps(mib: float = 8.0, repeats: int = 3) -> float:
    """The fast tier inside a node, bytes per second: an all-reduce of `mib` MiB between two
    ranks over this machine's loopback (the path a simulated node's own ranks talk over),
    S / the median seconds, as the planner's ring formulas count S."""
    from distlab.caller.launch import run_ranks
    seconds = run_ranks(_all_reduce_seconds, 2, mib, repeats, timeout_s=120)[0]
    return mib * 2**20 / statistics.median(seconds)


def _all_reduce_seconds(rank, world, device, log, mib: float, repeats: int) -> list[float]:
    """Rank side of fast_tier_Bps: barrier to barrier, after one untimed all-reduce (gloo
    sets its buffers up on the first)."""
    import time

    import torch
    import torch.distributed as dist
    t = torch.ones(int(mib * 2**20) // 4)
    out = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        dist.barrier()
        if i:
            out.append(time.perf_counter() - t0)
    return out


# -- all-reduce across the link: flat ring, hierarchical, the backend's ------------------------
@dataclass
class AllReduceRow:
    name: str
    seconds: float  # median of the repeats, barrier to barrier (distlab.studies.two_tier)
    link_bytes: float | None  # node 0's link, bytes sent per all-reduce (its counter)
    formula_bytes: float | None  # what the algorithm sends from a node over its link
    modelled_s: float | None  # two-tier α-β: the link's bytes at its rate, plus the fast tier
    samples: list[float] = field(default_factory=list)  # every repeat (algorithms interleaved)


def two_tier_study(nodes: int = 2, ranks: int = 2, link_mbit: float = 100.0,
                   mib: float = 16.0, repeats: int = 3) -> list[AllReduceRow]:
    """distlab.studies.two_tier in simulated nodes: each algorithm's all-reduce of `mib` MiB
    timed, node 0's link counted, beside the two-tier model (β of the link; the fast tier's
    time is the study's own "within a node" all-reduce, measured). Needs root."""
    from distlab.studies import run_in_nodes
    res = run_in_nodes("distlab.studies.two_tier",
                       ["--mib", str(mib), "--repeats", str(repeats)], nodes, ranks, link_mbit,
                       timeout_s=600)
    from distlab.theory.comm_bytes import all_reduce_link_bytes
    rate = link_mbit * 1e6 / 8  # bytes per second
    within = res["within a node"]["seconds"]
    formula = all_reduce_link_bytes(mib * 2**20, ranks, nodes)
    # the hierarchical ones do an all-reduce's worth of work inside the node besides the link
    # (reduce-scatter before, all-gather after)
    fast = {"flat ring": 0.0, "hierarchical": within, "hierarchical, one flow": within}
    return [AllReduceRow(name, res[name]["seconds"], res[name]["link_sent"],
                         formula.get(name),
                         formula[name] / rate + fast[name] if name in formula else None,
                         res[name]["samples"])
            for name in ("flat ring", "hierarchical", "hierarchical, one flow", "backend",
                         "within a node")]


def two_tier_figure(rows: list[AllReduceRow], mib: float, link_mbit: float) -> go.Figure:
    """Each algorithm's all-reduce time, measured, beside the two-tier model's."""
    names = [r.name for r in rows]
    fig = go.Figure()
    fig.add_bar(x=names, y=[r.seconds for r in rows], name="measured",
                customdata=[None if r.link_bytes is None else r.link_bytes / 2**20 for r in rows],
                hovertemplate="%{x}: %{y:.2f} s, %{customdata:.1f} MiB over node 0's link"
                              "<extra></extra>")
    model = [r for r in rows if r.modelled_s is not None]
    fig.add_scatter(x=[r.name for r in model], y=[r.modelled_s for r in model], mode="markers",
                    marker=dict(symbol="line-ew-open", size=40, line=dict(width=3)),
                    name="modelled: link bytes / rate (+ the fast tier)")
    fig.update_layout(template="plotly_white", legend=LEGEND_BELOW, height=400, width=760,
                      title=f"All-reduce of {mib:g} MiB across a {link_mbit:g} Mbit/s link",
                      yaxis=dict(title="seconds"))
    return fig
