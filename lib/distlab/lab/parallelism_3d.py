"""Caller-side helpers of the 3D-parallelism notebook (workbook/07_3d_parallelism): who talks to
whom over which group of a `3d` run, bytes per group measured beside the formula, the rank×rank
traffic matrix, the layouts a world size allows, the planner's ranking of layouts, and a widget
that re-runs the real `3d` training.

Nothing here runs inside a rank or changes how anything trains; it reads what the runs logged
(e["mesh"]["comm"], written by distlab.parallel.mesh.ThreeD.step_info: per group kind, the
collective stats of this rank's Comm on that group in one step).

Bytes per step and rank, the formulas (tests/test_mesh.py derives them; B global batch, T
sequence length, h hidden size, m micro-batches, L_s = n_layer/pp blocks per stage, fp32):
    S  = (B/dp/m)·T·h·4, one micro-batch's residual stream on one dp replica
    tp   4·L_s·m all-reduces of S, each 2(t-1)/t·S sent: f and g of Megatron's attention and MLP,
         forward and backward (Shoeybi et al. 2019, Section 3), ring "bus bytes" (distlab.comm)
    pp   per micro-batch one activation to the next stage, one gradient to the previous one
         (Narayanan et al. 2021, Section 2.2): m·S each way per stage boundary; every tp rank
         sends the whole S (Megatron's scatter/gather of it over tp is not written here)
    dp   ZeRO-1 (Rajbhandari et al. 2020, Section 7): a reduce-scatter of the gradients and an
         all-gather of the updated parameters, each (dp-1)/dp·4·P, P = this rank's parameter
         count Ψ_r padded to a multiple of dp
"""

from __future__ import annotations

import html
import math

import ipywidgets as W
import plotly.graph_objects as go
import torch.distributed as dist
from plotly.subplots import make_subplots

from distlab.config import RunConfig
from distlab.lab.common import RUN_COLORS as COLORS, byte_unit, html_table
from distlab.lab.runs import launch_together, worst_param_diff
from distlab.lab.panel import Explorer
from distlab.parallel.mesh import KINDS, Mesh, layout
from distlab.step_event import bytes_sent
from distlab.theory.comm_bytes import link_seconds, messages_per_step, predicted_bytes, rank_numel

FP32 = 4
SOURCES = {"tp": "Shoeybi et al. 2019 (Megatron-LM), f/g all-reduces; ring bus bytes",
           "pp": "Narayanan et al. 2021, one activation / gradient per micro-batch and boundary",
           "dp": "Rajbhandari et al. 2020 (ZeRO), reduce-scatter + all-gather = all-reduce"}
FORMULAS = {"tp": "4·L_s·m · 2(t−1)/t·S per rank",
            "pp": "m·S per boundary, each way",
            "dp": "2 · (dp−1)/dp · 4P per rank"}


# -- layouts -------------------------------------------------------------------------------------
def mesh_config(base: RunConfig, dp: int, tp: int, pp: int, **changes) -> RunConfig:
    """base as a `3d` run on a dp × tp × pp mesh (RunConfig validates it)."""
    return base.replace(strategy="3d", world_size=dp * tp * pp, tp=tp, pp=pp, **changes)


def valid_layouts(base: RunConfig, world: int, microbatches: int | None = None,
                  schedule: str | None = None) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) with dp·tp·pp = world that RunConfig accepts for `3d` on base's model (tp
    divides the heads, pp the layers, 1F1B has m >= pp, ...) and whose per-replica batch
    splits into m equal micro-batches."""
    m = microbatches or base.microbatches
    out = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            try:
                cfg = mesh_config(base, dp, tp, pp, microbatches=m,
                                  schedule=schedule or base.schedule)
            except ValueError:
                continue
            if cfg.global_batch % (dp * m) == 0:
                out.append((dp, tp, pp))
    return sorted(out, key=lambda d: (-d[0], d[1]))


def peers(rank: int, dp: int, tp: int, pp: int) -> dict[str, list[int]]:
    """{group kind: the members of `rank`'s group of that kind} on a dp × tp × pp mesh: whom
    it talks to over tp, dp and pp."""
    return {k: next(g for g in groups if rank in g) for k, groups in layout(dp, tp, pp).items()}


# -- the formulas --------------------------------------------------------------------------------


# -- the measurements ----------------------------------------------------------------------------
def measured_bytes(step_events) -> dict[int, dict[str, dict[str, dict]]]:
    """{rank: {group kind: {collective: {"calls", "bytes_sent"}}}} per step, from `3d` step
    events (any iterable of them: Run.history("step"), or a test's lists). Raises if a rank
    moved different bytes in different steps: the table below shows one step for all."""
    seen: dict[int, dict] = {}
    for e in step_events:
        comm = {k: {c: {"calls": v["calls"], "bytes_sent": v["bytes_sent"]}
                    for c, v in e["mesh"]["comm"][k].items()} for k in KINDS}
        if seen.setdefault(e["rank"], comm) != comm:
            raise ValueError(f"rank {e['rank']}: step {e['step']} moved other bytes than "
                             f"its first step: {comm} vs {seen[e['rank']]}")
    return dict(sorted(seen.items()))


def group_rows(cfg: RunConfig, step_events) -> list[dict]:
    """One row per group of the mesh: kind, member ranks, collectives with calls per step,
    bytes per step measured (sum over the members) and by formula, and the formula's source."""
    got = measured_bytes(step_events)
    rows = []
    for kind in KINDS:
        for i, ranks in enumerate(layout(cfg.dp_degree, cfg.tp, cfg.pp, cfg.mesh_order)[kind]):
            calls: dict[str, int] = {}
            measured = predicted = 0
            for r in ranks:
                for coll, v in got[r][kind].items():
                    calls[coll] = calls.get(coll, 0) + v["calls"]
                    measured += v["bytes_sent"]
                predicted += sum(predicted_bytes(cfg, r)[kind].values())
            rows.append({"kind": kind, "group": i, "ranks": list(ranks),
                         "collectives": {c: n // len(ranks) for c, n in calls.items()},
                         "measured": measured, "predicted": predicted,
                         "formula": FORMULAS[kind], "source": SOURCES[kind]})
    return rows


def group_table_rows(rows: list[dict]) -> list[list]:
    """group_rows as Markdown table rows. Groups of one rank (tp = 1, say: every rank its own
    tp group) send nothing: those of a kind that booked and were predicted no byte are folded
    into one line saying so, instead of a row per rank reading "all_reduce ×64, 0"."""
    out, alone = [], {}
    for r in rows:
        if len(r["ranks"]) == 1 and r["measured"] == r["predicted"] == 0:
            alone.setdefault(r["kind"], []).append(r)
            continue
        out.append([r["kind"], " ".join(map(str, r["ranks"])),
                    ", ".join(f"{c} ×{n}" for c, n in r["collectives"].items()) or "none",
                    f"{r['measured']:,}", f"{r['predicted']:,}", r["formula"], r["source"]])
    for kind, rs in alone.items():
        out.append([kind, f"{len(rs)} groups of one rank each",
                    "none on the wire: a group of one rank sends nothing", "0", "0",
                    rs[0]["formula"], rs[0]["source"]])
    return out


GROUP_HEADER = ["group", "ranks", "collectives per rank per step", "bytes per step, booked",
                "bytes per step, formula", "formula", "source"]


def wire_rows(step_events) -> list[dict]:
    """Per rank, at its last step: the bytes booked over all its groups, the bytes the kernel
    saw it write (distlab.wire; None where it cannot see them), and the wire bytes the ledger
    could pin on one group kind's calls alone (the blocking ones; tp's async all-reduces and
    pp's sends overlap, so theirs are measured jointly)."""
    last: dict[int, dict] = {}
    for e in step_events:
        if e["step"] >= last.get(e["rank"], {"step": -1})["step"]:
            last[e["rank"]] = e
    rows = []
    for r, e in sorted(last.items()):
        booked = bytes_sent(e)  # every group's (distlab.step_event)
        w = e.get("wire", {})
        alone = {k: v for k, v in (w.get("by_kind") or {}).items() if "+" not in k}
        rows.append({"rank": r, "booked": booked, "wire": w.get("sent"), "alone": alone,
                     "why": w.get("why")})
    return rows


def per_kind_per_rank(step_events) -> dict[str, float]:
    """Bytes a rank sends per step over each group kind, averaged over the ranks."""
    got = measured_bytes(step_events)
    return {k: sum(sum(v["bytes_sent"] for v in g[k].values()) for g in got.values()) / len(got)
            for k in KINDS}


def kind_bytes(step_events, rank: int) -> dict[str, int]:
    """Bytes `rank` sends per step over each group kind."""
    got = measured_bytes(step_events)[rank]
    return {k: sum(v["bytes_sent"] for v in got[k].values()) for k in KINDS}


def calls_with_bytes(step_events, rank: int) -> dict[str, int]:
    """Calls `rank` makes per step over each group kind, counting only those that carried
    bytes (a group of one rank calls its collectives, but sends nothing)."""
    got = measured_bytes(step_events)[rank]
    return {k: sum(v["calls"] for v in got[k].values() if v["bytes_sent"]) for k in KINDS}


def traffic_matrix(cfg: RunConfig, step_events) -> tuple[list[list[int]], list[list[str]]]:
    """rank × rank bytes sent per step, and the group kind of each pair. pp sends are counted
    by peer (activations go to the next stage, gradients to the previous). The collectives'
    bytes are modelled ring bus bytes (distlab.comm): each member sends its share to the next
    member of its group's ring, which is exact for groups of 2 and the ring model's
    attribution for larger ones."""
    got = measured_bytes(step_events)
    n = cfg.world_size
    M = [[0] * n for _ in range(n)]
    K = [[""] * n for _ in range(n)]
    lay = layout(cfg.dp_degree, cfg.tp, cfg.pp, cfg.mesh_order)
    for kind in KINDS:
        for ranks in lay[kind]:
            for j, r in enumerate(ranks):
                for coll, v in got[r][kind].items():
                    if kind == "pp":
                        dst = ranks[j + 1] if coll == "pp_send_act" else ranks[j - 1]
                    else:
                        dst = ranks[(j + 1) % len(ranks)]
                    if v["bytes_sent"] and dst != r:
                        M[r][dst] += v["bytes_sent"]
                        K[r][dst] = kind
    return M, K


# -- figures -------------------------------------------------------------------------------------
def traffic_heatmap(fig, cfg: RunConfig, step_events, row=None, col=None, colorbar_x=None):
    """Add the traffic matrix as a heatmap (bytes per step in one unit, common.byte_unit) to
    fig, cells labelled by group (colorbar_x: where its colour bar goes, for a heatmap in a
    left subplot)."""
    M, K = traffic_matrix(cfg, step_events)
    n = len(M)
    scale, unit = byte_unit([v for r in M for v in r])  # one unit for every cell
    text = [[f"{K[i][j]}<br>{M[i][j] / scale:.3g}" if M[i][j] else "" for j in range(n)]
            for i in range(n)]
    kw = dict(row=row, col=col) if row else {}
    fig.add_heatmap(z=[[v / scale for v in r] for r in M], x=[f"to {j}" for j in range(n)],
                    y=[f"rank {i}" for i in range(n)], text=text, texttemplate="%{text}",
                    colorscale="Blues",
                    colorbar=dict(title=f"{unit}/step", len=0.8, x=colorbar_x),
                    customdata=M, hovertemplate=f"%{{y}} → %{{x}}: %{{z:.3g}} {unit} per step "
                                                "(%{customdata:,} bytes)<extra></extra>", **kw)
    fig.update_xaxes(title_text="receiver", **kw)
    fig.update_yaxes(title_text="sender", autorange="reversed", **kw)
    return fig


def traffic_figure(cfg: RunConfig, step_events, title: str = "") -> go.Figure:
    """Who sends how many bytes to whom in one step: one cell per (sender, receiver)."""
    fig = traffic_heatmap(go.Figure(), cfg, step_events)
    fig.update_layout(title=title or f"3d, dp={cfg.dp_degree} × tp={cfg.tp} × pp={cfg.pp}: "
                      "bytes sent per step, sender → receiver, by group",
                      height=160 + 45 * cfg.world_size, width=220 + 70 * cfg.world_size,
                      template="plotly_white")
    return fig


# -- ZeRO-1 over dp ------------------------------------------------------------------------------
def zero1_optim_rows(run) -> list[dict]:
    """Per rank of an AdamW `3d` run: optimizer-state bytes measured (e["memory"]["optim"],
    from the tensors) beside ZeRO-1's formula 2·4·P/dp + 4 (exp_avg and exp_avg_sq of the
    rank's shard of its padded flat buffer, plus AdamW's 4-byte step counter) and what an
    unsharded optimizer would hold, 2·4·Ψ_r + 4."""
    cfg = run.cfg
    dp = cfg.dp_degree
    rows = []
    last = max(e["step"] for e in run.history("step"))
    for e in sorted(run.history("step"), key=lambda e: e["rank"]):
        if e["step"] != last:
            continue
        numel = rank_numel(cfg, e["rank"])
        P = math.ceil(numel / dp) * dp
        rows.append({"rank": e["rank"], "numel": numel, "zero_numel": e["zero"]["numel"],
                     "measured": e["memory"]["optim"], "formula": 2 * FP32 * P // dp + FP32,
                     "unsharded": 2 * FP32 * numel + FP32})
    return rows


# -- α-β: where each group should sit ------------------------------------------------------------


def placement_seconds(cfg: RunConfig, rank: int, bytes_by_kind: dict, placement: dict) -> dict:
    """Seconds per step each group kind's traffic of `rank` would take with each kind on the
    link `placement` names ({kind: Link})."""
    msgs = messages_per_step(cfg, rank)
    return {k: link_seconds(bytes_by_kind[k], msgs[k], placement[k]) for k in KINDS}


# -- the planner ---------------------------------------------------------------------------------
def best_per_layout(rows) -> list:
    """From plan()'s rows (fastest first): the fastest row of each distinct (dp, tp, pp), in
    rank order."""
    seen, out = set(), []
    for r in rows:
        if (r.dp, r.tp, r.pp) not in seen:
            seen.add((r.dp, r.tp, r.pp))
            out.append(r)
    return out


def layout_rank(rows, dp: int, tp: int, pp: int):
    """(1-based rank among distinct layouts, its best row) of a layout, or (None, None) when
    no configuration of it fits."""
    for i, r in enumerate(best_per_layout(rows)):
        if (r.dp, r.tp, r.pp) == (dp, tp, pp):
            return i + 1, r
    return None, None


def layout_sweep(cases: dict, cluster, named=(), mfu: float = 0.5) -> list[dict]:
    """cases {label: (Model, global batch)}: per case the planner's fastest row ("best", None
    when nothing fits) and, for each (dp, tp, pp) in `named`, (its rank among distinct
    layouts, its best row) from layout_rank."""
    from distlab.theory.plan import plan

    out = []
    for label, (model, batch) in cases.items():
        rows = plan(model, cluster, batch, mfu)
        out.append({"case": label, "model": model, "batch": batch,
                    "best": rows[0] if rows else None,
                    "named": {lay: layout_rank(rows, *lay) for lay in named},
                    "layouts": len(best_per_layout(rows))})
    return out


def layout_standing(case: dict, lay: tuple[int, int, int]) -> str:
    """Where a named layout of a layout_sweep case stands: '#3 of 40, 1.25 s' (its rank among
    the distinct layouts, its best step time), or 'does not fit'."""
    rank, row = case["named"][lay]
    return "does not fit" if rank is None else f"#{rank} of {case['layouts']}, {row.step_s:.2f} s"


def describe_row(r) -> str:
    """'dp 32 × tp 4 × pp 4, ZeRO-1, b=1, no recompute'."""
    rc = {"none": "no recompute", "selective": "selective recompute",
          "full": "full recompute"}[r.recompute]
    return f"dp {r.dp} × tp {r.tp} × pp {r.pp}, ZeRO-{r.zero}, b={r.micro_batch}, {rc}"


# -- the widget ----------------------------------------------------------------------------------
class MeshExplorer(Explorer):
    """World size, a dp × tp × pp layout (only those valid for the world size), micro-batches
    and schedule; Run trains the real `3d` on that mesh (one launch, `base`'s other settings)
    and redraws the bytes-per-group table, the rank × rank traffic heatmap and the loss beside
    `reference` (a `single` Run of `base`). An invalid choice is refused in the status line."""

    def __init__(self, base: RunConfig, reference, worlds=(4, 8), microbatches=(1, 2, 4),
                 schedules=("gpipe", "1f1b")):
        super().__init__()  # Run, Stop, the status line
        self.base, self.reference = base, reference
        style = {"description_width": "initial"}
        self.world = W.Dropdown(options=list(worlds), value=worlds[-1], description="world",
                                style=style)
        self.microbatches = W.Dropdown(options=list(microbatches), value=microbatches[-1],
                                       description="micro-batches", style=style)
        self.schedule = W.Dropdown(options=list(schedules), value=schedules[0],
                                   description="schedule", style=style)
        self.layout = W.Dropdown(description="dp × tp × pp", style=style)
        self.table = W.HTML()
        # the heatmap's colour bar sits in the gap between the subplots, clear of the loss
        # plot's tick labels and axis title
        self.fig = go.Figure(make_subplots(
            rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.24,
            subplot_titles=("bytes sent per step, sender → receiver", "loss")))
        self.fig.update_layout(height=460, template="plotly_white", margin=dict(t=60, b=90),
                               legend=dict(orientation="h", x=1, xanchor="right", y=-0.2,
                                           yanchor="top"))
        self.fig.update_xaxes(title_text="step", row=1, col=2)
        self.fig.update_yaxes(title_text="loss (nats)", row=1, col=2)
        for w in (self.world, self.microbatches, self.schedule):
            w.observe(lambda _c: self._refresh_layouts(), names="value")
        self._refresh_layouts()
        self.last: dict | None = None
        self.widget = self._box([W.HBox([self.world, self.layout, self.microbatches,
                                         self.schedule, self.button, self.stop_button]),
                                 self.status, self.table, self._view_of(self.fig)])

    def _refresh_layouts(self):
        opts = valid_layouts(self.base, self.world.value, self.microbatches.value,
                             self.schedule.value)
        old = self.layout.value
        self.layout.options = [(f"{d} × {t} × {p}", (d, t, p)) for d, t, p in opts]
        if old in opts:
            self.layout.value = old

    def config(self) -> RunConfig:
        if self.layout.value is None:
            raise ValueError(f"no dp × tp × pp layout of world {self.world.value} fits this "
                             f"model with m={self.microbatches.value}, {self.schedule.value}")
        return mesh_config(self.base, *self.layout.value, microbatches=self.microbatches.value,
                           schedule=self.schedule.value)

    def _clear(self):
        super()._clear()
        self.table.value = ""  # the last mesh's bytes, heatmap and loss are not this run's
        self.fig.data = ()

    def _run(self, **values) -> dict:
        """Set the knobs (world=, layout=(dp, tp, pp), microbatches=, schedule=), train,
        redraw; returns {"config", "run", "rows", "param_diff", "loss_diff"} (`run(**values)`,
        or the Run button)."""
        for k in ("world", "microbatches", "schedule", "layout"):
            if k in values:
                w = getattr(self, k)
                if k == "layout" and tuple(values[k]) not in [o[1] for o in w.options]:
                    raise ValueError(f"layout {values[k]} is not valid for world "
                                     f"{self.world.value}; valid: {[o[1] for o in w.options]}")
                w.value = tuple(values[k]) if k == "layout" else values[k]
        cfg = self.config()
        self._announce(f"running 3d {cfg.dp_degree}×{cfg.tp}×{cfg.pp}, m={cfg.microbatches}, "
                       f"{cfg.schedule} ...")
        run = launch_together({"3d": cfg}, name="mesh-explorer", on_start=self._started)["3d"]
        rows = group_rows(cfg, run.history("step"))
        ref = self.reference
        param_diff = max(worst_param_diff(s, ref.states[0]) for s in run.states)
        loss_diff = max(abs(a - b) for a, b in zip(run.losses(), ref.losses()))
        self.table.value = html_table(GROUP_HEADER[:5], [r[:5] for r in group_table_rows(rows)])
        with self.fig.batch_update():
            self.fig.data = ()
            traffic_heatmap(self.fig, cfg, run.history("step"), row=1, col=1,
                            colorbar_x=self.fig.layout.xaxis.domain[1] + 0.01)
            for i, (label, ls) in enumerate((("single", ref.losses()),
                                             (f"3d {cfg.dp_degree}×{cfg.tp}×{cfg.pp}",
                                              run.losses()))):
                self.fig.add_scatter(x=list(range(len(ls))), y=ls, mode="lines+markers",
                                     name=label, row=1, col=2,
                                     line=dict(color=COLORS[i], width=4 - 2 * i))
        self._say(html.escape(
            f"3d {cfg.dp_degree}×{cfg.tp}×{cfg.pp}, m={cfg.microbatches}, {cfg.schedule}: "
            f"worst parameter diff vs single {param_diff:.1e}, loss diff {loss_diff:.1e}; "
            f"bytes per group = formula: {all(r['measured'] == r['predicted'] for r in rows)}"))
        self.last = {"config": cfg, "run": run, "rows": rows, "param_diff": param_diff,
                     "loss_diff": loss_diff}
        return self.last


def mesh_ranks(rank, world, device, log, dims, cfg_dicts=()):
    """Rank function (run_ranks): build Mesh(*dims), return its view from this rank and, if
    configs are given, distlab.rank.train.train_with_state(cfg_dicts) on the same launch."""
    mesh = Mesh(*dims)
    out = {**mesh.describe(), "world": {k: dist.get_world_size(g) for k, g in mesh.groups.items()},
           "group_rank": {k: dist.get_rank(g) for k, g in mesh.groups.items()}}
    if cfg_dicts:
        from distlab.rank.train import train_with_state
        out["runs"] = train_with_state(rank, world, device, log, list(cfg_dicts))
    return out


# -- the claims table's timed row: the planner's order over the repeats -------------------------
def planner_order_claim(pc: dict, tie: float = 0.05) -> dict:
    """The planner's ranking, timed (distlab.studies.plan_check.planned_vs_measured's result):
    for every pair the planner predicts more than `tie` apart, the faster-predicted layout's
    repeats (each its median step, repeats alternating between layouts) must lie below the
    other's (distlab.lab.timed.below). Yes when every such pair is kept, no when one is
    reversed, else undecided (overlapping repeats, fewer than 3, or no pair to test)."""
    from distlab.lab.timed import all_of, below, timed_claim
    rows = pc["rows"]
    pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]
             if b["predicted_s"] > a["predicted_s"] * (1 + tie)]
    holds = all_of(*(below(a["spread_s"], b["spread_s"]) for a, b in pairs)) if pairs else None
    return timed_claim(
        "the planner's ranking holds on the machine it was calibrated on",
        "distlab.studies.plan_check (its top layouts trained, repeats alternating)", holds,
        {f"#{r['rank']} {r['layout']}": r["spread_s"] for r in rows}, interleaved_=True,
        note="each repeat a median step; predicted "
             + ", ".join(f"{r['predicted_s'] * 1e3:.0f}" for r in rows)
             + f" ms; {len(pairs)} pair(s) predicted more than {tie:.0%} apart, tested")
