"""Companion of workbook/02_data_parallel: what that notebook reads out of the runs' events
(bytes per node and per collective, the bucket timeline, steps per rank, state-dict parts) and
the figures and claims rows it draws from them (its runs are launched with
distlab.lab.runs.launch_together).

Nothing here runs inside a rank or changes how anything trains; it reads what the runs logged.
"""

from __future__ import annotations

import statistics

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from distlab.config import RunConfig
from distlab.lab.common import RUN_COLORS as COLORS, byte_unit, fmt_bytes, hline
# 02 takes it from here with the rest of its section's helpers; it lives in common (11 uses it)
from distlab.lab.common import expected_divergence  # noqa: F401
from distlab.lab.panel import wire_sent
from distlab.parallel.data_parallel.dp import KINDS as DP_KINDS
from distlab.caller.run import Run


# -- figures ------------------------------------------------------------------------------------
def loss_figure(curves: dict, title: str, xaxis: str = "step", floor: float | None = None,
                height: int = 380) -> go.Figure:
    """Overlaid loss curves: {label: (x, y)} or {label: y} (x = 0, 1, ...). Later curves are
    drawn thinner, so one that retraces an earlier one shows inside it."""
    fig = go.Figure()
    for i, (label, c) in enumerate(curves.items()):
        x, y = c if isinstance(c, tuple) else (list(range(len(c))), c)
        fig.add_scatter(x=x, y=y, mode="lines", name=label,
                        line=dict(color=COLORS[i % len(COLORS)], width=max(1.5, 4.5 - 1.2 * i)))
    if floor is not None:
        fig.add_hline(y=floor, line_dash="dash", line_color="#555",
                      annotation_text=f"loss floor {floor:.3f}", annotation_position="top right")
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title="loss (nats)", height=height,
                      template="plotly_white")
    return fig


def diff_figure(gaps: dict[str, list[float]], tol: float, title: str) -> go.Figure:
    """Per-step gaps {label: [|a_t - b_t|, ...]} on a log scale, with the tolerance drawn
    (exact zeros have no place on a log scale: they are left out)."""
    fig = go.Figure()
    for i, (label, g) in enumerate(gaps.items()):
        fig.add_scatter(x=list(range(len(g))), y=[v if v > 0 else None for v in g], mode="lines+markers",
                        name=label, line=dict(color=COLORS[(i + 1) % len(COLORS)]),
                        marker=dict(size=4))
    hline(fig, tol, f"tolerance {tol:g}", log=True, line_dash="dash", line_color="#c00")
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="absolute gap", height=320,
                      template="plotly_white")
    fig.update_yaxes(type="log", exponentformat="e")
    return fig


def dp_bytes_by_kind(run: Run, step: int = -1) -> dict[str, list[int]]:
    """Bytes each replica of a `dp` run moved (sent + received) in one step, by kind."""
    e = sorted(run.history("step"), key=lambda e: e["step"])[step]["dp"]["bytes"]
    return {k: [s + r for s, r in zip(e[k]["sent"], e[k]["recv"])] for k in DP_KINDS}


def dp_bottleneck_figure(run: Run, summary: dict) -> go.Figure:
    """Left: bytes each replica moved in one step, stacked by kind. Right: seconds of work per
    replica: its own forward, plus (replica 0) what only replica 0 does."""
    n = summary["replicas"]
    names = [f"replica {i}" for i in range(n)]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        "bytes moved per step (sent + received)", "work per step (medians)"))
    moved = dp_bytes_by_kind(run)
    scale, unit = byte_unit([sum(v) for v in zip(*moved.values())])  # the stack's height
    for i, (kind, b) in enumerate(moved.items()):
        fig.add_bar(x=names, y=[v / scale for v in b], name=kind, legendgroup="bytes",
                    marker_color=COLORS[i], row=1, col=1, customdata=b,
                    hovertemplate=f"{kind}: %{{customdata:,}} B<extra></extra>")
    fig.add_bar(x=names, y=[s * 1e3 for s in summary["replica_forward_s"]],
                name="its forward (thread)", marker_color=COLORS[5], row=1, col=2)
    fig.add_bar(x=names, y=[summary["replica0_only_s"] * 1e3] + [0] * (n - 1),
                name="replica 0 only: replicate, scatter, gather, loss, grad scatter, "
                     "reduce-add, optimizer", marker_color=COLORS[6], row=1, col=2)
    fig.update_layout(barmode="stack", height=520, template="plotly_white",
                      title=f"dp, {n} replicas in one process: what replica 0 carries",
                      margin=dict(t=90, b=40),
                      # below the charts: the long last entry beside them squeezed both
                      legend=dict(font=dict(size=10), orientation="h", y=-0.12,
                                  yanchor="top"))
    fig.update_yaxes(title_text=unit, row=1, col=1)
    fig.update_yaxes(title_text="ms", row=1, col=2)
    return fig


def done_when_issued(event: dict, span_fraction: float = 1 / 400) -> list[int]:
    """The buckets of a step event's `ddp` timeline whose all-reduce was already done when the
    call that issued it returned (in flight, issued → done, under `span_fraction` of the
    timeline's span: under 2 px of an 800 px axis). gloo reduces in its own thread, and the
    issuing call can take milliseconds (measured: 2-16 ms with 4 ranks on 2 shared cores, in
    02's full mode, the all-reduce then done 0.02 ms after it returned); such an all-reduce
    ran somewhere between the bucket's ready and issued times, and has no bar of its own."""
    t = event["ddp"]
    span = max([t["backward"][1]] + [b["done"] for b in t["buckets"]])
    return [b["index"] for b in t["buckets"] if b["done"] - b["start"] < span * span_fraction]


def bucket_timeline(event: dict, title: str = "") -> go.Figure:
    """Gantt chart of one DDP step on one rank (a step event's `ddp` timeline): the backward
    pass, and per bucket: the moment its last gradient arrived (ready), the span to the moment
    the call that issued its all-reduce returned (its turn, then the call), the all-reduce from
    issue to completion, and a marker where it was done, so a bucket whose all-reduce was done
    before its issuing call returned (done_when_issued: no bar of its own) still shows it,
    named in the subtitle. Times in ms from the start of backward."""
    t = event["ddp"]
    buckets = t["buckets"]
    labels = ["backward"] + [f"bucket {b['index']} ({b['params']} tensors, "
                             f"{fmt_bytes(b['bytes'])})" for b in buckets]
    fig = go.Figure()
    fig.add_bar(y=labels[:1], x=[(t["backward"][1] - t["backward"][0]) * 1e3],
                base=[t["backward"][0] * 1e3], orientation="h",
                name="backward (computing gradients)", marker_color="#adb5bd",
                hovertemplate="backward: %{base:.2f} to %{x:.2f} ms long<extra></extra>")
    fig.add_scatter(y=labels[1:], x=[b["ready"] * 1e3 for b in buckets], mode="markers",
                    marker=dict(symbol="line-ns-open", size=16, color=COLORS[1],
                                line=dict(width=3)),
                    name="bucket ready (its last gradient arrived)")
    fig.add_bar(y=labels[1:], x=[(b["start"] - b["ready"]) * 1e3 for b in buckets],
                base=[b["ready"] * 1e3 for b in buckets], orientation="h",
                name="ready → issued (its turn, then the call that issues it)",
                marker_color="#a5c8f0",
                hovertemplate="ready at %{base:.2f} ms, issued %{x:.2f} ms later<extra></extra>")
    fig.add_bar(y=labels[1:], x=[(b["done"] - b["start"]) * 1e3 for b in buckets],
                base=[b["start"] * 1e3 for b in buckets], orientation="h",
                name="all-reduce in flight (issued → done)", marker_color=COLORS[0],
                hovertemplate="issued at %{base:.2f} ms, took %{x:.3f} ms<extra></extra>")
    fig.add_scatter(y=labels[1:], x=[b["done"] * 1e3 for b in buckets], mode="markers",
                    marker=dict(symbol="diamond", size=8, color="#0b2545"),
                    name="all-reduce done", hovertemplate="done at %{x:.2f} ms<extra></extra>")
    end = t["backward"][1] * 1e3
    fig.add_vline(x=end, line_dash="dash", line_color="#555",
                  annotation_text="backward ends", annotation_position="top right")
    quick = done_when_issued(event)
    note = ("" if not quick else
            f"<br><sup>bucket{'s' if len(quick) > 1 else ''} {', '.join(map(str, quick))}: "
            "all-reduce already done when the call that issued it returned (no dark bar); it "
            "ran within the light span</sup>")
    fig.update_layout(title=(title or f"DDP step {event['step']}, rank {event['rank']}: "
                             f"overlap {t['overlap']:.0%}") + note,
                      height=180 + 28 * len(labels), margin=dict(t=90 if quick else 70),
                      xaxis_title="ms from the start of backward", template="plotly_white",
                      barmode="overlay", legend=dict(orientation="h", y=-0.25))
    fig.update_yaxes(autorange="reversed")
    return fig


def staleness_figure(run: Run, title: str = "") -> go.Figure:
    """Staleness of each update a ps-async server applied (updates made since the gradient's
    worker last pulled weights), one colour per worker."""
    server = sorted((e for e in run.history("step") if e.get("role") == "server"),
                    key=lambda e: e["step"])
    fig = go.Figure()
    for i, w in enumerate(sorted({e["worker"] for e in server})):
        mine = [e for e in server if e["worker"] == w]
        fig.add_scatter(x=[e["step"] for e in mine], y=[e["staleness"] for e in mine],
                        mode="markers", name=f"worker rank {w}", marker_color=COLORS[i])
    fig.update_layout(title=title or "staleness of each applied gradient", height=340,
                      xaxis_title="update (server version)", yaxis_title="staleness (updates)",
                      template="plotly_white")
    return fig


def grouped_bars(groups: dict[str, dict[str, float]], title: str, yaxis: str,
                 height: int = 380) -> go.Figure:
    """{series: {category: value}} as grouped bars."""
    fig = go.Figure()
    for i, (series, values) in enumerate(groups.items()):
        fig.add_bar(x=list(values), y=list(values.values()), name=series,
                    marker_color=COLORS[i % len(COLORS)])
    fig.update_layout(barmode="group", title=title, yaxis_title=yaxis, height=height,
                      template="plotly_white")
    return fig


def bucket_plan(cfg: RunConfig) -> list[dict]:
    """The buckets of `ddp` for cfg's GPT, in launch order: {"tensors": parameter names,
    "bytes": gradient bytes, "last_bytes": its last gradient's}. The gradients in reverse registration order, cut by
    distlab.parallel.data_parallel.ddp.assign_buckets at cfg.bucket_mb, as DistributedDataParallel
    does (built here on the caller's side, without a process group)."""
    from distlab.models import GPT, GPTConfig
    from distlab.parallel.data_parallel.ddp import MiB as DDP_MiB, assign_buckets

    model = GPT(GPTConfig.from_run(cfg))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]
    sizes = [p.numel() * p.element_size() for _, p in named]
    return [{"tensors": [named[i][0] for i in b], "bytes": sum(sizes[i] for i in b),
             "last_bytes": sizes[b[-1]]} for b in assign_buckets(sizes, cfg.bucket_mb * DDP_MiB)]


def ps_ring_figure(measured: dict[str, tuple[float, float]], P: float, N: int,
                   ring_points: dict[int, float] | None = None, max_n: int = 16) -> go.Figure:
    """Left: bytes per update each node of a parameter-server run moved, {node: (sent,
    received)}, in units of P (the gradient bytes). Right: per-node bytes per update against N
    by formula: the server's N·P, a worker's P, a ring all-reduce rank's 2(N-1)/N·P, with the
    measured server at N and measured ring ranks at `ring_points` {N: bytes sent}."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        f"bytes per update, measured (N = {N} workers)",
        "bytes sent per update by the busiest node, vs N"))
    names = list(measured)
    fig.add_bar(x=names, y=[measured[k][0] / P for k in names], name="sent",
                marker_color=COLORS[0], row=1, col=1)
    fig.add_bar(x=names, y=[measured[k][1] / P for k in names], name="received",
                marker_color=COLORS[1], row=1, col=1)
    ns = list(range(2, max_n + 1))
    for i, (label, f) in enumerate((
            ("parameter server: N·P (formula)", lambda n: n),
            ("ps worker: P (formula)", lambda n: 1),
            ("ring all-reduce rank: 2(N-1)/N·P (formula)", lambda n: 2 * (n - 1) / n))):
        fig.add_scatter(x=ns, y=[f(n) for n in ns], mode="lines", name=label,
                        line=dict(color=COLORS[2 + i], dash="dot"), row=1, col=2)
    server = next((v for k, v in measured.items() if k.startswith("server")), None)
    if server is not None:
        fig.add_scatter(x=[N], y=[server[0] / P], mode="markers", name="server, measured",
                        marker=dict(color=COLORS[2], size=12, symbol="diamond"), row=1, col=2)
    if ring_points:
        fig.add_scatter(x=list(ring_points), y=[v / P for v in ring_points.values()],
                        mode="markers", name="ring rank, measured",
                        marker=dict(color=COLORS[4], size=12, symbol="circle"), row=1, col=2)
    fig.update_layout(barmode="group", height=440, template="plotly_white",
                      title="parameter server vs ring all-reduce: bytes per node, in units of "
                            "P (the gradient's bytes)",
                      margin=dict(t=90), legend=dict(font=dict(size=10)))
    fig.update_yaxes(title_text="bytes / P", row=1, col=1)
    fig.update_yaxes(title_text="bytes sent / P", row=1, col=2)
    fig.update_xaxes(title_text="N (workers or ranks)", row=1, col=2)
    return fig


RULE_TITLES = {"none": "none: lr", "linear": "linear: k·lr", "sqrt": "square root: √k·lr",
               "inverse": "inverse: lr/k"}


def scaling_figure(curves: list[dict]) -> go.Figure:
    """distlab.lab.scaling.scaling_experiment's curves, one column per lr rule: loss against
    step (top row) and against samples seen (bottom row). In each panel one colour per batch
    size (the same in every panel), solid without warm-up, dotted with it; the base batch,
    which every rule runs at the base lr, is drawn in every column as the reference. So a
    panel holds 2 lines per batch size (6 for 3 batches), its colours not repeating."""
    base = min(c["batch"] for c in curves)
    rules = [r for r in ("none", "linear", "sqrt", "inverse") if any(c["rule"] == r for c in curves)]
    rules += sorted({c["rule"] for c in curves} - set(rules))
    batches = sorted({c["batch"] for c in curves})
    warmups = sorted({c["warmup_steps"] for c in curves})

    def lrs(rule):  # the peak lr of each batch under this rule
        return ", ".join(f"{c['lr']:.3g}" for b in batches for c in curves
                         if c["batch"] == b and c["warmup_steps"] == warmups[0]
                         and (c["rule"] == rule or (b == base and c["rule"] == "none")))

    fig = make_subplots(rows=2, cols=len(rules), shared_yaxes=True, horizontal_spacing=0.03,
                        vertical_spacing=0.16,
                        subplot_titles=[f"{RULE_TITLES.get(r, r)}<br><sup>B = {', '.join(map(str, batches))}: "
                                        f"lr {lrs(r)}</sup>"
                                        for r in rules] + [""] * len(rules))
    for col, rule in enumerate(rules, start=1):
        mine = [c for c in curves if c["rule"] == rule
                or (c["batch"] == base and c["rule"] == "none")]
        for c in sorted(mine, key=lambda c: (c["batch"], c["warmup_steps"])):
            color = COLORS[batches.index(c["batch"]) % len(COLORS)]
            name = f"B={c['batch']}" + (f", warm-up {c['warmup_steps']} steps"
                                        if c["warmup_steps"] else ", no warm-up")
            line = dict(color=color, dash="dot" if c["warmup_steps"] else "solid", width=1.8)
            for row, x in ((1, c["step"]), (2, c["samples"])):
                fig.add_scatter(x=x, y=c["loss"], mode="lines", name=name, line=line,
                                legendgroup=name, showlegend=col == 1 and row == 1,
                                hovertemplate=f"{c['label']}<br>loss %{{y:.3f}}<extra></extra>",
                                row=row, col=col)
    top = 1.3 * max(c["loss_at_start"] for c in curves)
    floor = min(c["loss_floor"] for c in curves)
    fig.update_yaxes(range=[floor - 0.2, top])
    fig.update_yaxes(title_text="loss (nats)", col=1)
    fig.update_xaxes(title_text="step", row=1)
    fig.update_xaxes(title_text="samples", type="log", dtick=1, row=2)
    fig.update_layout(height=640, template="plotly_white",
                      legend=dict(orientation="h", y=-0.12, yanchor="top", font=dict(size=11)),
                      title="tiny GPT, SGD: one column per lr rule (k = batch / "
                            f"{base}); loss vs step (top), vs samples (bottom); diverged runs "
                            "leave the plot", margin=dict(t=110, b=40))
    return fig


# -- strategy dp: read its run's events, and measure the threads' (GIL's) cost -----------------
def dp_summary(run) -> dict:
    """Medians over a dp run's steps (skipping the first, which warms up): bytes per replica,
    replica 0's share, seconds per phase, forward wall vs the replicas' own forward times."""
    steps = [e["dp"] for e in run.history("step") if "dp" in e][1:] or \
        [e["dp"] for e in run.history("step") if "dp" in e]
    if not steps:
        raise ValueError("no dp step events in this run")
    n = steps[0]["replicas"]
    med = statistics.median
    out = {"replicas": n, "threads": steps[0]["threads"],
           "intra_op_threads": steps[0]["intra_op_threads"], "gather": steps[0]["gather"],
           "bytes_sent": [med(s["bytes_sent"][i] for s in steps) for i in range(n)],
           "bytes_recv": [med(s["bytes_recv"][i] for s in steps) for i in range(n)],
           "replica_forward_s": [med(s["replica_forward_s"][i] for s in steps) for i in range(n)],
           "replica_cpu_s": [med(s["replica_cpu_s"][i] for s in steps) for i in range(n)],
           "replica0_only_s": med(s["replica0_only_s"] for s in steps),
           "step_s": med(e["step_s"] for e in run.history("step")[1:] or run.history("step"))}
    phases = sorted({k for s in steps for k in s["seconds"]})
    out["seconds"] = {k: med(s["seconds"].get(k, 0.0) for s in steps) for k in phases}
    moved = [a + b for a, b in zip(out["bytes_sent"], out["bytes_recv"])]
    out["replica0_factor"] = moved[0] / moved[1] if n > 1 and moved[1] else None
    return out


def gil_cost(cfg, block: bool = True) -> dict:
    """Run `cfg` (strategy "dp") twice, replicas in threads and one after another, and compare
    the forward's wall time: threads win only where kernels (which release the GIL) dominate
    the Python between them. Returns both summaries and the ratio sequential / threaded."""
    from distlab.caller.launch import launch
    threaded = launch(cfg.replace(dp_threads=True), block=block)
    sequential = launch(cfg.replace(dp_threads=False), block=block)
    a, b = dp_summary(threaded), dp_summary(sequential)
    fa, fb = a["seconds"]["forward_wall_s"], b["seconds"]["forward_wall_s"]
    return {"threaded": a, "sequential": b, "forward_threaded_s": fa, "forward_sequential_s": fb,
            "speedup": fb / fa if fa else None, "runs": (threaded, sequential)}


# -- parameter servers: the server's events and each worker's --------------------------------
SERVER = "server (rank 0)"


def ps_steps(run: Run) -> tuple[list[dict], list[dict]]:
    """A parameter-server run's step events split by role: (the server's, the workers'). The
    server logs one event per update; each worker one per step it pushed a gradient."""
    steps = run.history("step")
    return ([e for e in steps if e.get("role") == "server"],
            [e for e in steps if e.get("role") != "server"])


def ps_steps_by_node(run: Run) -> dict[str, list[dict]]:
    """{node: its step events}: the server (rank 0), then workers 1..N, N = cfg.dp_degree."""
    server, workers = ps_steps(run)
    nodes = {SERVER: server}
    for w in range(1, run.cfg.dp_degree + 1):
        nodes[f"worker {w}"] = [e for e in workers if e["rank"] == w]
    return nodes


def ps_bytes_per_update(run: Run) -> dict[str, tuple[float, float]]:
    """{node: (bytes sent, bytes received)} per update, medians over the steps: the server's
    own count of what it pushed out and took in, and each worker's gradient push and weight
    pull as distlab.comm booked them. The figures Dean et al.'s N·P and P are set beside."""
    med = statistics.median
    out = {}
    for node, ev in ps_steps_by_node(run).items():
        if node == SERVER:
            out[node] = (med(e["bytes_out"] for e in ev), med(e["bytes_in"] for e in ev))
        else:
            out[node] = (med(e["comm"]["ps.push"]["bytes_sent"] for e in ev),
                         med(e["comm"]["ps.pull"]["bytes_recv"] for e in ev))
    return out


def ps_wire_per_update(run: Run) -> dict[str, float] | None:
    """{node: bytes the kernel saw it write per update} (distlab.wire), medians over the steps;
    None where the wire could not be seen (then no step carries it)."""
    nodes = ps_steps_by_node(run)
    if wire_sent(nodes[SERVER][0]) is None:
        return None
    return {node: statistics.median(wire_sent(e) or 0 for e in ev) for node, ev in nodes.items()}


def staleness(run: Run) -> list[int]:
    """The staleness of each update a ps-async server applied, in the order it logged them."""
    return [e["staleness"] for e in ps_steps(run)[0]]


# -- DDP: the bucket timeline and the bytes booked per step ------------------------------------
def ddp_steps_after_warmup(run: Run) -> list[dict]:
    """A ddp run's step events, every rank, without step 0 (it warms up: its timings are not
    the run's)."""
    return [e for e in run.history("step") if e["step"] > 0]


def median_overlap_step(run: Run, rank: int = 0) -> dict:
    """`rank`'s step event (after warm-up) whose overlap is the median, the upper one of an
    even count: the timeline to show, neither the luckiest step nor the unluckiest."""
    mine = sorted((e for e in ddp_steps_after_warmup(run) if e["rank"] == rank),
                  key=lambda e: e["ddp"]["overlap"])
    return mine[len(mine) // 2]


def overlap_medians(run: Run) -> dict:
    """Over every rank's steps after warm-up: each step's overlap fraction ("overlaps"), and the
    medians of the overlap, of backward's duration and of the communication time (seconds).
    Backward over communication bounds the overlap: only that much can hide under it."""
    steps = ddp_steps_after_warmup(run)
    overlaps = [e["ddp"]["overlap"] for e in steps]
    return {"overlaps": overlaps, "overlap": statistics.median(overlaps),
            "backward_s": statistics.median(e["ddp"]["backward"][1] for e in steps),
            "comm_s": statistics.median(e["ddp"]["comm_s"] for e in steps)}


def collective_bytes(run: Run, kind: str = "all_reduce") -> dict:
    """One collective kind over every rank and step of a run: the distinct bytes per rank per
    step distlab.comm booked ("booked", sorted) and the distinct calls per step ("calls"); a
    run that books the formula everywhere shows one value. "on_wire": the bytes the kernel saw
    each rank write in each step (distlab.wire), None where it could not see them all."""
    steps = run.history("step")
    booked = [e["comm"][kind] for e in steps]
    wire = [wire_sent(e) for e in steps]
    return {"booked": sorted({c["bytes_sent"] for c in booked}),
            "calls": sorted({c["calls"] for c in booked}),
            "on_wire": None if None in wire else wire}


# -- uneven inputs: what each rank did -----------------------------------------------------------
def steps_trained_and_shadowed(run: Run) -> tuple[list[int], list[int]]:
    """Per rank: the steps it trained on its own rows, and the steps it only shadowed the
    others' collectives (joined, out of data) under the join protocol."""
    ranks = range(run.cfg.world_size)
    trained = [sum(1 for e in run.history("step", rank=r) if not e.get("joined")) for r in ranks]
    joined = [sum(1 for e in run.history("step", rank=r) if e.get("joined")) for r in ranks]
    return trained, joined


# -- BatchNorm: a state dict's parameters apart from its running statistics ---------------------
def parameters_only(state: dict) -> dict:
    """The entries of a BatchNorm model's state dict that training updates by gradient: no
    running statistics, no batch counter (those are buffers, compared apart)."""
    return {k: v for k, v in state.items() if "running" not in k and "num_batches" not in k}


def running_statistics(state: dict) -> dict:
    """The BatchNorm running means and variances of a state dict: buffers, which no gradient
    reaches and which each rank updates from the rows it saw."""
    return {k: v for k, v in state.items() if "running" in k}


# -- stragglers ---------------------------------------------------------------------------------
def fmt_ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds; a dash for None (a layout with no such worker)."""
    return "–" if seconds is None else f"{seconds * 1e3:.0f} ms"


# -- large batches: scaling_experiment's curves by setting ------------------------------------
def rule_grid(curves: list[dict]) -> tuple[dict, list[int], int]:
    """distlab.lab.scaling.scaling_experiment's curves keyed by (batch, rule, warmup_steps), the
    batches it ran (smallest first) and its longest warm-up: the runs the rules are judged on."""
    by = {(c["batch"], c["rule"], c["warmup_steps"]): c for c in curves}
    return by, sorted({c["batch"] for c in curves}), max(c["warmup_steps"] for c in curves)


# -- DDP's buffer broadcast ---------------------------------------------------------------------
def buffer_sums(run) -> dict:
    """What each rank's floating buffers (BatchNorm's running statistics) summed to at the start
    of each step of a `ddp` or `ddp-torch` run (logged as `buffer_sum_at_start`), and the
    largest spread over
    ranks at any step: 0 when rank 0's buffers were broadcast, as torch DDP's
    broadcast_buffers=True does."""
    by_step: dict[int, dict[int, float]] = {}
    for e in run.history("step"):
        if "buffer_sum_at_start" in e:
            by_step.setdefault(e["step"], {})[e["rank"]] = e["buffer_sum_at_start"]
    if not by_step:
        raise ValueError("no buffer_sum_at_start in this run's steps (a ddp or ddp-torch run "
                         "of a model with buffers logs it)")
    spread = {s: max(v.values()) - min(v.values()) for s, v in by_step.items()}
    last = by_step[max(by_step)]
    return {"broadcast": run.cfg.broadcast_buffers, "steps": len(by_step),
            "last_step": [last[r] for r in sorted(last)], "max_spread": max(spread.values()),
            "spread_per_step": [spread[s] for s in sorted(spread)]}


# -- the closing claims table: rows whose figures and verdicts come from the measurements -------
def buffer_broadcast_claim(on: dict, off: dict, torch_ddp: dict) -> dict:
    """DDP broadcasts rank 0's buffers at each step's start (Li et al. 2020; torch DDP's
    broadcast_buffers=True): from buffer_sums of our `ddp` with it and without, and of torch's
    own DistributedDataParallel (`ddp-torch`, its default), measured the same way."""
    from distlab.lab.common import claim
    return claim(
        "DDP broadcasts rank 0's buffers (BatchNorm running statistics) at every step's start, "
        "so every rank's are equal; without it each rank keeps its own",
        "torch DDP broadcast_buffers=True; Li et al. 2020",
        f"largest spread over ranks of the buffers' sum at a step's start, {on['steps']} steps: "
        f"torch's DDP {torch_ddp['max_spread']:.2e}, ours {on['max_spread']:.2e} with the "
        f"broadcast, {off['max_spread']:.2e} without",
        torch_ddp["max_spread"] == on["max_spread"] == 0.0 and off["max_spread"] > 0.0)


def straggler_claim(strag: dict, delay_s: float, no_delay: dict | None = None) -> dict:
    """A synchronous update waits for the slowest worker, a backup worker's does not (Chen et
    al. 2016), timed over the updates. `strag`: stragglers.summarize rows by layout, each with
    its `update_samples_s` (the times between updates, the first left out); `no_delay`: the
    same for the allreduce layout run without the delay, shown beside them. Yes when the
    synchronous layouts' updates take at least 0.9 × the delay and the backup's take under half
    of ps-sync's; undecided where the middle halves of the updates overlap those bounds."""
    from distlab.lab.timed import all_of, below, timed_claim, within
    sync, backup = strag["ps-sync"], strag["ps-sync + 1 backup"]
    samples = {k: strag[k]["update_samples_s"] for k in ("allreduce", "ps-sync",
                                                         "ps-sync + 1 backup")}
    waits = [within(samples[k], lo=0.9 * delay_s) for k in ("allreduce", "ps-sync")]
    spared = below(backup["update_samples_s"], sync["update_samples_s"], 0.5)
    sides = {f"{k}: between updates": v for k, v in samples.items()}
    if no_delay is not None:
        sides["allreduce without the delay"] = no_delay["update_samples_s"]
    return timed_claim(
        "a synchronous step waits for the slowest worker; backup workers do not",
        "Chen et al. 2016", all_of(*waits, spared), sides, interleaved_=False, digits=2,
        note=f"one worker +{delay_s * 1e3:.0f} ms/step; yes needs the synchronous layouts' "
             f"updates ≥ {0.9 * delay_s * 1e3:.0f} ms and the backup's under half of "
             f"ps-sync's ({backup['dropped']} late gradients dropped)")


def dp_vs_ddp_claim(dp_step_s: list[float], ddp_step_s: list[float], replicas: int,
                    cores: int) -> dict:
    """The interview answer's DDP-over-DP speed-up, timed over this machine's steps: one sample
    per step of each run (ddp's the slowest rank's). The two runs are separate launches, taken
    one after the other, not interleaved."""
    from distlab.lab.timed import below, timed_claim
    ratio = statistics.median(dp_step_s) / statistics.median(ddp_step_s)
    return timed_claim(
        "DDP is faster than DP (a common figure: 1.8× on 4 V100s, ResNet-50)",
        "torch.nn.DataParallel docs recommend DDP", below(ddp_step_s, dp_step_s),
        {"dp": dp_step_s, "ddp": ddp_step_s}, interleaved_=False, digits=3,
        note=f"per step; medians dp / ddp = {ratio:.2f}× ({replicas} replicas, tiny GPT, "
             f"{cores} CPU cores; separate launches, not interleaved). The 1.8× is not "
             "reproducible here: no GPUs, no ResNet-50, and DP's cost there (copies between "
             "GPUs, one GIL driving 4 devices) is not this machine's")


def lr_rule_claims(curves: list[dict]) -> list[dict]:
    """Rows on the learning-rate rules from distlab.lab.scaling.scaling_experiment's curves
    (run with rules "none", "linear", "sqrt" and "inverse")."""
    from distlab.lab.common import claim
    from distlab.lab.scaling import loss_at_samples
    by, (b0, b1, bmax), w = rule_grid(curves)
    budget = min(c["samples"][-1] for c in curves)
    small, lin, inv = by[(b0, "none", 0)], by[(b1, "linear", 0)], by[(b1, "inverse", 0)]
    big_lin, big_lin_wu = by[(bmax, "linear", 0)], by[(bmax, "linear", w)]
    # Goyal et al.'s claim is equal quality at equal epochs (samples), not more progress per
    # step: the larger batch sees k times the samples per step, so equal steps would flatter
    # it. "Matches": within 3% of the small batch's loss at the same samples.
    small_at, lin_at = loss_at_samples(small, budget), loss_at_samples(lin, budget)
    rows = [claim(
        "linear scaling rule: k times the batch at k times the lr (with warm-up) matches the "
        "small batch at equal samples", "Goyal et al. 2017",
        f"at {budget} samples: B={b1} linear {lin_at:.3f} vs B={b0} {small_at:.3f} "
        f"({lin_at / small_at - 1:+.1%}); B={bmax} at lr {big_lin['lr']:g} "
        f"{'diverged' if big_lin['diverged'] else 'did not diverge'} without warm-up, "
        f"{'diverged' if big_lin_wu['diverged'] else 'did not'} with {w} warm-up steps",
        lin_at <= 1.03 * small_at and big_lin["diverged"] and not big_lin_wu["diverged"])]
    lost = []
    for b in (b1, bmax):
        lo, sq = by[(b, "linear", w)], by[(b, "sqrt", w)]
        if not lo["final_loss"] <= sq["final_loss"]:
            lost.append(f"B={b}")
    rows.append(claim(
        "the linear rule beats the square-root rule for SGD",
        "Goyal et al. 2017; Krizhevsky 2014 and Hoffer et al. 2017 for √",
        "final loss with warm-up, linear vs √: " + ", ".join(
            f"B={b} {by[(b, 'linear', w)]['final_loss']:.3f} vs "
            f"{by[(b, 'sqrt', w)]['final_loss']:.3f}" for b in (b1, bmax))
        + (f"; the linear rule lost to √ in this run at {', '.join(lost)}" if lost else ""),
        not lost))
    seed, linear = loss_at_samples(inv, budget), loss_at_samples(lin, budget)
    rows.append(claim(
        "\"reduce the learning rate in proportion to the effective batch\"",
        "a common rule of thumb; the opposite of Goyal et al. 2017's linear rule",
        f"B={b1}: lr/{b1 // b0} = {inv['lr']:g} reaches {seed:.3f} at {budget} samples "
        f"({inv['final_loss']:.3f} at equal steps); k·lr = {lin['lr']:g} reaches {linear:.3f} "
        f"({lin['final_loss']:.3f})",
        seed <= linear))
    return rows
