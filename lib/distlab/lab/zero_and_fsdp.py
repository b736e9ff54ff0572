"""Caller-side helpers of the ZeRO and FSDP notebook (workbook/04_zero_and_fsdp): what a rank
of each strategy holds and sends, read from the runs' step events and set beside the formulas,
the figures that draw them, and a widget that runs one strategy and plots its memory per rank
next to the estimate.

Nothing here runs inside a rank or changes how anything trains: the ranks are
distlab.parallel.zero.stages (zero1/zero2/zero3) and distlab.parallel.zero.zero_torch (zero1-torch,
fsdp-torch); the formulas are distlab.theory.estimate's and distlab.comm's.

    explorer = MemoryExplorer(RunConfig(steps=3, n_layer=2, n_embd=32, n_head=2))
    explorer.widget                              # knobs, Run, status, figure
    explorer.run(strategy="zero3", world_size=4).wait()   # what the Run button does, then wait
    explorer.measured, explorer.estimate         # per-rank bytes, and the estimate drawn
"""

from __future__ import annotations

import html
import math
import time

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from distlab.lab import common, panel as lab
from distlab.config import RunConfig
from distlab.theory.estimate import STAGES, BytesPerParam, zero_model_states
from distlab.caller.launch import launch
from distlab.parallel import strategy_class
from distlab.theory.estimate import estimate_memory
from distlab.theory.zero_memory import zero_reduction, zero_reduction_limit
from distlab.units import GB
from distlab.caller.run import Run
from distlab.step_event import comm, memory

# The strategies the notebook compares, as "stages": DDP keeps everything on every rank.
EXPLORER_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp-torch")
# Model-state categories a step event can carry; "_offloaded" ones live in host memory.
MODEL_STATES = ("params", "grads", "optim")
HOST_CATEGORIES = (("params_offloaded", "parameters (host)"),
                   ("grads_offloaded", "gradients (host)"),
                   ("optim_offloaded", "optimizer state (host)"))
ALL_CATEGORIES = common.MEMORY_CATEGORIES + HOST_CATEGORIES
COLORS = dict(zip([k for k, _ in common.MEMORY_CATEGORIES], common.MEMORY_COLORS))
COLORS.update(params_offloaded=COLORS["params"], grads_offloaded=COLORS["grads"],
              optim_offloaded=COLORS["optim"])
KIND_COLORS = {"all_reduce": "#4c78a8", "reduce_scatter": "#f58518", "all_gather": "#54a24b",
               "broadcast": "#b279a2"}
# What the runs of the explorer offload, by strategy (RunConfig.offload's meaning for each).
OFFLOAD_MEANING = {
    "ddp": "nothing: DDP has no offload",
    "zero1": "optimizer state to the host (ZeRO-Offload)",
    "zero2": "optimizer state to the host (ZeRO-Offload)",
    "zero3": "optimizer state to the host (ZeRO-Offload)",
    "fsdp-torch": "parameter shards, gradients and optimizer state to the host "
                  "(FSDP2 CPUOffloadPolicy)",
}


# -- reading runs ---------------------------------------------------------------------------
def memory_by_rank(run: Run, step: int | None = None) -> list[dict]:
    """Each rank's memory dict (bytes by category) at `step` (default: the last step every
    rank finished), in rank order."""
    step = run.steps_done() - 1 if step is None else step
    return [memory(e) for e in lab.step_events(run, step)]


def zero_info(run: Run) -> dict:
    """e["zero"] of rank 0's last step: the units with their padding and shards, and the step's
    peaks of gathered parameters and flat gradients (distlab.parallel.zero.stages)."""
    return run.history("step", rank=0)[-1]["zero"]


def prefetch_counts(run: Run) -> list[dict]:
    """Rank 0's ZeRO-3 prefetch counts ({"gathers", "prefetched", "blocked_s"}) of every step
    after the first: step 0 records the order in which the units run, so it cannot prefetch."""
    return [e["zero"]["prefetch"] for e in run.history("step", rank=0)[1:]]


def global_norms(run: Run, rank: int = 0) -> list[float]:
    """The global gradient norm one rank logged at each step, in step order: with sharded
    gradients every rank computes the whole model's norm (one all-reduce of ‖g‖²)."""
    return [e["grad_norm"] for e in sorted(run.history("step", rank=rank),
                                           key=lambda e: e["step"])]


def comm_by_step(run: Run, rank: int) -> list[dict]:
    """One rank's {kind: bytes_sent} for every step, in step order."""
    return [{k: v["bytes_sent"] for k, v in comm(e).items()}
            for e in sorted(run.history("step", rank=rank), key=lambda e: e["step"])]


def model_states(mem: dict) -> dict:
    """The model-state entries of a memory dict (device and host), zero ones included."""
    keys = MODEL_STATES + tuple(k for k, _ in HOST_CATEGORIES)
    return {k: mem[k] for k in keys if k in mem}


def total(mem: dict, keys=None) -> int:
    """Sum of a memory dict's entries (all categories, or `keys`); None counts as 0."""
    return sum(v or 0 for k, v in mem.items() if keys is None or k in keys)


def memory_rows(mem: dict[str, list[dict]], est: dict[str, tuple[dict, str]]) -> list[list]:
    """The memory table's rows: rank 0's bytes by category for each strategy, its model states
    over DDP's (mem["ddp"]), and where its estimate comes from (estimate_memory's source)."""
    ddp = total(model_states(mem["ddp"][0]))
    return [[s, f"{m[0]['params']:,}", f"{m[0]['grads']:,}",
             f"{m[0]['optim']:,} / {m[0].get('optim_offloaded', 0):,}", f"{m[0]['activations']:,}",
             f"{m[0]['comm_buffers']:,}", f"{total(model_states(m[0])) / ddp:.3f}", est[s][1]]
            for s, m in mem.items()]


def comm_rows(booked: dict[str, dict], wire: dict[str, dict], model_bytes: float) -> list[list]:
    """The bytes table's rows, one per strategy: what Comm booked on rank 0 in one step, by kind
    and over 4Ψ (`model_bytes`), beside what the kernel saw it write (wire_by_step), over 4Ψ,
    over the booked bytes and over DDP's wire. Dashes where the kernel cannot see the traffic."""
    blind = wire["ddp"]["sent"] is None
    rows = []
    for s, kinds in booked.items():
        sent, on_wire = sum(kinds.values()), wire[s]["sent"]
        seen = ["—"] * 4 if blind else [
            f"{on_wire / model_bytes:.3f}", f"{on_wire / sent:.3f}" if sent else "—",
            f"{on_wire / wire['ddp']['sent']:.2f}x",
            ", ".join(f"{k} {v:,}" for k, v in wire[s]["by_kind"].items())]
        rows.append([s, ", ".join(f"{k} {v:,.0f}" for k, v in kinds.items()) or "nothing",
                     f"{sent / model_bytes:.3f}", *seen])
    return rows


def wire_note(wire_over_ddp: dict[str, float] | None, strategy: str) -> str:
    """A claim's clause on the wire, "; on gloo's wire 1.50× ddp", or "" where the wire was not
    measured (wire_over_ddp None)."""
    return "" if wire_over_ddp is None else f"; on gloo's wire {wire_over_ddp[strategy]:.2f}× ddp"


# -- estimates --------------------------------------------------------------------------------


def stage_rows(psi: float, n_d: int, bpp: BytesPerParam, gpu_bytes: float | None = None,
               offload=(), unit: float = GB) -> list[list]:
    """One row per ZeRO stage of distlab.theory.estimate.zero_model_states: parameters held per GPU,
    then params, grads, optimizer state, device total and host total in `unit` (GB = 1e9 by
    default), and whether the device total fits in gpu_bytes."""
    rows = []
    for stage, name in STAGES.items():
        st = zero_model_states(psi, n_d, stage, bpp, offload)
        held = psi / n_d if stage == 3 else psi
        row = [name, f"{held / 1e9:.2f}B", f"{st.params / unit:.1f}", f"{st.grads / unit:.1f}",
               f"{st.optim / unit:.1f}", f"{st.device / unit:.1f}"]
        if offload:
            row.append(f"{st.host / unit:.1f}")
        if gpu_bytes:
            row.append("yes" if st.device <= gpu_bytes else "no")
        rows.append(row)
    return rows


def per_gpu_rows(psi: float, n_d: int, mixes: dict[str, BytesPerParam]) -> list[list]:
    """One row per bytes-per-parameter mix: its total, and the model states per GPU in GB of
    plain DP and of ZeRO-3 on n_d GPUs (zero_model_states)."""
    rows = []
    for name, bpp in mixes.items():
        dp, z3 = (zero_model_states(psi, n_d, s, bpp).device for s in (0, 3))
        rows.append([name, f"{bpp.total:g}", f"{dp / GB:,.0f}", f"{z3 / GB:.2f}"])
    return rows


def fmt_gb(b: float) -> str:
    """Bytes in the paper's GB (1e9), one decimal: '140.0 GB'."""
    return f"{b / GB:.1f} GB"


def limit_label(stage: int, bpp: BytesPerParam) -> str:
    """zero_reduction_limit as the reduction table writes it: '4x', or ZeRO-3's '= N_d,
    unbounded'."""
    limit = zero_reduction_limit(stage, bpp)
    return "= N_d, unbounded" if math.isinf(limit) else f"{limit:g}x"


def activation_room(gpu_bytes: float, states_bytes: float, per_sequence_bytes: float,
                    gpus: int, seq_len: int) -> dict:
    """How many sequences fit in what the model states leave of a GPU, and the tokens of one
    data-parallel step: free = gpu - states; sequences per GPU = floor(free / per sequence);
    tokens per step = GPUs x sequences per GPU x seq_len."""
    free = gpu_bytes - states_bytes
    per_gpu = max(0, math.floor(free / per_sequence_bytes))
    return {"free": free, "per_gpu": per_gpu, "sequences": gpus * per_gpu,
            "tokens": gpus * per_gpu * seq_len}


def rooms(gpu_bytes: float, ddp_states: float, fsdp_states: float,
          per_sequence: dict[str, float], gpus: int, seq_len: int) -> dict[str, tuple[dict, dict]]:
    """{way of counting a sequence's activations: (DDP's activation_room, FSDP's)}: the same
    GPU, each strategy's model states per GPU."""
    return {mode: (activation_room(gpu_bytes, ddp_states, b, gpus, seq_len),
                   activation_room(gpu_bytes, fsdp_states, b, gpus, seq_len))
            for mode, b in per_sequence.items()}


# -- figures -----------------------------------------------------------------------------------
def memory_figure(groups: dict[str, dict[str, dict | None]], title: str,
                  height: int = 460) -> go.Figure:
    """Stacked bars by memory category, grouped: {group: {bar: memory dict}} (e.g. {"zero2":
    {"rank 0": {...}, "rank 1": {...}, "est.": {...}}}). Host (offloaded) categories are
    hatched; estimate bars (a bar name starting "est") are drawn lighter. None is left out.
    One unit for the axis (common.byte_unit of the tallest stack)."""
    xs = [[], []]
    for g, bars in groups.items():
        for b in bars:
            xs[0].append(g)
            xs[1].append(b)
    scale, unit = common.byte_unit([sum(v or 0 for k, v in (mem or {}).items()
                                        if k in dict(ALL_CATEGORIES))
                                    for bars in groups.values() for mem in bars.values()])
    fig = go.Figure()
    for key, name in ALL_CATEGORIES:
        ys, raw = [], []
        for g, bars in groups.items():
            for b, mem in bars.items():
                v = (mem or {}).get(key)
                ys.append(None if v is None else v / scale)
                raw.append(v)
        if all(v in (None, 0) for v in raw):
            continue
        host = key.endswith("_offloaded")
        fig.add_bar(x=xs, y=ys, name=name, customdata=raw, marker_color=COLORS[key],
                    marker_opacity=[0.45 if b.startswith("est") else 1.0 for b in xs[1]],
                    marker_pattern_shape="/" if host else "",
                    hovertemplate=f"{name}: %{{y:.2f}} {unit} (%{{customdata:,}} bytes)"
                                  "<extra></extra>")
    fig.update_layout(barmode="stack", title=title, yaxis_title=f"bytes per rank ({unit})",
                      height=height, template="plotly_white", legend=dict(traceorder="normal"),
                      margin=dict(t=70), bargap=0.08)
    fig.update_xaxes(tickangle=0, tickfont=dict(size=10))
    return fig


def equivalence_figure(curves: dict[str, list[float]], ref: str, tol: float,
                       title: str) -> go.Figure:
    """Left: loss curves (the reference drawn thickest). Right: |loss - reference's loss| per
    step on a log scale with the tolerance; exact zeros have no place on a log scale."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=(
        "loss per step", f"|loss − {ref}'s loss| per step"))
    base = curves[ref]
    for i, (label, y) in enumerate(curves.items()):
        color = common.RUN_COLORS[i % len(common.RUN_COLORS)]
        fig.add_scatter(x=list(range(len(y))), y=y, mode="lines", name=label, legendgroup=label,
                        line=dict(color=color, width=max(1.2, 5 - 0.6 * i)), row=1, col=1)
        if label != ref:
            gap = [abs(a - b) for a, b in zip(y, base)]
            fig.add_scatter(x=list(range(len(y))), y=[g if g > 0 else None for g in gap],
                            mode="markers+lines", marker=dict(size=4), line=dict(color=color),
                            name=label, legendgroup=label, showlegend=False, row=1, col=2)
    common.hline(fig, tol, f"tolerance {tol:g}", log=True, position="bottom right", row=1,
                 col=2, line_dash="dash", line_color="#c00")
    fig.update_yaxes(title_text="loss (nats)", row=1, col=1)
    fig.update_yaxes(type="log", exponentformat="e", row=1, col=2)
    fig.update_xaxes(title_text="step")
    fig.update_layout(title=title, height=400, template="plotly_white", margin=dict(t=80))
    return fig


def wire_by_step(run: Run, rank: int) -> list[dict]:
    """One rank's wire figures for every step: {"sent", "by_kind"} (distlab.wire), or
    {"sent": None, "why"} where the kernel cannot see the traffic."""
    return [e.get("wire", {"sent": None, "why": "not recorded"})
            for e in sorted(run.history("step", rank=rank), key=lambda e: e["step"])]


WIRE_GLOO = {"ddp": 2, "zero1": 3, "zero2": 3, "zero3": 4}
"""Bytes per rank per step on gloo, in (N-1)/N · 4Ψ, as measured in 01_collectives: an
all-reduce writes 2, an all-gather 1, and gloo's reduce-scatter 2 (the ring's would be 1)."""


def comm_figure(booked: dict[str, dict], formula: dict[str, dict], wire: dict[str, dict],
                model_bytes: float, n: int, other_n: dict[str, dict[int, float]] | None = None,
                other_wire: dict[str, dict[int, float]] | None = None,
                max_n: int = 64) -> go.Figure:
    """Left: bytes one rank sent in one step, per strategy, in units of the model's bytes (4Ψ):
    booked by Comm, stacked by collective kind (left bar), beside what the kernel saw written
    (right bar, by the kinds distlab.wire could tell apart), the formula's total as a diamond.
    Right: against N, the textbook's per-rank lines (2(N-1)/N for DDP/ZeRO-1/2, 3(N-1)/N for
    ZeRO-3) and gloo's measured rule (WIRE_GLOO), with the booked and wire totals at N and at
    `other_n`/`other_wire` ({strategy: {N: bytes}})."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, column_widths=[0.55, 0.45],
                        subplot_titles=(f"per rank per step, N = {n}: booked | on the wire",
                                        "per rank per step vs N"))
    names = list(formula)
    for k in [k for k in KIND_COLORS if any(k in m for m in booked.values())]:
        fig.add_bar(x=names, y=[booked.get(s, {}).get(k, 0) / model_bytes for s in names],
                    name=f"{k}, booked", marker_color=KIND_COLORS[k], offsetgroup="booked",
                    marker_opacity=0.45, row=1, col=1)
    wire_kinds = sorted({k for w in wire.values() for k in (w.get("by_kind") or {})})
    for k in wire_kinds:
        color = KIND_COLORS.get(k, "#495057" if k == "not booked" else "#0b7285")
        fig.add_bar(x=names, y=[(wire.get(s, {}).get("by_kind") or {}).get(k, 0) / model_bytes
                                for s in names],
                    name=f"{k}, on the wire", marker_color=color, offsetgroup="wire",
                    marker_line=dict(color="#000", width=1), row=1, col=1)
    fig.add_scatter(x=names, y=[sum(formula[s].values()) / model_bytes for s in names],
                    mode="markers", name="textbook formula, total",
                    marker=dict(symbol="diamond", size=13, color="#222"), row=1, col=1)
    ns = list(range(2, max_n + 1))
    for label, f, dash in (("2(N-1)/N: DDP (textbook and gloo), ZeRO-1/2 (textbook)", 2, "solid"),
                           ("3(N-1)/N: ZeRO-3 (textbook), ZeRO-1/2 (gloo)", 3, "dash"),
                           ("4(N-1)/N: ZeRO-3 (gloo)", 4, "dot")):
        fig.add_scatter(x=ns, y=[f * (m - 1) / m for m in ns], mode="lines", name=label,
                        line=dict(color="#555", dash=dash), row=1, col=2)
    for i, s in enumerate(s for s in ("ddp", "zero1", "zero2", "zero3") if s in wire):
        w = {n: wire[s].get("sent")} | (other_wire or {}).get(s, {})
        w = {m: v for m, v in w.items() if v is not None}
        fig.add_scatter(x=list(w), y=[v / model_bytes for v in w.values()], mode="markers",
                        name=f"{s}, on the wire", marker=dict(
                            size=(15, 11, 7, 11)[i], color=common.RUN_COLORS[i],
                            symbol="square" if s == "zero3" else "circle"), row=1, col=2)
        b = {n: sum(booked.get(s, {}).values())} | (other_n or {}).get(s, {})
        fig.add_scatter(x=list(b), y=[v / model_bytes for v in b.values()], mode="markers",
                        name=f"{s}, booked", marker=dict(
                            size=(15, 11, 7, 11)[i], color="rgba(0,0,0,0)",
                            line=dict(color=common.RUN_COLORS[i], width=2),
                            symbol="square" if s == "zero3" else "circle"), row=1, col=2)
    fig.update_xaxes(type="log", title_text="N (ranks)", row=1, col=2)
    fig.update_yaxes(title_text="bytes sent / 4Ψ", row=1, col=1)
    fig.update_yaxes(title_text="bytes sent / 4Ψ", range=[0, 4.2], row=1, col=2)
    fig.update_layout(barmode="stack", height=500, template="plotly_white",
                      title="Bytes per rank per step, in units of the fp32 model (4Ψ): booked "
                            "by the formulas, and on the wire (the kernel's count)",
                      legend=dict(font=dict(size=10), traceorder="normal"), margin=dict(t=90))
    return fig


def reduction_figure(mixes: dict[str, BytesPerParam], measured: dict[str, tuple[int, float]],
                     max_n: int = 1024) -> go.Figure:
    """Model-state memory of plain DP over that of each ZeRO stage, against N_d, for each
    bytes-per-parameter mix (Rajbhandari et al. 2020: (2 + 2 + K) / per-stage bytes), with the
    ratios measured here ({label: (N, ratio)}) as markers."""
    ns = [2 ** k for k in range(0, int(math.log2(max_n)) + 1)]
    fig = go.Figure()
    dashes = ("solid", "dot", "dash")
    for j, (mix_name, bpp) in enumerate(mixes.items()):
        for s in (1, 2, 3):
            ys = [zero_reduction(s, n, bpp) for n in ns]
            fig.add_scatter(x=ns, y=ys, mode="lines", name=f"{STAGES[s]}, {mix_name}",
                            line=dict(color=common.MEMORY_COLORS[s - 1], dash=dashes[j % 3]))
    for i, (label, (n, ratio)) in enumerate(measured.items()):
        fig.add_scatter(x=[n], y=[ratio], mode="markers", name=label,
                        marker=dict(size=12, symbol="star", color=common.MEMORY_COLORS[i % 3],
                                    line=dict(color="#000", width=1)))
    for y in (4, 8):  # on this log axis: common.hline puts the label at the line, at the
        # right end (at the left it would sit against the axis's tick labels)
        common.hline(fig, y, f"{y}×", log=True, position="top right", line_dash="dot",
                     line_color="#999")
    fig.update_xaxes(type="log", title_text="N_d (data-parallel ranks)")
    fig.update_yaxes(type="log", title_text="plain DP bytes / ZeRO bytes (model states)")
    fig.update_layout(height=440, template="plotly_white", legend=dict(font=dict(size=10)),
                      title="Memory reduction of each stage vs N_d: where '4×' and '8×' come from")
    return fig


# -- flat units or per-parameter shards (distlab.studies.fsdp_layouts) ---------------------------
def layouts_figure(result: dict) -> go.Figure:
    """Left: each way's step, optimizer step and copying, ms (medians over repeats, the range
    as error bars). Right: its all-gather bytes per step, counted, against the formula."""
    ways = list(result["ways"])
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, column_widths=[0.6, 0.4],
                        subplot_titles=("ms per step (median, range over repeats)",
                                        "all-gather KB per step, per rank"))
    parts = (("step", "step_s"), ("optimizer step", "opt_s"), ("copy kernels", "copy_s"),
             ("per_param's copying code", "own_copy_s"))
    for i, (label, key) in enumerate(parts):
        spans = [result["ways"][w][key] or {"median": 0, "min": 0, "max": 0} for w in ways]
        fig.add_bar(x=ways, y=[s["median"] * 1e3 for s in spans], name=label,
                    marker_color=common.RUN_COLORS[i % len(common.RUN_COLORS)],
                    error_y=dict(type="data", symmetric=False,
                                 array=[(s["max"] - s["median"]) * 1e3 for s in spans],
                                 arrayminus=[(s["median"] - s["min"]) * 1e3 for s in spans]),
                    row=1, col=1)
    fig.add_bar(x=ways, y=[result["ways"][w]["gather_bytes"] / 1e3 for w in ways],
                name="counted", marker_color="#54a24b", row=1, col=2)
    formula = [result["formula"]["flat" if w == "flat" else "per_param"]["all_gather"] / 1e3
               for w in ways]
    fig.add_scatter(x=ways, y=formula, mode="markers", name="formula (padding included)",
                    marker=dict(symbol="diamond", size=12, color="#000"), row=1, col=2)
    fig.update_layout(height=420, template="plotly_white", barmode="group",
                      title=f"fully_shard's layouts and FSDP2 on {result['world']} ranks")
    return fig


def layout_claims(result: dict) -> list[dict]:
    """Claims rows about the per-parameter layout, each computed from `result`."""
    ways, f = result["ways"], result["formula"]
    flat, pp, torch_ = ways["flat"], ways["per_param"], ways["FSDP2"]
    counts = {w: (r["all_gathers"], r["reduce_scatters"]) for w, r in ways.items()}
    extra = pp["gather_bytes"] / flat["gather_bytes"] - 1
    steps = {w: r["step_s"] for w, r in ways.items()}
    return [
        common.claim("FSDP2 keeps one all-gather per unit, as FSDP1",
                     "torchtitan docs/fsdp.md: fully_shard(module) builds one communication "
                     "bucket from its parameters",
                     "all-gathers / reduce-scatters per step, counted at the dispatcher: "
                     + ", ".join(f"{w} {a} / {s}" for w, (a, s) in counts.items()),
                     len(set(counts.values())) == 1),
        common.claim("dropping the FlatParameter costs no extra bytes",
                     "formula: distlab.theory.fsdp_layouts (dim-0 padding per parameter "
                     "against a unit's)",
                     f"all-gather per step: per_param {pp['gather_bytes'] / 1e3:.1f} KB, "
                     f"FSDP2 {torch_['gather_bytes'] / 1e3:.1f} KB, flat "
                     f"{flat['gather_bytes'] / 1e3:.1f} KB ({extra:+.2%}; padding entries "
                     f"{f['per_param']['padding']:,} against {f['flat']['padding']:,})",
                     pp["gather_bytes"] <= flat["gather_bytes"]),
        common.claim("FSDP2's per-parameter sharding trains faster than FSDP1's flat units",
                     "torchtitan docs/fsdp.md (higher MFU, Llama-7B on 8× H100)",
                     "median step over repeats: " + ", ".join(
                         f"{w} {s['median'] * 1e3:.1f} ms [{s['min'] * 1e3:.1f}–"
                         f"{s['max'] * 1e3:.1f}]" for w, s in steps.items())
                     + f"; optimizer step per_param {pp['opt_s']['median'] * 1e3:.1f} ms "
                     f"against flat {flat['opt_s']['median'] * 1e3:.1f} ms",
                     steps["per_param"]["max"] < steps["flat"]["min"]),
    ]


# -- the widget ------------------------------------------------------------------------------------
class MemoryExplorer(lab.Explorer):
    """Pick a strategy, a world size and offload; Run launches the real thing (non-blocking)
    and draws each rank's memory by category, as the ranks log it, next to the estimate
    (estimate_memory), until the run ends; Stop ends it (lab.Explorer).

    `run(**overrides)` is what the button does (knob values can be overridden: strategy,
    world_size, offload, or any RunConfig field) and returns at once; `wait()` blocks until the
    finished run is drawn and raises the run's error if it failed. After that, `measured` (one
    memory dict per rank) and `estimate` hold what the figure shows. As in distlab.lab.panel:
    the drawing thread only sets widget state, inside batch_update(), at most every `poll_s`."""

    def __init__(self, base: RunConfig, strategies=EXPLORER_STRATEGIES, worlds=(2, 4),
                 poll_s: float = lab.POLL_S):
        super().__init__()  # Run, Stop, the status line
        self.base = base
        self.poll_s = poll_s
        style = {"description_width": "initial"}
        self.strategy = W.Dropdown(options=strategies, value="zero3", description="strategy",
                                   style=style)
        self.world_size = W.Dropdown(options=worlds, value=max(worlds), description="world size",
                                     style=style)
        self.offload = W.Checkbox(value=False, description="offload", indent=False)
        self.status.value = "ready: pick a strategy and press Run"
        self.note = W.HTML()
        self.fig = go.Figure()
        for key, name in ALL_CATEGORIES:
            self.fig.add_bar(x=[], y=[], name=name, marker_color=COLORS[key],
                             marker_pattern_shape="/" if key.endswith("_offloaded") else "")
        self.fig.update_layout(barmode="stack", height=420, template="plotly_white",
                               margin=dict(t=60), legend=dict(traceorder="normal"))
        common.show_hint(self.fig, "press Run: each rank's memory by category, measured, "
                                   "appears here beside the estimate")
        self.scale, self.unit = common.byte_unit()  # the y axis's unit, set again at each draw
        self.widget = self._box([W.HBox([self.strategy, self.world_size, self.offload,
                                         self.button, self.stop_button]), self.status, self.note,
                                 self._view_of(self.fig)])
        self.widget.add_class("distlab-zero-explorer")
        self.strategy.observe(self._on_strategy, names="value")
        self._on_strategy({"new": self.strategy.value})
        self.last_run: Run | None = None
        self.measured: list[dict] = []
        self.estimate: dict = {}
        self.source = ""

    def config(self, **overrides) -> RunConfig:
        """The RunConfig the knobs describe now (overrides win). Offload is off for a strategy
        that does not support it (DDP)."""
        values = {"strategy": self.strategy.value, "world_size": self.world_size.value,
                  "offload": self.offload.value, **overrides}
        if "offload" not in strategy_class(values["strategy"]).supports:
            values["offload"] = False
        return self.base.replace(**values)

    def run(self, **overrides) -> "MemoryExplorer":
        """Set the knobs from overrides, launch and draw in a thread; returns at once."""
        self.start(**overrides)
        return self

    def wait(self, timeout: float | None = None) -> "MemoryExplorer":
        """Block until the run ended and its last step is drawn; raise its error if any."""
        if not self.join(timeout):
            raise TimeoutError(f"the run did not end within {timeout} s")
        if self.error is not None:
            raise self.error
        return self

    def _clear(self):
        super()._clear()
        self.measured = []
        with self.fig.batch_update():  # the last run's bars are not this run's
            for trace in self.fig.data:
                trace.x, trace.y, trace.customdata = [], [], []
            self.fig.layout.title.text = "starting: memory per rank comes with the first step"

    # -- the work (a thread) ---------------------------------------------------------------------
    def _run(self, **overrides) -> Run:
        for name in ("strategy", "world_size", "offload"):  # the knobs show what runs
            if name in overrides and not (name == "offload" and self.offload.disabled):
                getattr(self, name).value = overrides[name]
        cfg = self.config(**overrides)
        self.estimate, self.source = estimate_memory(cfg)
        self.note.value = html.escape(f"offload: {OFFLOAD_MEANING[cfg.strategy]}"
                                      if cfg.offload else "") + \
            f"<br><small>estimate: {html.escape(self.source)}; comm buffers not estimated</small>"
        run = launch(cfg)
        self.last_run = run
        self._announce(f"running {lab.run_label(run)} ...")
        self._started(run)
        while True:
            finished = run.done  # before drawing: a finished run has all its events
            self._draw(run)
            if finished:
                break
            time.sleep(self.poll_s)
        self._say(html.escape(lab.describe(run, lab.run_label(run))))
        if run.error is not None:
            raise run.error
        return run

    def _draw(self, run: Run):
        measured = memory_by_rank(run) if run.steps_done() > 0 else []
        label = lab.run_label(run)
        x = [f"rank {r}" for r in range(len(measured))] + ["estimate"]
        keys = dict(ALL_CATEGORIES)
        self.scale, self.unit = common.byte_unit(
            [sum(v or 0 for k, v in m.items() if k in keys) for m in [*measured,
                                                                       self.estimate]])
        with self.fig.batch_update():
            common.clear_hint(self.fig)
            self.fig.layout.yaxis.title.text = f"bytes per rank ({self.unit})"
            for trace, (key, name) in zip(self.fig.data, ALL_CATEGORIES):
                raw = [m.get(key, 0) for m in measured] + [self.estimate.get(key)]
                trace.x = x
                trace.y = [None if v is None else v / self.scale for v in raw]
                trace.customdata = raw
                trace.hovertemplate = (f"{name}: %{{y:.2f}} {self.unit} "
                                       "(%{customdata:,} bytes)<extra></extra>")
                trace.marker.opacity = [1.0] * len(measured) + [0.5]
                trace.visible = any(v for v in raw)
            step = f"step {run.steps_done() - 1}" if measured else "no step yet"
            self.fig.layout.title.text = f"{label}: memory per rank by category, {step}"
        self.measured = measured
        self.show_figure()  # each step as it comes (sent only when the figure changed)

    # -- knobs ---------------------------------------------------------------------------------
    def _on_strategy(self, change):
        self.offload.disabled = change["new"] == "ddp"
        if change["new"] == "ddp":
            self.offload.value = False
        self.offload.description = ("offload (FSDP2: params, grads, optimizer state)"
                                    if change["new"] == "fsdp-torch" else
                                    "offload optimizer state" if change["new"] != "ddp"
                                    else "offload (not for DDP)")

    def __repr__(self):
        return f"MemoryExplorer(last run: {self.last_run})"


# -- FSDP's overhead over DDP on NVLink: a question for several GPUs ----------------------------
FSDP_NCCL_CLAIM = "FSDP costs under 20% of step time over DDP on NVLink (an interview answer)"
NCCL_RATIO = r"FSDP2 / DDP step time on NCCL: ([\d.]+)x; per repeat ([\d. ]+)"


def recorded_fsdp_nccl(folder: str | None = None) -> dict | None:
    """The newest benchmarks/results file holding benchmarks/zero_overhead.py's NCCL section
    ({"file", "ratio", "per_repeat"}), or None where none does (no run on 2+ GPUs recorded)."""
    import glob
    import os
    import re

    from distlab.lab.memory_and_precision import RESULTS
    folder = folder or RESULTS
    for path in sorted(glob.glob(os.path.join(folder, "*.txt")), reverse=True):
        m = re.search(NCCL_RATIO, open(path).read())
        if m:
            return {"file": os.path.relpath(path, os.path.join(folder, "..", "..")),
                    "ratio": float(m.group(1)),
                    "per_repeat": [float(x) for x in m.group(2).split()]}
    return None


def fsdp_nccl_row(recorded: dict | None) -> dict:
    """04's row for "FSDP costs under 20% over DDP on NVLink": it needs two or more GPUs joined
    by NVLink, with NCCL, so a notebook run on a CPU reads "not measured here" and shows what
    benchmarks/zero_overhead.py's NCCL section recorded on such a machine, if anything."""
    seen = ("no figure recorded yet: benchmarks/zero_overhead.py's NCCL section measures it on "
            "2 or more GPUs" if recorded is None else
            f"FSDP2 / DDP {recorded['ratio']:.2f}× (per repeat "
            f"{', '.join(f'{r:.2f}' for r in recorded['per_repeat'])}) recorded in "
            f"{recorded['file']}, measured elsewhere")
    return common.claim(FSDP_NCCL_CLAIM, "interview answer", f"this run has no GPUs joined by "
                        f"NVLink; {seen}", None, basis="not measured here")
