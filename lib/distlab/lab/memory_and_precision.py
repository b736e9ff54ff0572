"""Caller-side helpers of the memory-and-precision notebook (workbook/03_memory_and_precision):
reading memory, loss scales and step times out of runs' events, the GPT's parameter count at
other MLP widths, a one-micro-batch look inside autocast, the loss scaler replayed beside
torch.amp.GradScaler, the micro-batch sweep and the "fits at batch 1, need batch 32" recipe
(its configs and its rows), and their figures.

Nothing here changes how anything trains: the runs are distlab.rank.train's; these functions read
their events, or (forward_breakdown, replay_scalers) run one forward/backward or a scaler on
gradients in this process to show what a run does inside.

    runs = launch_together({"fp32": cfg, "bf16": cfg.replace(precision="bf16")})  # distlab.lab.runs'
    last_memory(runs["bf16"])              # the last step's memory dict of rank 0
    forward_breakdown(cfg)                 # saved bytes by dtype, autocast's weight copies
    replay_scalers(gradient_sequence())    # DynamicLossScaler and GradScaler, step by step
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import statistics

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from distlab.config import RunConfig
from distlab.lab.common import MEMORY_COLORS as COLORS, MiB, claim
from distlab.lab.time_to_train import step_samples
from distlab.caller.run import Run
from distlab.models import GPTConfig, gpt_param_count
from distlab.step_event import memory


# -- reading runs --------------------------------------------------------------------------------
def steps_of(run: Run, rank: int = 0) -> list[dict]:
    return sorted(run.history("step", rank=rank), key=lambda e: e["step"])


def last_memory(run: Run, rank: int = 0) -> dict:
    """The memory dict of `rank`'s last step."""
    return memory(steps_of(run, rank)[-1])


def median_step_s(run: Run, skip: int = 1) -> float:
    """Median over steps (the first `skip` left out: warm-up) of the slowest rank's step time."""
    return statistics.median(step_samples(run, skip))


def memory_over_steps_figure(run: Run, title: str = "") -> go.Figure:
    """Per step and rank: the peak of aten allocations in the step (memory["peak"]), what is
    still allocated at the step's end (memory["allocated"]), and the model states
    (params + grads + optimizer state) for scale. Needs RunConfig.track_peak."""
    fig = go.Figure()
    ranks = sorted({e["rank"] for e in run.history("step")})
    for r in ranks:
        ev = steps_of(run, r)
        x = [e["step"] for e in ev]
        dash = "solid" if r == 0 else "dot"
        fig.add_scatter(x=x, y=[e["memory"]["peak"] / MiB for e in ev], mode="lines+markers",
                        name=f"rank {r}: peak in the step", line=dict(color=COLORS[6], dash=dash))
        fig.add_scatter(x=x, y=[e["memory"]["allocated"] / MiB for e in ev], mode="lines",
                        name=f"rank {r}: allocated at the step's end",
                        line=dict(color=COLORS[0], dash=dash))
        fig.add_scatter(x=x, y=[sum(e["memory"][k] for k in ("params", "grads", "optim")) / MiB
                                for e in ev], mode="lines",
                        name=f"rank {r}: params + grads + optimizer state",
                        line=dict(color=COLORS[2], dash=dash))
    fig.update_layout(title=title or "memory per step (aten allocations, MiB)", height=360,
                      xaxis_title="step", yaxis_title="MiB", template="plotly_white")
    fig.update_yaxes(rangemode="tozero")
    return fig


# -- the estimator beside the model -------------------------------------------------------------
def gpt_module_params(cfg: RunConfig, mlp_ratio: int) -> int:
    """Parameters of the GPT distlab.models builds for cfg's shape at MLP width `mlp_ratio`
    (gpt_param_count, which tests/test_model_data.py holds equal to the module's own count):
    what distlab.theory.estimate.gpt_params must match."""
    return gpt_param_count(dataclasses.replace(GPTConfig.from_run(cfg), mlp_ratio=mlp_ratio))


# -- inside one micro-batch ----------------------------------------------------------------------
WATCHED = ("tok_emb", "pos_emb", "blocks.0.ln1", "blocks.0.attn.q", "blocks.0.mlp.fc",
           "blocks.0.mlp.proj", "ln_f", "head")


def forward_breakdown(cfg: RunConfig, rank: int = 0, watched=WATCHED) -> dict:
    """One micro-batch of rank `rank`, as distlab.rank.train runs it (same init, same rows, same
    autocast, fp32_modules and checkpointing), forward and backward in this process:

        activations      ActivationMeter.bytes: what the step event logs as "activations"
        by_dtype         those bytes by dtype
        param_casts      ActivationMeter.param_cast_bytes: autocast's low-precision copies
                         of weights, saved for backward (not activations, not parameters)
        output_dtypes    {module: dtype of its output} for the `watched` modules
        param_dtypes     {dtype: parameters}; grad_dtypes the same for their gradients
    """
    from distlab.data.dataset import make_data
    from distlab.memory import ActivationMeter
    from distlab.rank.precision import apply_fp32_modules, param_dtypes
    from distlab.rank.build import build_model
    from distlab.rank.precision import autocast

    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    if cfg.fp32_modules:
        apply_fp32_modules(model, cfg.fp32_modules)
    modules = dict(model.named_modules())
    dtypes, handles = {}, []

    def record(name):
        def hook(module, inputs, output):  # returns None: the output is left as it is
            dtypes.setdefault(name, str(output.dtype)[6:])
        return hook

    for name in watched:
        if name in modules:
            handles.append(modules[name].register_forward_hook(record(name)))
    x_all, y_all = make_data(cfg).rank_batch(0, cfg.global_batch, rank, cfg.dp_degree)
    x, y = x_all.chunk(cfg.grad_accum)[-1], y_all.chunk(cfg.grad_accum)[-1]
    meter = ActivationMeter(model)
    with meter.measure(), autocast(cfg, torch.device("cpu")):
        loss = model(x, y) / cfg.grad_accum
    loss.backward()
    for h in handles:
        h.remove()
    grads: dict[str, int] = {}
    for p in model.parameters():
        k = str(p.grad.dtype)[6:]
        grads[k] = grads.get(k, 0) + p.numel()
    return {"activations": meter.bytes, "by_dtype": dict(meter.by_dtype),
            "param_casts": meter.param_cast_bytes, "output_dtypes": dtypes,
            "param_dtypes": param_dtypes(model), "grad_dtypes": grads}


# -- the loss scaler beside torch.amp.GradScaler ------------------------------------------------
def gradient_sequence(steps: int = 24, bad: dict | None = None, size: int = 6, seed: int = 1,
                      rms: float = 1e-3) -> list[torch.Tensor]:
    """A synthetic sequence of fp32 gradients (normal entries of root-mean-square `rms`), with
    one entry overwritten by inf, -inf or NaN at the steps in `bad` (default: three overflows
    in a row at steps 2-4, then 11 and 19): what a backward in fp16 hands the scaler when the
    scale is too large. tests/test_precision.py replays a real model's gradients the same way."""
    inf = float("inf")
    bad = {2: inf, 3: float("nan"), 4: inf, 11: -inf, 19: float("nan")} if bad is None else bad
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        g = torch.randn(size, generator=gen) * rms
        if i in bad:
            g[1] = bad[i]
        out.append(g)
    return out


def replay_scalers(grads: list[torch.Tensor], lr: float = 0.1, **scaler_kw) -> dict:
    """Feed one gradient sequence to distlab's DynamicLossScaler and to torch.amp.GradScaler
    ("cpu"), each driving its own SGD step on a parameter p (zeros at the start).

    Each step the loss is (p·g).sum(), so backward of scale·loss hands over S·g: exactly what a
    scaled backward produces. Then torch's `scaler.step(opt); scaler.update()`, or ours:
    `found = unscale_(grads); step unless found; update(found)`. Returns, per scaler
    ("distlab", "torch"): the scale each step used, whether the step was skipped (p unchanged),
    the scale after the last step and the final p."""
    from distlab.rank.precision import DynamicLossScaler

    out = {}
    for kind in ("distlab", "torch"):
        p = torch.zeros_like(grads[0], requires_grad=True)
        opt = torch.optim.SGD([p], lr=lr)
        scaler = (torch.amp.GradScaler("cpu", **scaler_kw) if kind == "torch"
                  else DynamicLossScaler(**scaler_kw))
        scales, skipped = [], []
        for g in grads:
            opt.zero_grad()
            scales.append(float(scaler.get_scale()))
            scaler.scale((p * g).sum()).backward()
            before = p.detach().clone()
            if kind == "torch":
                scaler.step(opt)
                scaler.update()
            else:
                found = scaler.unscale_([p.grad])
                if not found:
                    opt.step()
                scaler.update(found)
            skipped.append(torch.equal(before, p.detach()))
        out[kind] = {"scale": scales, "skipped": skipped, "final_scale": float(scaler.get_scale()),
                     "param": p.detach().clone()}
    return out


def scale_figure(run: Run, rank: int = 0, title: str = "") -> go.Figure:
    """The loss scale each step of an fp16 run used (log2), with the skipped steps marked, and
    the run's loss underneath: both from the step events."""
    ev = steps_of(run, rank)
    x = [e["step"] for e in ev]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        row_heights=[0.6, 0.4])
    fig.add_scatter(x=x, y=[math.log2(e["scale"]) for e in ev], mode="lines+markers",
                    line_shape="hv", name="log2(loss scale) used in the step",
                    line=dict(color=COLORS[0]), row=1, col=1)
    sk = [e for e in ev if e["skipped"]]
    fig.add_scatter(x=[e["step"] for e in sk], y=[math.log2(e["scale"]) for e in sk],
                    mode="markers", marker=dict(symbol="x", size=11, color=COLORS[4]),
                    name="skipped: inf/NaN in the scaled gradients", row=1, col=1)
    fig.add_scatter(x=x, y=[e["loss"] for e in ev], mode="lines", name="loss",
                    line=dict(color=COLORS[6]), row=2, col=1)
    fig.update_layout(title=title or "dynamic loss scaling in an fp16 run", height=460,
                      template="plotly_white")
    fig.update_yaxes(title_text="log2 scale", row=1, col=1)
    fig.update_yaxes(title_text="loss", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    return fig


# -- micro-batch sweep and the recipe ------------------------------------------------------------
def sweep_configs(base: RunConfig, settings: dict[str, dict], micro_batches) -> dict:
    """{(setting, micro-batch b): cfg}: for each setting (RunConfig changes) and b, the same
    global batch (base.global_batch) in micro-batches of b rows: grad_accum = global / b."""
    out = {}
    for name, changes in settings.items():
        for b in micro_batches:
            if base.global_batch % (base.dp_degree * b):
                raise ValueError(f"micro-batch {b} does not divide {base.global_batch} rows")
            out[(name, b)] = base.replace(grad_accum=base.global_batch // (base.dp_degree * b),
                                          **changes)
    return out


def largest_fitting(peaks: dict[int, int], budget: float) -> int | None:
    """The largest micro-batch whose measured peak is within `budget` (None: none fits)."""
    fits = [b for b, p in peaks.items() if p <= budget]
    return max(fits) if fits else None


def sweep_figure(peaks: dict[str, dict[int, int]], budget: float, title: str) -> go.Figure:
    """Measured peak per micro-batch size, one line per setting, and the budget line."""
    fig = go.Figure()
    for i, (name, by_b) in enumerate(peaks.items()):
        bs = sorted(by_b)
        fig.add_scatter(x=bs, y=[by_b[b] / MiB for b in bs], mode="lines+markers", name=name,
                        line=dict(color=COLORS[i % len(COLORS)]))
    fig.add_hline(y=budget / MiB, line_dash="dash", line_color="#c00",
                  annotation_text="budget: fp32 fits micro-batch 1, not 2",
                  annotation_position="top left")
    fig.update_layout(title=title, xaxis_title="micro-batch rows (same global batch)",
                      yaxis_title="peak MiB per rank", height=400, template="plotly_white")
    fig.update_xaxes(type="log", tickvals=sorted({b for v in peaks.values() for b in v}))
    return fig


def recipe_figure(rows: list[dict], budget: float) -> go.Figure:
    """Bars per recipe step: activations and peak per rank (MiB, left), step time (ms, right)."""
    names = [r["step"] for r in rows]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("bytes per rank (MiB)", "step time (ms)"))
    fig.add_bar(x=names, y=[r["activations"] / MiB for r in rows], name="activations",
                marker_color=COLORS[3], row=1, col=1)
    fig.add_bar(x=names, y=[r["peak"] / MiB for r in rows], name="peak in the step",
                marker_color=COLORS[6], row=1, col=1)
    fig.add_hline(y=budget / MiB, line_dash="dash", line_color="#c00", row=1, col=1,
                  annotation_text="budget", annotation_position="top right")
    fig.add_bar(x=names, y=[r["step_s"] * 1e3 for r in rows], name="step time",
                marker_color=COLORS[0], row=1, col=2)
    fig.update_layout(barmode="group", height=420, template="plotly_white",
                      title="the recipe, step by step (global batch fixed)")
    return fig


def replay_figure(rep: dict) -> go.Figure:
    """The scale each step used, DynamicLossScaler (thick) and GradScaler (thin, on top), with
    the steps each skipped."""
    fig = go.Figure()
    for i, (kind, width) in enumerate((("distlab", 6), ("torch", 2))):
        r = rep[kind]
        x = list(range(len(r["scale"])))
        name = "distlab DynamicLossScaler" if kind == "distlab" else "torch.amp.GradScaler"
        fig.add_scatter(x=x, y=[math.log2(s) for s in r["scale"]], mode="lines", line_shape="hv",
                        name=name, line=dict(width=width, color=COLORS[i * 4]))
        sk = [j for j, s in enumerate(r["skipped"]) if s]
        fig.add_scatter(x=sk, y=[math.log2(r["scale"][j]) for j in sk], mode="markers",
                        name=f"{name}: skipped", marker=dict(symbol="x" if i else "circle-open",
                                                             size=14 - 6 * i,
                                                             color=COLORS[i * 4]))
    fig.update_layout(title="one gradient sequence, two scalers", xaxis_title="step",
                      yaxis_title="log2(scale used)", height=340, template="plotly_white")
    return fig


# The sweep's settings by (precision, checkpointing): a one-rank recipe step is one of its runs.
SWEEP_SETTINGS = {("fp32", "none"): "fp32", ("bf16", "none"): "bf16",
                  ("bf16", "full"): "bf16 + full checkpointing"}

RECIPE_STEPS = ("fp32", "+ bf16", "+ full checkpointing", "+ accumulation", "+ more ranks",
                "accumulation alone")


def recipe_configs(base: RunConfig, micro: int, ranks: int = 2,
                   strategy: str = "allreduce") -> dict:
    """The "fits at batch 1, need batch 32" recipe, each step adding one lever to the step
    before it, all at the same global batch (base.global_batch, G rows):

        fp32                  G rows in one micro-batch: what does not fit
        + bf16                autocast
        + full checkpointing  each block recomputed in backward
        + accumulation        micro-batches of `micro` rows, G/micro of them per step
        + more ranks          `ranks` data-parallel ranks (`strategy`), each G/ranks rows in
                              micro-batches of `micro`
        accumulation alone    fp32, micro-batches of 1 row: the answer without the others

    Returns {step name: RunConfig} in that order."""
    G = base.global_batch
    if G % (ranks * micro):
        raise ValueError(f"global batch {G} does not split into {ranks} ranks x micro-batches "
                         f"of {micro}")
    s0 = base.replace(strategy="single", world_size=1, grad_accum=1, precision="fp32",
                      checkpointing="none")
    s2 = s0.replace(precision="bf16", checkpointing="full")
    return dict(zip(RECIPE_STEPS, (
        s0, s0.replace(precision="bf16"), s2, s2.replace(grad_accum=G // micro),
        s2.replace(strategy=strategy, world_size=ranks, grad_accum=G // (ranks * micro)),
        s0.replace(grad_accum=G))))


def recipe_memory(step: str, cfg: RunConfig, swept: dict, ranked: dict) -> list[dict]:
    """The last step's memory dict of each rank of one recipe step, from runs with the peak
    tracker on. A one-rank step is a config the sweep ran already: its run in `swept` (by
    "{setting}, micro {b}", the setting named in SWEEP_SETTINGS); a step on more ranks has its
    own run in `ranked`, by step name."""
    if cfg.world_size == 1:
        setting = SWEEP_SETTINGS[(cfg.precision, cfg.checkpointing)]
        return [last_memory(swept[f"{setting}, micro {cfg.micro_batch}"])]
    return [last_memory(ranked[step], r) for r in range(cfg.world_size)]


def recipe_rows(recipe: dict[str, RunConfig], swept: dict, timed: dict,
                ranked: dict) -> list[dict]:
    """One row per recipe step (recipe_configs' order): {"step", "cfg", "activations", "peak"
    (bytes, the most on any rank: the rank that must fit), "step_s"}. Memory as recipe_memory
    reads it; the step time (median_step_s) from runs with the tracker off, which costs time
    per op: a one-rank step's in `timed`, by step name, a step on more ranks' in `ranked`, by
    "{step}, timed"."""
    rows = []
    for step, cfg in recipe.items():
        ms = recipe_memory(step, cfg, swept, ranked)
        t = median_step_s(timed[step] if cfg.world_size == 1 else ranked[f"{step}, timed"])
        rows.append({"step": step, "cfg": cfg, "activations": max(m["activations"] for m in ms),
                     "peak": max(m["peak"] for m in ms), "step_s": t})
    return rows


def fastest_within(rows: list[dict], budget: float) -> dict:
    """The recipe row with the shortest step among those whose peak fits `budget`."""
    return min((r for r in rows if r["peak"] <= budget), key=lambda r: r["step_s"])


# -- shorter sequences: "activations ∝ seq_len" -------------------------------------------------
ATTENTION = {"flash": "gpt", "unfused": "distlab.models.gpt:gpt_unfused_attention"}


def seq_len_configs(base: RunConfig, lengths=(256, 64), ranks: int = 2, rows: int = 4) -> dict:
    """{(attention, s): RunConfig}: one fp32 ddp step on `ranks` ranks of `rows` rows of s
    tokens, for each row length and each attention: "flash" (this workbook's GPT: on CPU
    scaled_dot_product_attention keeps a log-sum-exp per head and position) and "unfused" (the
    same GPT whose attention makes and keeps its s×s scores, distlab.models.gpt, a model spec,
    with the GPT's own Markov data named as its data)."""
    cfg = base.replace(strategy="ddp", world_size=ranks, global_batch=rows, grad_accum=1,
                       steps=1, precision="fp32", checkpointing="none", track_peak=False)
    return {(kind, s): cfg.replace(model=model, seq_len=s,
                                   data="" if model == "gpt" else "distlab.data.dataset:make_data")
            for kind, model in ATTENTION.items() for s in lengths}


def activations_by_length(runs: dict) -> dict:
    """{(attention, s): bytes of activations a rank saved}: the largest over ranks and steps."""
    return {k: max(e["memory"]["activations"] for e in r.history("step")) for k, r in runs.items()}


def seq_len_scaling(acts: dict, cfgs: dict) -> dict:
    """Per attention: the activation ratio between the longest and the shortest rows, and the
    s² term read off two lengths. With A(s) = c1·s + c2·s², A/s = c1 + c2·s, so two lengths give
    c2 = (A1/s1 − A2/s2) / (s1 − s2); the s² part at s1 is c2·s1². `expected_s2` is what the
    unfused attention keeps per rank by count: per layer softmax's output, 4·a·b·s² bytes (b
    rows per rank), and the causal mask, s² bytes."""
    out = {}
    for kind in dict.fromkeys(k for k, _ in acts):
        s1, s2 = max(s for k, s in acts if k == kind), min(s for k, s in acts if k == kind)
        a1, a2 = acts[(kind, s1)], acts[(kind, s2)]
        c2 = (a1 / s1 - a2 / s2) / (s1 - s2)
        c = cfgs[(kind, s1)]
        out[kind] = {"s": (s1, s2), "bytes": (a1, a2), "ratio": a1 / a2,
                     "s2_bytes": c2 * s1 ** 2, "s2_share": c2 * s1 ** 2 / a1,
                     "expected_s2": c.n_layer * (4 * c.n_head * c.micro_batch + 1) * s1 ** 2}
    return out


def korthikanti_s2_share(cfg: RunConfig) -> float:
    """Korthikanti et al. 2022's share of a layer's activations that grows with s²: 5as/h of
    their sbh(34 + 5as/h) bytes (16-bit, with dropout; modelled)."""
    k = 5 * cfg.n_head * cfg.seq_len / cfg.n_embd
    return k / (34 + k)


SEQ_LEN_TOL = 0.05  # the ratio within 5% of the length ratio: the token ids' s + 1 and the
# loss's 4 bytes are well within it; an s² term of a few percent of the activations is not


def seq_len_row(scaling: dict, k_share: float) -> dict:
    """The claims row for the interview answer "activations ∝ seq_len: 4× shorter rows, 4×
    less memory", from seq_len_scaling's measurements: it holds only if every attention's
    activations followed the length within SEQ_LEN_TOL."""
    from distlab.lab.common import claim
    parts = []
    for kind, m in scaling.items():
        s1, s2 = m["s"]
        parts.append(f"{kind} attention ×{m['ratio']:.2f} from s = {s2} to {s1} (its s² part "
                     f"at {s1}: {m['s2_bytes']:,.0f} B, {m['s2_share']:.0%} of "
                     f"{m['bytes'][0]:,} B)")
    (s1, s2), = {m["s"] for m in scaling.values()}
    return claim(
        "activations ∝ seq_len: 4× shorter rows, 4× less activation memory (an interview "
        "answer)", "the question sets' answer; Korthikanti et al. 2022 (the 5as/h term)",
        f"measured per rank on 2 ranks, s × {s1 / s2:g}: " + "; ".join(parts)
        + f". Korthikanti's 5as/h term is {k_share:.0%} of a layer at the longer s (modelled)",
        all(abs(m["ratio"] / (s1 / s2) - 1) <= SEQ_LEN_TOL for m in scaling.values()))


# -- clipping is not overflow protection ---------------------------------------------------------
def clipping_after_overflow(scale: float = 2.0**24, max_norm: float = 1.0, seed: int = 0) -> dict:
    """Backward of scale·loss through an fp16 Linear, then clip_grad_norm_ as a training loop
    would: the overflow happens *in* backward (fp16's largest value is 65504), and clipping,
    which runs after backward on what backward produced, finds an infinite norm and turns the
    infinities into NaN (inf × 0). A loss scaler checks the gradients and skips the step."""
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(64, 64).half()
    x = torch.randn(32, 64, generator=g).half()
    loss = lin(x).float().pow(2).mean()
    (loss * scale).backward()
    grads = [p.grad for p in lin.parameters()]
    out = {"scale": scale, "numel": sum(t.numel() for t in grads),
           "inf_after_backward": sum(int(torch.isinf(t).sum()) for t in grads),
           "nan_after_backward": sum(int(torch.isnan(t).sum()) for t in grads)}
    norm = torch.nn.utils.clip_grad_norm_(lin.parameters(), max_norm)
    out["norm"] = float(norm)
    out["finite_after_clip"] = sum(int(torch.isfinite(t).sum()) for t in grads)
    return out


# -- GPU figures recorded in the repository (benchmarks/results) ---------------------------------
RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "results")


def recorded_gpu_speedup(folder: str = RESULTS) -> dict | None:
    """The newest benchmarks/results/gpu-*.txt (benchmarks/gpu.py's output, as printed on a GPU,
    with its date, commit and machine in its header): {"file", "header", "setup" (its first
    two lines: the GPU and torch, the GPT it trained), "speedup", "mfu"}.
    None where the folder has none (an installed package has no benchmarks folder)."""
    files = sorted(glob.glob(os.path.join(folder, "gpu-*.txt")))
    if not files:
        return None
    text = open(files[-1]).read()
    speedup = re.search(r"bf16 / fp32 step-time speed-up: ([\d.]+)x", text)
    mfu = re.search(r"bf16 MFU: ([\d.]+)%", text)
    header = [line[2:] for line in text.splitlines() if line.startswith("# ")]
    body = [line for line in text.split("## benchmarks/gpu.py", 1)[-1].splitlines() if line]
    return {"file": os.path.relpath(files[-1], os.path.join(folder, "..", "..")),
            "header": header, "setup": body[:2], "speedup": float(speedup.group(1)) if speedup else None,
            "mfu": float(mfu.group(1)) if mfu else None}


# -- AMP's speed-up: a GPU question -------------------------------------------------------------
AMP_CLAIM = "AMP (bf16 autocast) trains 2–3× faster than fp32 (an interview answer), TF32 {}"


def amp_rows(timings: dict | None, recorded: dict | None) -> list[dict]:
    """The two claims rows of "AMP is 2–3× faster", against fp32 with TF32 off and with it on.
    `timings`: distlab.studies.gpu.amp_timings' result on a GPU (each step a repeat: the rows
    are timed); None on a CPU, where bf16 has no fast matmuls and the rows read "not measured
    here", with what benchmarks/gpu.py recorded on a GPU (`recorded`: recorded_gpu_speedup())
    shown beside as a figure from elsewhere."""
    from distlab.lab.timed import timed_claim, within
    source = "interview answer; NVIDIA's mixed-precision training guide"
    rows = []
    for setting in ("off", "on"):
        text = AMP_CLAIM.format(setting)
        if timings is None:
            seen = "no figure recorded"
            if recorded is not None and setting == "off":  # benchmarks/gpu.py runs TF32 off
                model = recorded["setup"][1].split(" (")[0] if len(recorded["setup"]) > 1 else ""
                seen = f"{recorded['speedup']}× recorded in {recorded['file']} ({model})"
            rows.append(claim(text, source, f"no CUDA GPU in this run; measured elsewhere: "
                              f"{seen}", None, basis="not measured here"))
            continue
        fp32 = timings[f"fp32, TF32 {setting}"]["step_samples"]
        bf16 = timings["bf16 autocast"]["step_samples"]
        speedup = [a / b for a, b in zip(fp32, bf16)]
        rows.append(timed_claim(text, source, within(speedup, 2.0, 3.0),
                                {"fp32 / bf16 step time": speedup}, scale=1, unit="×",
                                interleaved_=False, note="step k of each run paired"))
    return rows
