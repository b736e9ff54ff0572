# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · Memory and precision: where the bytes go, and the levers that move them
#
# A rank's memory has five parts: the **parameters**, their **gradients**, the
# **optimizer state** (AdamW: two moments per weight), the **activations** (what the
# forward pass saves for the backward pass) and the **communication buffers** of the
# collectives. The first three, the *model states*, depend on the model and how it is
# sharded; the activations grow with the micro-batch and the sequence. This notebook
# measures all five on real runs and sets them beside the formulas of the papers:
#
# 1. **measured memory per rank**, by category, at the end of each step and at its peak,
#    live while the run trains;
# 2. **the analytic estimator** (`distlab.theory.estimate`) with its sources: the ZeRO paper's
#    7.5B-parameter example, Korthikanti et al.'s activation formulas for GPT-3, the
#    parameter count of a GPT, and this project's own runs, where the estimate must
#    equal the measurement;
# 3. **mixed precision**: bf16 and fp16 autocast against fp32, the fp32 master weights,
#    what autocast really saves, fp32 islands, bf16's rounding, fp16's underflow, the
#    dynamic loss scaler (beside `torch.amp.GradScaler`), and NaN detection;
# 4. **activation checkpointing** (full and selective) and **gradient accumulation**,
#    each measured: bytes saved, time paid;
# 5. the interview recipe for *"it fits at batch 1, we need batch 32"*: bf16 →
#    checkpointing → accumulation → more ranks, every step measured;
# 6. **FP8**: e4m3 and e5m2, why they need a scale per group of values, and what an
#    outlier channel does to each scaling (per tensor, per row, per 1×128 tile, per 128×128
#    block), measured on the GPT's own activations, with an explorer; then a closing table:
#    what the textbook says, what these runs measured;
# 7. **on a GPU**: bf16 against fp32 step time and CUDA's peak memory against the estimate,
#    measured only where there is a CUDA GPU.
#
# Sharding the model states across ranks (ZeRO, FSDP) is the next notebook's subject,
# `04_zero_and_fsdp`; here every rank holds the whole model.
#
# **Units.** Bytes are counted exactly. Figures from this machine are printed in MiB
# (2^20 bytes); the papers' figures in GB (10^9 bytes), as the papers print them.

# %% tags=["parameters"]
import os

# CI sets WORKBOOK_QUICK=1: tiny GPTs and few steps, so the notebook runs in about a minute.
QUICK = os.environ.get("WORKBOOK_QUICK", "0") == "1"
STEPS = 20 if QUICK else 100  # the live run
# The live run and the estimator checks. Quick: a 2-layer, 32-wide GPT on 16-token rows,
# global batch 8. Full: RunConfig's default GPT (4 layers, 128 wide, 64 tokens, batch 16).
GPT = dict(n_layer=2, n_embd=32, n_head=2, seq_len=16, global_batch=8) if QUICK else {}
# Mixed precision. fp16 autocast is ~12x slower on this CPU: these runs stay tiny.
PREC = dict(n_layer=2, n_embd=32, n_head=2, seq_len=16, global_batch=8)
PREC_STEPS = 12 if QUICK else 60
# Checkpointing, accumulation and the recipe: 64-token rows, so that activations, not
# the model, fill the memory (as in the interview question).
MEM = (dict(n_layer=2, n_embd=32, n_head=2, seq_len=64) if QUICK
       else dict(n_layer=2, n_embd=128, n_head=4, seq_len=64))
TARGET_BATCH = 32  # "we need batch 32"
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
MEM_STEPS = 2  # runs with the peak tracker on (it costs time per op)
TIME_STEPS = 6 if QUICK else 10  # runs timed with the tracker off
# FP8 (section 6): outlier sizes swept, and the steps of the activation stream that delayed
# scaling follows (one step of it multiplied by 10: a spike)
FP8_SIZES = (1, 100, 1e4) if QUICK else (1, 10, 100, 1e3, 1e4, 1e5)
FP8_STREAM = 12 if QUICK else 30
FP8_TRAIN_STEPS = 6 if QUICK else 120  # per precision, FP8 training's runs (section 6)
FP8_TRAIN_SEQ = 32 if QUICK else 64  # tokens per row
# One thread per rank: 2 cores, shared with other work. With 2 threads per
# rank the runs of section 4 took 109 s on this busy machine, with 1 thread 13 s.
THREADS = dict(threads_per_rank=1)

# %%
import math

import torch
from IPython.display import Markdown, display

from distlab import RunConfig, RunError, lab, launch
from distlab.theory import estimate as E
from distlab import units as U
from distlab.studies import gpu as G
from distlab.studies import fp8_scaling as S8
from distlab.studies import precision_lessons as P
from distlab.lab.common import MEMORY_CATEGORIES as CATEGORIES
from distlab.lab import fp8 as F8
from distlab.studies import fp8_training as S8T
from distlab.lab.common import claim, claims_table, fmt_bytes, mib, say, table
from distlab.lab.data_parallel import loss_figure
from distlab.lab.interview_code import claim_rows, run_all
from distlab.lab.memory_and_precision import (
    activations_by_length,
    clipping_after_overflow,
    fastest_within,
    forward_breakdown,
    gpt_module_params,
    gradient_sequence,
    korthikanti_s2_share,
    largest_fitting,
    last_memory,
    amp_rows,
    median_step_s,
    memory_over_steps_figure,
    recipe_configs,
    recorded_gpu_speedup,
    recipe_figure,
    recipe_rows,
    replay_figure,
    replay_scalers,
    scale_figure,
    seq_len_configs,
    seq_len_row,
    seq_len_scaling,
    steps_of,
    sweep_configs,
    sweep_figure,
)
from distlab.theory.estimate import autocast_weight_copy_bytes
from distlab.lab.runs import launch_together, max_step_loss_diff, median_step_change
from distlab.lab.time_to_train import step_samples
from distlab.lab.timed import below, timed_claim

torch.set_num_threads(1)  # this kernel's own few computations: one thread, like each rank

# %% [markdown]
# ## 1. Measured memory per rank, by category
#
# Two ranks train with `ddp` (DDP written here, `02_data_parallel`), with
# `track_peak=True`. After every step each rank logs, in bytes (`distlab.memory`):
#
# | key | what | how it is measured |
# |---|---|---|
# | `params`, `grads`, `optim` | model states this rank holds | numel × element size of each tensor |
# | `activations` | tensors autograd saved for backward in the forward | saved-tensor hooks, each storage once |
# | `comm_buffers` | scratch buffers of the collectives (DDP's buckets) | the strategy reports them |
# | `allocated` | bytes still allocated at the step's end (*current*) | a `TorchDispatchMode` that sees every aten allocation and its free |
# | `peak` | the most allocated at any moment of the step | the same tracker |
#
# On a GPU `peak` would be `torch.cuda.max_memory_allocated()`; this CPU has no allocator
# statistics, so the tracker counts what aten allocates (it misses buffers gloo makes
# inside a collective). The dashboard's memory panel stacks the categories per rank, and
# draws that rank's peak in the step as the outlined bar beside them. The stack is taller
# than the peak: its parts are never all live at once (the activations are freed as
# backward runs, before the optimizer step; the gradients after it). The peak is what
# was live together at the worst moment.

# %%
cfg = RunConfig(strategy="ddp", world_size=2, steps=STEPS, track_peak=True, **GPT, **THREADS)
run = launch(cfg)
dash = lab.watch(run)
run.wait()

# %%
n_params = run.info("n_params")
final = {r: last_memory(run, r) for r in (0, 1)}
table(["rank"] + [name for _, name in CATEGORIES] + ["allocated at the end", "peak"],
      [[r] + [mib(m[k]) for k, _ in CATEGORIES] + [mib(m["allocated"]), mib(m["peak"])]
       for r, m in final.items()])
display(Markdown(f"MiB, last step. {n_params:,} parameters."))
ids = 8 * cfg.global_batch * (cfg.seq_len + 1)  # the step's int64 token ids (data.py)
for r in (0, 1):
    for e in steps_of(run, r):
        m = e["memory"]
        states = m["params"] + m["grads"] + m["optim"]
        # DDP's buckets: one flat fp32 copy of every gradient
        assert m["comm_buffers"] == 4 * n_params
        # live at the step's end: model states, the buckets, the batch and the loss scalar
        assert m["allocated"] == states + m["comm_buffers"] + ids + 4
        # at the end of forward the activations are live beside the weights (and, after
        # step 0, AdamW's state, which its first step creates)
        assert m["peak"] >= m["params"] + m["activations"] + (m["optim"] if e["step"] else 0)
        assert m["peak"] >= states

# %% [markdown]
# Over the steps: the peak of step 0 is lower than the rest, because AdamW creates its two
# moments inside the first optimizer step, after the activations are gone; from step 1
# on they are live through the forward pass too. What is still allocated when a step ends
# (before its gradients are dropped) is the model states, DDP's buckets, the batch and the
# loss: the activations come and go inside every step. Same bytes on both ranks (each
# holds the whole model and half the batch).

# %%
memory_over_steps_figure(run, "memory per step, both ranks (MiB)").show()
peaks = [e["memory"]["peak"] for e in steps_of(run, 0)]
assert peaks[0] < peaks[1] and len(set(peaks[1:])) == 1  # same work every step from step 1
assert [e["memory"] for e in steps_of(run, 0)] == [e["memory"] for e in steps_of(run, 1)]

# %% [markdown]
# ## 2. The analytic estimator, and its sources
#
# `distlab.theory.estimate` returns bytes; you pick the unit and say which. The ZeRO paper
# (Rajbhandari et al. 2020, *ZeRO: Memory Optimizations Toward Training Trillion Parameter
# Models*, Section 5 and Figure 1) counts model states for Ψ parameters in mixed-precision
# Adam as 2Ψ (fp16 parameters) + 2Ψ (fp16 gradients) + KΨ with K = 12 (fp32 master
# weights, momentum and variance), and prints them in **GB = 10^9 bytes**. Its example:
# Ψ = 7.5B on N_d = 64 data-parallel ranks.

# %%
psi, n_d = 7.5e9, 64
zero = E.zero_table(psi, n_d, E.MIXED_ADAM)
formulas = ["(2 + 2 + K)Ψ", "2Ψ + 2Ψ + KΨ/N_d", "2Ψ + (2 + K)Ψ/N_d", "(2 + 2 + K)Ψ/N_d"]
PAPER_GB = [120, 31.4, 16.6, 1.9]  # Rajbhandari et al. 2020, Figure 1
table(["stage", "bytes per rank", "GB (10^9)", "GiB (2^30)", "paper, GB"],
      [[stage, f, f"{b / U.GB:.1f}", f"{b / U.GiB:.1f}", g]
       for (stage, b), f, g in zip(zero.items(), formulas, PAPER_GB)])
assert [round(b / U.GB, 1) for b in zero.values()] == PAPER_GB
# the same bytes in binary units read 7% smaller: 120 GB is 111.8 GiB
assert round(zero["plain DP"] / U.GiB, 1) == 111.8
# our fp32 AdamW runs: 4 + 4 + 8 bytes per parameter: the same 16 as mixed precision's 2 + 2 + 12
assert E.FP32_ADAM.total == E.MIXED_ADAM.total == 16

# %% [markdown]
# **Activations.** Korthikanti et al. 2022 (*Reducing Activation Recomputation in Large
# Transformer Models*, Section 4, Table 2) count the bytes one transformer layer saves with
# 16-bit activations and dropout: sequence s, micro-batch b, hidden h, heads a, tensor-
# parallel degree t. Here for GPT-3 175B (Brown et al. 2020: 96 layers, h = 12288,
# a = 96, s = 2048), b = 1, t = 8. The 5as/h term is the s×s attention scores (softmax
# and dropout); *selective* recomputation recomputes exactly that part, *full*
# recomputation keeps only each layer's input.

# %%
s, b, h, a, L, t = 2048, 1, 12288, 96, 96, 8
f = E.korthikanti_layer_activation_bytes
rows = {
    "no parallelism": ("sbh(34 + 5as/h)", f(s, b, h, a)),
    f"tensor parallel, t = {t}": ("sbh(10 + 24/t + 5as/(ht))", f(s, b, h, a, t=t)),
    "tensor + sequence parallel": ("sbh/t · (34 + 5as/h)", f(s, b, h, a, t=t, sequence_parallel=True)),
    "tensor parallel + selective recomputation": ("sbh(10 + 24/t)", f(s, b, h, a, t=t, recompute="selective")),
    "tensor + sequence parallel + selective": ("34·sbh/t", f(s, b, h, a, t=t, sequence_parallel=True, recompute="selective")),
    "full recomputation": ("2·sbh", f(s, b, h, a, t=t, recompute="full")),
}
table(["GPT-3, b = 1", "bytes per layer", "GB per layer", f"GB, {L} layers"],
      [[k, fm, f"{v / U.GB:.2f}", f"{L * v / U.GB:.1f}"] for k, (fm, v) in rows.items()])
print(f"5as/h = {5 * a * s / h:g}: the attention scores outweigh the other 34 bytes per sbh")
# Section 5: selective recomputation cuts GPT-3's activation memory by 70% (t = 1)
cut = 1 - f(s, b, h, a, recompute="selective") / f(s, b, h, a)
assert round(cut, 2) == 0.70
# abstract: "reduces activation memory by 5x" (TP baseline over TP + SP + selective, t = 8)
five = rows[f"tensor parallel, t = {t}"][1] / rows["tensor + sequence parallel + selective"][1]
assert round(five) == 5
print(f"selective recomputation, t = 1: -{cut:.0%};  TP -> TP+SP+selective, t = 8: {five:.2f}x smaller")

# %% [markdown]
# **Parameters.** A GPT layer holds four h×h attention matrices (q, k, v, o) and an MLP
# h → rh → h: 4h² + 2rh² weights, 12h² at the usual MLP width r = 4, hence the papers'
# 12·L·h². `gpt_params` counts every term (biases, LayerNorms, embeddings, untied head),
# for any MLP width; Narayanan et al. 2021 (Section 5.1) give the closed form
# 12Lh²(1 + 13/(12h) + (V + s)/(12Lh)) for GPT-3's layout (tied head).

# %%
L_, h_, V_, s_ = cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.seq_len
table(["MLP width r", "per layer 4h² + 2rh² + biases + norms", "gpt_params (formula)",
       "GPT module (built)"],
      [[r, f"{4 * h_**2 + 2 * r * h_**2 + (4 + r + 1) * h_ + 4 * h_:,}",
        f"{E.gpt_params(L_, h_, V_, s_, mlp_ratio=r):,}",
        f"{gpt_module_params(cfg, r):,}"]
       for r in (1, 2, 4, 8)])
for r in (1, 2, 4, 8):
    assert E.gpt_params(L_, h_, V_, s_, mlp_ratio=r) == gpt_module_params(cfg, r)
assert E.gpt_params_of(cfg) == n_params  # the run's own count (its start event)
gpt3 = E.narayanan_params(96, 12288, 51200, 2048)
print(f"this run's GPT (r = {cfg.mlp_ratio}): {n_params:,} parameters")
print(f"GPT-3: 12Lh² = {E.transformer_params_approx(96, 12288) / 1e9:.1f}B; "
      f"with biases, norms and embeddings (Narayanan et al.) {gpt3 / 1e9:.1f}B")
assert round(gpt3 / 1e9, 1) == 174.6

# %% [markdown]
# **This project's runs.** `run_model_state_bytes(cfg)` and `gpt_activation_bytes(cfg)`
# are derived for our GPT and our loop (fp32): 4 bytes per parameter, 4 per gradient, AdamW's
# 8 plus a 4-byte step counter per parameter tensor; and, per layer,
# 4·sbh(8 + 2r) + 4·sb(4 + a) bytes of saved tensors (the `gpt_activation_bytes`
# docstring lists each one). They count the very tensors the ranks measure, so they must
# agree to the byte: at every step, on both ranks of the live run.

# %%
est = E.run_model_state_bytes(cfg)
act_est, parts = E.gpt_activation_bytes(cfg, breakdown=True)
measured = last_memory(run, 0)
table(["category", "estimate (bytes)", "measured, rank 0, last step", "formula"],
      [["params", f"{est['params']:,}", f"{measured['params']:,}", "4Ψ"],
       ["grads", f"{est['grads']:,}", f"{measured['grads']:,}", "4Ψ"],
       ["optim", f"{est['optim']:,}", f"{measured['optim']:,}",
        f"8Ψ + 4 × {E.gpt_param_tensors(cfg)} tensors"],
       ["activations", f"{act_est:,}", f"{measured['activations']:,}",
        f"{cfg.n_layer} layers × {parts['per_layer']:,} + head {parts['head']:,} + ids {parts['ids']:,}"]])
for e in run.history("step"):  # every step, both ranks
    assert {k: e["memory"][k] for k in est} == est
    assert abs(e["memory"]["activations"] - act_est) <= 0.10 * act_est  # the brief's bound
    assert e["memory"]["activations"] == act_est  # and in fact exact
# Korthikanti's 34 bytes per sbh, less two 1-byte dropout masks (we have none), is 16
# values of 2 bytes; ours are the same 16 values at 4 bytes, plus LayerNorm statistics
# and the attention's log-sum-exp (4·sb(4 + a)). Their 5as/h term is absent here: on CPU,
# scaled_dot_product_attention runs a flash kernel that keeps no s×s matrix.
sb = cfg.seq_len * cfg.micro_batch
assert parts["per_layer"] == 4 * 16 * sb * cfg.n_embd + 4 * sb * (4 + cfg.n_head)

# %% [markdown]
# ## 3. Mixed precision
#
# Under `RunConfig(precision="bf16" | "fp16")` the loop runs the forward in
# `torch.autocast`: matmuls get low-precision *copies* of their inputs and weights; the
# parameters, their gradients and AdamW's state stay fp32 (Micikevicius et al. 2018's
# *fp32 master weights*). fp16 adds dynamic loss scaling (below). Four runs, two ranks
# each, in one launch: fp32, bf16, bf16 with the embedding and the head kept in fp32
# (`fp32_modules`), and fp16 with a first loss scale of 2^24, too large on purpose.

# %%
PBASE = RunConfig(strategy="ddp", world_size=2, steps=PREC_STEPS, track_peak=True, **PREC,
                  **THREADS)
prec_cfgs = {
    "fp32": PBASE,
    "bf16": PBASE.replace(precision="bf16"),
    "bf16, tok_emb + head in fp32": PBASE.replace(precision="bf16", fp32_modules="tok_emb,head"),
    "fp16, dynamic loss scale": PBASE.replace(precision="fp16", loss_scale_init=2.0**24,
                                              loss_scale_growth_interval=3),
}
prec = launch_together(prec_cfgs, name="precision")
loss_figure({k: r.losses() for k, r in prec.items()}, "loss per step, same data and init",
            floor=prec["fp32"].info("loss_floor")).show()
fp32_l, bf16_l = prec["fp32"].losses(), prec["bf16"].losses()
bf16_rel = max(abs(x - y) / x for x, y in zip(fp32_l, bf16_l))
print(f"bf16 vs fp32, largest relative loss difference per step: {bf16_rel:.1e}")
# bf16 keeps 8 significant bits, but only the matmuls' inputs are rounded; weights,
# gradients and the loss stay fp32 (tests/test_precision.py: rtol 1e-2, ~4e-4 observed)
assert bf16_l != fp32_l and bf16_rel < 1e-2
fp16_l = prec["fp16, dynamic loss scale"].losses()
assert fp16_l[-1] < fp16_l[0]  # fp16 trains too, once the scale has come down

# %% [markdown]
# **fp32 master weights.** The model states of every run are the same bytes: the bf16 and
# fp16 runs hold fp32 parameters, fp32 gradients and fp32 AdamW moments, 4 + 4 + 8 = 16
# bytes per parameter like the fp32 run. (The ZeRO paper's mixed-precision Adam also
# totals 16, as 2 + 2 + 12: fp16 weights and gradients, with the fp32 master copy inside
# K.) Precision changes the activations and the peak, not the model states.

# %%
rows = []
for name, r in prec.items():
    m = last_memory(r)
    rows.append([name, mib(m["params"]), mib(m["grads"]), mib(m["optim"]),
                 mib(m["activations"]), mib(m["peak"])])
    assert {k: m[k] for k in ("params", "grads", "optim")} == E.run_model_state_bytes(r.cfg)
    assert {str(v.dtype) for v in r.states[0].values()} == {"torch.float32"}
table(["run", "params", "grads", "optim", "activations", "peak"], rows)
display(Markdown("MiB, rank 0, last step. Final parameters of every run: all float32."))
peak_ratio_small = last_memory(prec["bf16"])["peak"] / last_memory(prec["fp32"])["peak"]

# %% [markdown]
# **What autocast saves for backward.** Under autocast a matmul saves its *input* cast to
# bf16 (an activation, at half the bytes) and the bf16 *copy of its weight* that autocast
# made (2 bytes per weight, whatever the batch). That copy is neither a parameter nor an
# activation; `ActivationMeter` counts it apart (`param_cast_bytes`: a saved tensor whose
# autograd node is a dtype copy of a parameter), so the logged `activations` are
# activations only. Some saved tensors stay fp32 under CPU autocast: LayerNorm's input
# and statistics, the residual stream, log-softmax's output. `forward_breakdown` reruns
# one micro-batch of rank 0 in this process, as the loop does, and splits the bytes by dtype.

# %%
fb = {name: forward_breakdown(c) for name, c in prec_cfgs.items()}
table(["run", "activations (logged)", "of which fp32", "bf16 / fp16", "int64 ids",
       "weight copies (measured)", "weight copies, formula 2 × matmul weights"],
      [[name, mib(last_memory(prec[name])["activations"]), mib(d["by_dtype"].get("float32", 0)),
        mib(d["by_dtype"].get("bfloat16", 0) + d["by_dtype"].get("float16", 0)),
        mib(d["by_dtype"].get("int64", 0)), mib(d["param_casts"]),
        mib(autocast_weight_copy_bytes(prec_cfgs[name]))] for name, d in fb.items()])
n_params_prec = prec["fp32"].info("n_params")
for name, d in fb.items():
    assert d["activations"] == last_memory(prec[name])["activations"]  # same bytes as the run
    assert d["param_casts"] == autocast_weight_copy_bytes(prec_cfgs[name])
    assert d["param_dtypes"] == d["grad_dtypes"] == {"float32": n_params_prec}  # master weights
act_ratio_small = fb["bf16"]["activations"] / fb["fp32"]["activations"]
print(f"bf16 activations / fp32 activations: {act_ratio_small:.2f} (not 0.5: "
      f"{fb['bf16']['by_dtype']['float32'] / fb['bf16']['activations']:.0%} of them stay fp32)")
assert 0.5 < act_ratio_small < 1.0

# %% [markdown]
# **Selective precision.** `fp32_modules="tok_emb,head"` wraps those modules' forward in
# `autocast(enabled=False)` with float32 inputs: an fp32 island. The output dtype of each
# module, recorded by forward hooks in the same one-micro-batch rerun:

# %%
names = list(fb["fp32"]["output_dtypes"])
cols = ["bf16", "bf16, tok_emb + head in fp32", "fp16, dynamic loss scale"]
table(["module output"] + cols, [[n] + [fb[c]["output_dtypes"][n] for c in cols] for n in names])
island = fb["bf16, tok_emb + head in fp32"]["output_dtypes"]
assert fb["bf16"]["output_dtypes"]["head"] == "bfloat16" and island["head"] == "float32"
assert island["blocks.0.attn.q"] == island["blocks.0.mlp.fc"] == "bfloat16"  # autocast elsewhere
# embedding lookups are not on CPU autocast's list: fp32 either way
assert fb["bf16"]["output_dtypes"]["tok_emb"] == island["tok_emb"] == "float32"
print("parameters:", fb["bf16, tok_emb + head in fp32"]["param_dtypes"],
      " gradients:", fb["bf16, tok_emb + head in fp32"]["grad_dtypes"])

# %% [markdown]
# **Why master weights: the update that rounds away.** bf16 keeps fp32's 8 exponent bits
# and 7 mantissa bits; fp16 has 5 and 10. Near 1.0 bf16's spacing is 2^-7 ≈ 0.0078: an
# update of 1e-3 is below half of it, so a bf16 weight never moves. `rounding_demo` adds
# 1e-3 a hundred times to a weight of 1.0 stored in each format, and to an fp32 master
# weight that is cast to bf16 only for use.

# %%
fmt = P.formats()
table(["format", "bits", "eps (spacing above 1)", "smallest normal", "smallest subnormal", "max"],
      [[k, v["bits"], f"{v['eps']:.3g}", f"{v['smallest_normal']:.3g}",
        f"{v['smallest_subnormal']:.3g}", f"{v['max']:.3g}"] for k, v in fmt.items()])
rd = P.rounding_demo(w=1.0, update=1e-3, steps=100)
table(["weight stored in", "after 1 update", "after 100 updates (exact: 1.1)"],
      [[k, f"{rd[k]['after_one_update']:.7f}", f"{rd[k]['after_100_updates']:.7f}"]
       for k in ("fp32", "bf16", "fp16")]
      + [["fp32 master, cast to bf16 for use", "", f"{rd['fp32_master']['as_bf16']:.7f}"]])
assert rd["bf16"]["after_100_updates"] == 1.0  # every update rounded away
assert rd["fp16"]["after_100_updates"] != 1.1  # each update rounded to 2^-10
assert abs(rd["fp32_master"]["after_100_updates"] - 1.1) < 1e-5
assert rd["fp32_master"]["as_bf16"] == torch.tensor(1.1).bfloat16().item()  # kept, then rounded once

# %% [markdown]
# **fp16 underflow.** fp16's smallest subnormal is 2^-24 ≈ 6e-8. Late in training many
# gradient entries are smaller. `fp16_underflow_demo` takes a real gradient of the
# default GPT (one step, fp32), rescales it to a root-mean-square entry of 1e-5 (a 1B-
# parameter model with gradient norm 0.3), and casts it to fp16 as it is, and multiplied
# by a loss scale of 2^16.

# %%
uf = P.fp16_underflow_demo(rms=1e-5, scale=2.0**16)
table(["gradient entries cast to fp16", "become 0"],
      [["unscaled", f"{uf['zero_fraction_unscaled']:.2%}"],
       ["× 2^16", f"{uf['zero_fraction_scaled']:.3%}"],
       ["× 2^16, leaving out the key projections' biases (gradient analytically 0)",
        f"{uf['zero_fraction_scaled_without_k_bias']:.3%}"]])
say(f"unscaled, {uf['subnormal_fraction_unscaled']:.1%} of the entries are below fp16's "
    f"smallest normal (2^-14): even the survivors lose mantissa bits")
assert uf["zero_fraction_unscaled"] > 0.05 and uf["zero_fraction_scaled_without_k_bias"] == 0.0
assert uf["overflow_fraction_scaled"] == 0.0

# %% [markdown]
# **bf16 is not fp16.** bf16 keeps fp32's 8 exponent bits and gives up mantissa: its
# smallest normal number is fp32's (~1.2e-38), so a small gradient does not underflow in
# bf16; it is *rounded*, to 8 significant bits. An interview answer on bf16 "small
# gradients that might underflow" says 0.00012 "rounds to 0.000122 or 0.000115", and
# advises higher learning rates for layers with small gradients. Measured here: the bf16
# neighbours of 0.00012 (torch.nextafter), tiny values cast to bf16 and fp16, and AdamW's
# first step for the same gradient at three scales.

# %%
small = P.bf16_small_values()
steps = P.adamw_step_vs_gradient_scale()
lo, hi = small["neighbours"]
table(["value", "in bf16", "in fp16"],
      [[f"{t:g}", "kept" if v["bf16"] else "**0**", "kept" if v["fp16"] else "**0**"]
       for t, v in small["survives"].items()])
say(f"0.00012 in bf16 becomes {small['as_bf16']:.9g}; its bf16 neighbours are {lo:.9g} and "
    f"{hi:.9g} (spacing {hi - lo:.2g}).",
    "AdamW's first step (lr 1e-3) for the gradient ×" + ", ×".join(
        f"{s:g} → {d:.3g}" for s, d in steps.items()) + ": the step does not shrink with the "
    "gradient.")
assert all(v["bf16"] for v in small["survives"].values())

# %% [markdown]
# **The dynamic loss scaler** (`precision.DynamicLossScaler`). Backward of S·loss gives
# S·gradients. The scaler unscales them in fp32 and checks for inf/NaN: if any, the step is
# skipped and S halves; after `growth_interval` clean steps in a row S doubles. The fp16
# run above started at S = 2^24; its step events carry the scale each step used and
# whether it was skipped:

# %%
fp16_run = prec["fp16, dynamic loss scale"]
scale_figure(fp16_run, title="fp16 run: loss scale and skipped steps (from its step events)").show()
ev = [steps_of(fp16_run, r) for r in (0, 1)]
scales, skipped = [e["scale"] for e in ev[0]], [e["skipped"] for e in ev[0]]
n_skipped = sum(skipped)
n_first = next(i for i, sk in enumerate(skipped) if not sk)  # skipped while coming down from 2^24
print(f"{n_skipped} of {len(skipped)} steps skipped; the scale went from 2^24 down to "
      f"2^{math.log2(min(scales)):g} and ended at 2^{math.log2(scales[-1]):g}")
# the ranks agree (DDP averaged the infs onto both; the found-inf flag is all-reduced too)
assert [(e["scale"], e["skipped"]) for e in ev[0]] == [(e["scale"], e["skipped"]) for e in ev[1]]
assert skipped[0] and not all(skipped)  # 2^24 overflows; a smaller scale does not
s, clean = 2.0**24, 0  # the rule, step by step: halve on overflow, double after 3 clean steps
for used, skip in zip(scales, skipped):
    assert used == s
    clean = 0 if skip else clean + 1
    if skip:
        s /= 2
    elif clean == 3:
        s, clean = s * 2, 0

# %% [markdown]
# **Clipping does not prevent fp16 overflow.** An interview answer has gradient clipping
# "prevent fp16 overflow". Clipping runs after backward, on the gradients backward produced;
# an overflow happens *in* backward, when a value passes fp16's largest (65504). The run
# above overflowed at 2^24 and the scaler skipped those steps. `clipping_after_overflow`
# repeats one such backward (an fp16 Linear, loss × 2^24) and then clips to norm 1 as a
# training loop would: the norm is infinite, the clip factor 1/inf = 0, and inf × 0 is NaN.

# %%
clip = clipping_after_overflow(scale=2.0**24, max_norm=1.0)
table(["gradient entries", "inf after backward", "norm clipping saw",
       "finite after clipping"],
      [[clip["numel"], clip["inf_after_backward"], clip["norm"], clip["finite_after_clip"]]])
say(f"{clip['inf_after_backward']} entries inf after backward, "
    f"{clip['numel'] - clip['finite_after_clip']} not finite after clipping"
    + (": the overflow reached the optimizer anyway; the loss scaler skips such a step"
       if clip["finite_after_clip"] < clip["numel"] else ""))

# %% [markdown]
# Does it behave like `torch.amp.GradScaler`? `replay_scalers` feeds one synthetic
# gradient sequence (`gradient_sequence`: 24 steps, inf/NaN planted at steps 2, 3, 4, 11
# and 19) to both, each driving its own SGD step, with a first scale of 2^10 and growth
# every 3 clean steps. Same scale each step, same skipped steps, bitwise the same
# parameter at the end (both multiply fp32 gradients by the same fp32 1/S).

# %%
rep = replay_scalers(gradient_sequence(steps=24), init_scale=2.0**10, growth_interval=3)
replay_figure(rep).show()
ours, ref = rep["distlab"], rep["torch"]
assert ours["scale"] == ref["scale"] and ours["final_scale"] == ref["final_scale"]
assert ours["skipped"] == ref["skipped"] == [i in (2, 3, 4, 11, 19) for i in range(24)]
assert torch.equal(ours["param"], ref["param"])
print(f"scales equal at all {len(ours['scale'])} steps; skipped steps "
      f"{[i for i, s in enumerate(ours['skipped']) if s]} in both; final parameter bitwise equal")

# %% [markdown]
# **NaN detection.** A NaN spreads: one bad weight makes every later activation, the loss
# and every gradient NaN. `RunConfig(detect_nan=True)` hooks every module and names the
# first one whose output (or gradient) is not finite, and the step. The drill
# `fault="nan"` writes a NaN into one weight of `blocks.1.mlp.proj` on rank 1 at step 3:

# %%
nan_cfg = PBASE.replace(steps=6, track_peak=False, detect_nan=True, fault="nan",
                        fault_rank=1, fault_step=3, fault_module="blocks.1.mlp.proj")
nan_run = launch(nan_cfg)
try:
    nan_run.wait()
except RunError as e:
    err = e
else:
    raise AssertionError("the poisoned run finished without an error")
print(f"RunError: rank {err.rank}, step {err.step}\n{err.message}")
[nan_event] = nan_run.history("nan")
assert (err.rank, err.step) == (1, 3)
assert "'blocks.1.mlp.proj'" in err.message and "step 3 in forward" in err.message
assert (nan_event["module"], nan_event["phase"]) == ("blocks.1.mlp.proj", "forward")

# %% [markdown]
# ## 4. Activation checkpointing and gradient accumulation
#
# **Checkpointing** (`distlab.rank.recompute`, per GPT block, applied from outside by name):
# `full` keeps only each block's input and reruns the whole block in backward; `selective`
# keeps the matmul outputs (q, k, v, o, fc, proj) and recomputes the cheap ops (LayerNorm,
# GELU, attention core, adds). Per layer, in values per position: none 8 + 2r (16 at
# r = 4), selective 6 + r (10), full 1.
#
# **Accumulation** keeps the global batch and cuts it into micro-batches: the activations
# follow the micro-batch. One launch (one process) runs the three checkpointing modes
# (once with the peak tracker, once timed without it) and the micro-batch sweep of
# sections 4 and 5: global batch 32 in micro-batches of 1 … 32 rows, in fp32, bf16, and
# bf16 with full checkpointing.

# %%
MBASE = RunConfig(global_batch=TARGET_BATCH, steps=MEM_STEPS, track_peak=True, **MEM, **THREADS)
MODES = ("none", "selective", "full")
CK = {m: MBASE.replace(global_batch=8, checkpointing=m) for m in MODES}
SETTINGS = {"fp32": {}, "bf16": dict(precision="bf16"),
            "bf16 + full checkpointing": dict(precision="bf16", checkpointing="full")}
sweep = sweep_configs(MBASE, SETTINGS, MICRO_BATCHES)
mem = launch_together({**{f"ckpt {m}": c for m, c in CK.items()},
                       **{f"ckpt {m}, timed": c.replace(track_peak=False, steps=TIME_STEPS)
                          for m, c in CK.items()},
                       **{f"{s}, micro {b}": c for (s, b), c in sweep.items()}}, name="memory")
print(f"{len(mem)} configs in one launch")

# %%
ck = {m: last_memory(mem[f"ckpt {m}"]) for m in MODES}
ck_t = {m: median_step_s(mem[f"ckpt {m}, timed"]) for m in MODES}
ck_est = {m: E.gpt_activation_bytes(CK[m]) for m in MODES}
c0 = CK["none"]
kept = {"none": 8 + 2 * c0.mlp_ratio, "selective": 6 + c0.mlp_ratio, "full": 1}  # values per position
k_core = 5 * c0.n_head * c0.seq_len / c0.n_embd
k_kept = {"none": 34 + k_core, "selective": 34, "full": 2}  # Korthikanti, bytes per sbh, t = 1
table(["mode", "activations measured", "estimate", "saved vs none", "a layer keeps (ours)",
       "a layer keeps (Korthikanti, this s, h, a)", "peak", "step ms (tracker off)", "vs none"],
      [[m, mib(ck[m]["activations"]), mib(ck_est[m]),
        f"{1 - ck[m]['activations'] / ck['none']['activations']:.0%}",
        f"{kept[m] / kept['none']:.0%}", f"{k_kept[m] / k_kept['none']:.0%}",
        mib(ck[m]["peak"]), f"{ck_t[m] * 1e3:.1f}", f"{ck_t[m] / ck_t['none']:.2f}×"] for m in MODES])
display(Markdown(f"MiB; GPT {c0.n_layer}×{c0.n_embd}, {c0.micro_batch} rows of {c0.seq_len} tokens, fp32."))
for m in MODES:
    assert ck[m]["activations"] == ck_est[m]  # the estimate is exact here too
assert ck["none"]["activations"] > ck["selective"]["activations"] > ck["full"]["activations"]
assert ck["none"]["peak"] > ck["selective"]["peak"] > ck["full"]["peak"]
act_saved_full = 1 - ck["full"]["activations"] / ck["none"]["activations"]
act_saved_sel = 1 - ck["selective"]["activations"] / ck["none"]["activations"]
peak_saved_full = 1 - ck["full"]["peak"] / ck["none"]["peak"]

# %% [markdown]
# Full checkpointing keeps 1 value per position of the 16 a layer saved, so most of the
# activation bytes go; what is left is the head (ln_f and the log-softmax of the logits,
# 4·sbV bytes) and the token ids, which no block checkpoint touches. "Selective" names
# different cuts: Korthikanti et al. drop the attention scores (their 5as/h); our flash
# attention keeps no scores, so ours drops the LayerNorm and GELU outputs instead, and the
# two happen to keep a similar share of a layer. The *peak* falls less: it also holds
# the model states, and during backward one block's recomputed activations at a time.
# The price is time: full reruns every block's forward (about a third more compute);
# selective costs less compute, but here, with tiny matmuls, torch's selective
# checkpointing pays a Python dispatch cost per op that can make it as slow as full
# (`distlab.rank.recompute`'s docstring has the numbers for larger models). Step times on a
# shared 2-core machine move by tens of percent from run to run: read them as rough.
#
# **Accumulation as the memory lever.** Same global batch of 32, micro-batches of
# 1 … 32 rows: the measured peak per rank, for each setting:

# %%
peaks = {s: {b: last_memory(mem[f"{s}, micro {b}"])["peak"] for b in MICRO_BATCHES}
         for s in SETTINGS}
# the budget of section 5: a device on which fp32 fits micro-batch 1 but not 2
budget = (peaks["fp32"][1] + peaks["fp32"][2]) / 2
sweep_figure(peaks, budget, f"peak per rank vs micro-batch, global batch {TARGET_BATCH}").show()
table(["micro-batch"] + list(SETTINGS),
      [[b] + [mib(peaks[s][b]) for s in SETTINGS] for b in MICRO_BATCHES])
for s in SETTINGS:  # smaller micro-batches, smaller peak, every setting
    assert [peaks[s][b] for b in MICRO_BATCHES] == sorted(peaks[s][b] for b in MICRO_BATCHES)
# Same global batch, same updates: the fp32 losses agree to rounding whatever the
# micro-batch (the sums run in another order). AdamW amplifies that rounding in
# near-zero gradients (measured on torch 2.13 CPU: up to ~4e-5 in the parameters after 5
# steps); we measured up to 5e-5 in the loss after 20 steps. 2e-4 allows that, and stays far below
# what a lost or doubled micro-batch would do (the checks below compare it with the
# loss's own change from one step to the next).
ACCUM_TOL = 2e-4
sweep_losses = {b: mem[f"fp32, micro {b}"].losses() for b in MICRO_BATCHES}
accum_diff = max(max_step_loss_diff(sweep_losses[b], sweep_losses[32]) for b in MICRO_BATCHES)
print(f"fp32, micro-batches of 1 … 32: largest loss difference from the whole batch {accum_diff:.1e}")
assert accum_diff < ACCUM_TOL
peak_saved_accum = 1 - peaks["fp32"][1] / peaks["fp32"][32]
one_row = peaks["bf16"][1] / peaks["fp32"][1]
say(f"at 1 row, bf16's peak is {one_row:.2f}× fp32's: its 2-byte weight copies "
    f"({mib(autocast_weight_copy_bytes(sweep[('bf16', 1)]))} MiB) against one row's "
    f"activations saved; at 32 rows {peaks['bf16'][32] / peaks['fp32'][32]:.2f}×")

# %% [markdown]
# ## 5. "It fits at batch 1. We need batch 32."
#
# The textbook interview answer: bf16 first, then gradient
# checkpointing, then accumulation for what is left, and more GPUs if you have them. Here
# the device is simulated by a **budget**: halfway between fp32's measured peaks at
# micro-batches 1 and 2, so that fp32 fits batch 1 and not batch 2, as in the question.
# The sweep above says, for each setting, the largest micro-batch whose measured peak
# fits. Each step of the recipe adds one lever to the step before, at the same global
# batch of 32 rows; its memory is the peak tracker's (the sweep's runs, and a tracked run
# on 2 ranks), its step time comes from separate runs with the tracker off.

# %%
fit = {s: largest_fitting(p, budget) for s, p in peaks.items()}
table(["setting", "largest micro-batch within the budget"], [[s, b] for s, b in fit.items()])
assert fit["fp32"] == 1  # by the budget's definition
b_fit = fit["bf16 + full checkpointing"]
assert b_fit > fit["fp32"]
recipe = recipe_configs(MBASE, micro=b_fit, ranks=2)
one = {k: c for k, c in recipe.items() if c.world_size == 1}
two = {k: c for k, c in recipe.items() if c.world_size == 2}
timed1 = launch_together({k: c.replace(track_peak=False, steps=TIME_STEPS) for k, c in one.items()},
                         name="recipe-w1")
runs2 = launch_together({**{k: c for k, c in two.items()},
                         **{f"{k}, timed": c.replace(track_peak=False, steps=TIME_STEPS)
                            for k, c in two.items()}}, name="recipe-w2")

# %%
# memory: the sweep's run of each one-rank step, the tracked run of each two-rank step
rows = recipe_rows(recipe, swept=mem, timed=timed1, ranked=runs2)
table(["step", "ranks × micro-batches × rows", "precision, checkpointing",
       "activations / rank", "peak / rank", "fits?", "step ms", "vs fp32 at once"],
      [[r["step"], f"{r['cfg'].world_size} × {r['cfg'].grad_accum} × {r['cfg'].micro_batch}",
        f"{r['cfg'].precision}, {r['cfg'].checkpointing}", mib(r["activations"]), mib(r["peak"]),
        "yes" if r["peak"] <= budget else "no", f"{r['step_s'] * 1e3:.0f}",
        f"{r['step_s'] / rows[0]['step_s']:.1f}×"] for r in rows])
display(Markdown(f"MiB; budget {mib(budget)} MiB. Every rank runs one thread: two ranks "
                 f"use both of this machine's cores, one rank uses one."))
recipe_figure(rows, budget).show()
R = {r["step"]: r for r in rows}
for step in ("fp32", "+ bf16", "+ full checkpointing"):
    assert R[step]["peak"] > budget  # 32 rows at once do not fit, whatever the precision
for step in ("+ accumulation", "+ more ranks", "accumulation alone"):
    assert R[step]["peak"] <= budget  # measured: these fit
assert R["fp32"]["peak"] > R["+ bf16"]["peak"] > R["+ full checkpointing"]["peak"]
assert R["fp32"]["activations"] > R["+ bf16"]["activations"] > R["+ full checkpointing"]["activations"]
peak_ratio_bf16 = R["+ bf16"]["peak"] / R["fp32"]["peak"]
act_ratio_bf16 = R["+ bf16"]["activations"] / R["fp32"]["activations"]
fastest = fastest_within(rows, budget)
print(f"fastest within the budget on this machine: {fastest['step']} "
      f"({fastest['step_s'] * 1e3:.0f} ms per step)")
# accumulation alone reaches batch 32 as well: its losses equal the whole batch's
whole = timed1["fp32"].losses()
alone_diff = max_step_loss_diff(timed1["accumulation alone"].losses(), whole)
accum_steps = step_samples(timed1["accumulation alone"], skip=1)
fp32_steps = step_samples(timed1["fp32"], skip=1)
step_change = median_step_change(whole)
say(f"accumulation alone vs the whole batch: largest loss difference {alone_diff:.1e} over "
    f"{len(whole)} steps; the loss's median change per step {step_change:.1e}")
assert alone_diff < ACCUM_TOL < step_change / 10

# %% [markdown]
# Read the table from the top. bf16 and checkpointing shrink what a row costs, but 32 rows
# at once still do not fit: accumulation is what brings batch 32 within the budget, and
# more ranks then share the micro-batches (each rank here is one thread, so two ranks use
# both of this machine's cores and add an all-reduce per step).
#
# What each lever costs in *time* depends on the hardware, and this is a CPU: it has no
# faster bf16 matmuls, autocast's casts cost time that tiny matrices do not hide, and full
# checkpointing reruns every block's forward. So on this machine the levers that shrink a
# row can be slower than accumulation alone; the cell above prints which configuration
# within the budget was fastest. On a GPU bf16 matmuls are the fast path (tensor cores),
# which is why the interview answer puts bf16 first; that is not measured here.

# %% [markdown]
# **Shorter rows.** The same answer goes on: "activations ∝ seq_len: 4× shorter rows, 4× less
# memory". Korthikanti et al.'s formula, the one section 2 compares with, has a term that
# grows with s², not s: the attention scores, s × s per head and row (their 5as/h, beside
# 34 per sbh). Whether it is there depends on the attention kernel. One launch on 2 ranks
# measures a step's activations at rows of 256 and 64 tokens (the answer's 2048 and 512 scaled
# down), for this workbook's GPT (on CPU
# `scaled_dot_product_attention` runs a flash kernel that keeps one log-sum-exp per head and
# position) and for the same GPT whose attention makes and keeps its scores
# (`distlab.models.gpt.unfused_causal_attention`, as kernels without flash attention do). Two
# lengths give the s² part: with A(s) = c₁s + c₂s², A/s = c₁ + c₂s.

# %%
S_LONG, S_SHORT = 256, 64  # the answer's 4×: 2048 → 512 tokens
seq_cfgs = seq_len_configs(MBASE, lengths=(S_LONG, S_SHORT))
seq_runs = launch_together({f"{k}, s = {s}": c for (k, s), c in seq_cfgs.items()}, name="seq-len")
seq_acts = activations_by_length({(k, s): seq_runs[f"{k}, s = {s}"] for k, s in seq_cfgs})
seq = seq_len_scaling(seq_acts, seq_cfgs)
table(["attention", f"activations / rank, s = {S_SHORT} / {S_LONG}", "ratio",
       f"s² part at {S_LONG} (fit)",
       "by count: 4·a·b·s² + s² per layer"],
      [[k, f"{mib(m['bytes'][1])} / {mib(m['bytes'][0])}", f"×{m['ratio']:.2f}",
        f"{mib(m['s2_bytes'])} ({m['s2_share']:.0%})", mib(m["expected_s2"])]
       for k, m in seq.items()])
k_share = korthikanti_s2_share(seq_cfgs[("unfused", S_LONG)])
say(f"MiB; GPT {MBASE.n_layer}×{MBASE.n_embd}, {MBASE.n_head} heads, "
    f"{seq_cfgs[('flash', S_LONG)].micro_batch} rows per rank, fp32. Korthikanti's 5as/h term "
    f"at this a, h and s = {S_LONG}: {k_share:.0%} of a layer (16-bit, with dropout; modelled)")

# %% [markdown]
# With flash attention the activations follow the length; with the scores kept they grow
# faster, and the s² part read off the two lengths is the bytes softmax's output and the
# causal mask take, counted. "4× shorter, 4× less" is a floor when the scores are kept: the
# saving is larger, by the share the scores have at the longer length.

# %% [markdown]
# **GPT-3 and bf16.** An interview answer has GPT-3 trained in bf16. Brown et al. 2020
# (§2.3) trained it on V100 GPUs, "on part of a high-bandwidth cluster provided by
# Microsoft"; the V100 (Volta) has fp16 tensor cores and no bf16 support, which arrived with
# the A100 (Ampere). The paper does not state the precision it trained in; the hardware
# rules bf16 out. This is a citation, not a measurement, so it is not a row below.

# %% [markdown]
# ## 6. FP8: eight bits and their scales
#
# FP8 keeps 3 mantissa bits (e4m3, for weights and activations) or 2 (e5m2, for gradients),
# and a range far narrower than bf16's: e4m3's largest value is 448. A tensor is therefore
# stored **with a scale**, `q = fp8(x · s)`, `s = 448 / amax`, so that its largest magnitude
# lands on the format's largest value and the rest of the range is used. One scale per
# tensor is torchao's `tensorwise` float8; one per row its `rowwise`; DeepSeek-V3 (2024,
# §3.3.2) scales activations per **1×128 tile** and weights per **128×128 block**.
# Everything below is written in `distlab.fp8` (torchao, the reference library, is not
# installed here); its products equal `torch._scaled_mm`'s, FP8's matmul, which runs on the
# CPU (`tests/test_fp8.py`).
#
# Why the group matters: LLM activations carry a few channels far larger than the rest
# (Dettmers et al. 2022). The outlier sets its group's scale, and every other value of the
# group is scaled down with it: towards e4m3's **subnormals** (below 2^-6 they lose mantissa
# bits) and, below half of 2^-9, to **zero**. The GPT below (2 blocks, 256 wide, 5 AdamW
# steps) gives its own activations, every `nn.Linear`'s input; 4 channels of each are made
# outliers, 1× to 10^5× (full mode), and each scheme's error is measured on the **other**
# values, the ones the outlier's scale hurts.

# %%
table(["format", "bits", "eps (spacing above 1)", "smallest normal", "smallest subnormal",
       "max"], F8.formats_rows())
fp8_tensors = S8.gpt_tensors()
fp8_sweep = S8.outlier_sweep(fp8_tensors, sizes=FP8_SIZES)
F8.sweep_figure(fp8_sweep).show()
fp8_by = {(r["size"], r["scheme"]): r for r in fp8_sweep}
table(["outlier size"] + [f"{s}: error / flushed" for s in ("tensorwise", "block1x128")],
      [[f"{z:g}x"] + [f"{fp8_by[z, s]['rel_error']:.4f} / {100 * fp8_by[z, s]['flushed']:.2f}%"
                      for s in ("tensorwise", "block1x128")] for z in FP8_SIZES])
fp8_cross = S8.crossover(fp8_sweep)
fp8_ratio = max(fp8_by[z, "tensorwise"]["rel_error"] / fp8_by[z, "block1x128"]["rel_error"]
                for z in FP8_SIZES)

# %% [markdown]
# FP8 is a floating format: scaling the other values down shifts their exponents and keeps
# their 3 mantissa bits, so an outlier costs precision only once it pushes them into the
# subnormals, and only then does a smaller group help. An int8 format, with one step size for
# the whole range, would lose bits from the first factor of 2. The outliers here sit in whole
# channels, so every row and most 1×128 tiles hold one; a tile helps only where it does not.
#
# **Delayed scaling** (Micikevicius et al. 2022; Transformer Engine's default) takes the
# scale from the largest amax of the last 16 steps, known before the tensor is: no pass over
# it before the cast. The first MLP's input, step by step over a run at a high learning
# rate, cast with the delayed scale and with its own (dynamic); then the same stream with one
# step's activations ×10, which the history has not seen: beyond 448 a cast saturates.

# %%
fp8_stream = S8.activation_stream(steps=FP8_STREAM)
spike = 2 * FP8_STREAM // 3
fp8_delayed = {"as trained": S8.delayed_vs_dynamic(fp8_stream),
               f"step {spike} x10": S8.delayed_vs_dynamic(fp8_stream, spikes={spike: 10.0})}
table(["stream", "delayed: mean error", "dynamic: mean error", "delayed: worst step saturated",
       "dynamic: worst step saturated"],
      [[name, f"{sum(r['delayed_error'] for r in d) / len(d):.4f}",
        f"{sum(r['dynamic_error'] for r in d) / len(d):.4f}",
        f"{100 * max(r['delayed_saturated'] for r in d):.3f}%",
        f"{100 * max(r['dynamic_saturated'] for r in d):.3f}%"] for name, d in fp8_delayed.items()])

# %% [markdown]
# Pick a scaling and an outlier size and press **Run**: the histogram is where the values
# beside the outliers land once scaled, against e4m3's subnormal and zero thresholds (the
# first MLP's input; the cell runs it once itself).

# %%
fp8_explorer = F8.FP8Explorer(fp8_tensors["blocks.0.mlp.fc.input"])
fp8_explorer.run(scheme="tensorwise", size=10_000)
fp8_explorer.widget

# %% [markdown]
# ### Training in FP8
#
# `RunConfig(precision="fp8", fp8_scaling=...)` makes each block's `nn.Linear` run its three
# matmuls, the forward's and backward's two, on FP8 operands: e4m3 for the weight and the
# input, e5m2 for the output's gradient, each cast with its own scale along the dimension
# its matmul sums over (`distlab.rank.fp8_linear`). The products accumulate in fp32; the
# master weights, the optimizer and every other op stay fp32, and the embeddings, the norms,
# the output head and an MoE's router stay out of FP8, as in DeepSeek-V3 (§3.3.1). The same
# GPT (256 wide, so a row holds two 1×128 tiles) and the same data, on 2 ranks under `ddp`,
# in fp32, bf16 and FP8 with each scaling, in one launch; the figure is each loss minus
# bf16's, step by step (the curves themselves lie on top of each other).
# `tests/test_fp8_training.py` checks the three matmuls against `torch._scaled_mm` on the same
# FP8 bytes, and ddp and zero3 on 2 ranks against one process on the same micro-batches.
#
# The same launch then runs **zero3** two steps three times, all-gathering the FP8 Linears'
# weights in fp32, in bf16 (FSDP's `param_dtype`) and in e4m3 with one scale per weight
# (`fp8_all_gather=True`, torchao's float8 all-gather: each weight's amax over every rank's
# shard travels first, 4 bytes a weight, so every rank casts its piece with the scale the
# Linear's tensorwise cast takes from the whole weight).

# %%
fp8_train = F8.run_precisions(S8T.BASE.replace(steps=FP8_TRAIN_STEPS, seq_len=FP8_TRAIN_SEQ),
                              with_gathers=True)
fp8_losses = {name: run.losses() for name, run in fp8_train.items()
              if not name.startswith("zero3")}
F8.training_figure(fp8_losses).show()
fp8_gaps = S8T.gap_rows(fp8_losses)
table(["precision", "final loss (mean of the last quarter)", "gap to bf16"],
      [[r["precision"], f"{r['final_loss']:.4f}", f"{100 * r['gap_to_bf16']:+.2f}%"]
       for r in fp8_gaps])
fp8_gather = S8T.gather_rows(F8.gather_bytes(fp8_train))
table(["zero3, FP8 Linears' weights", "all-gather bytes per step (rank 0)",
       "amax bytes per step", "total / bf16's"],
      [[r["gather"], fmt_bytes(r["weights"]), fmt_bytes(r["scales"]),
        f"{r['ratio_to_bf16']:.4f}"] for r in fp8_gather])
fp8_e4m3 = next(r for r in fp8_gather if r["gather"] == "zero3 fp8 gather")

# %% [markdown]
# ## What the textbook says, what these runs measured
#
# Every figure comes from this notebook's runs, or, marked "modelled", from
# `distlab.theory.estimate`'s formulas with the paper's configuration; every verdict is computed
# from them, and a row reads **no** where the run disagrees. The rows that rest on counted
# bytes and bitwise comparisons are asserted; the interview answers' figures and the
# timing are shown. The one row that reads a clock ("32× slower") is **timed**: decided over
# each step after the first as a repeat, with its min / median / max; load from other programs
# widens the spreads and can turn it undecided.

# %%
fp_steps = [e for e in run.history("step")]
states_equal = all({k: e["memory"][k] for k in est} == est for e in fp_steps)
acts = sorted({e["memory"]["activations"] for e in fp_steps})
zero_gb = [round(b / U.GB, 1) for b in zero.values()]
claims = [
    claim("ZeRO: 7.5B params, N_d = 64: 120 → 31.4 → 16.6 → 1.9 GB", "Rajbhandari et al. 2020, "
          "Figure 1", "estimate.zero_table: " + " → ".join(f"{b:g}" for b in zero_gb)
          + f" GB (10^9 bytes); in GiB (2^30) {zero['plain DP'] / U.GiB:.1f} → … → "
          f"{zero['P_os+g+p (ZeRO-3)'] / U.GiB:.2f}", zero_gb == [120.0, 31.4, 16.6, 1.9],
          basis="arithmetic"),
    claim("selective recomputation saves 70% of GPT-3's activations; TP + SP + selective is "
          "5× below TP", "Korthikanti et al. 2022",
          f"estimate.gpt_activation_bytes' terms at their GPT-3 configuration: {cut:.0%} and "
          f"{five:.2f}×", round(cut, 2) == 0.70 and round(five) == 5, basis="modelled"),
    claim("model-state bytes = 4Ψ + 4Ψ + (8Ψ + 4 per tensor) for fp32 AdamW",
          "Rajbhandari et al. 2020 (K = 12 less the fp16 copy)",
          f"measured on both ranks, {len(fp_steps)} rank-steps: params {measured['params']:,}, "
          f"grads {measured['grads']:,}, optim {measured['optim']:,} B; formula "
          f"{est['params']:,} / {est['grads']:,} / {est['optim']:,}", states_equal),
    claim("activation estimate within 10%", "estimate.gpt_activation_bytes",
          f"measured {', '.join(f'{a:,}' for a in acts)} B on every rank and step; estimate "
          f"{act_est:,} B", all(abs(a - act_est) <= 0.10 * act_est for a in acts)),
    claim("\"checkpointing saves ~50% of activation memory\"", "interview answer",
          f"full: {act_saved_full:.0%} of the activation bytes, selective: "
          f"{act_saved_sel:.0%}; the peak fell {peak_saved_full:.0%} (full); step time "
          f"{ck_t['full'] / ck_t['none']:.2f}× (full), {ck_t['selective'] / ck_t['none']:.2f}× "
          "(selective)", abs(act_saved_full - 0.5) <= 0.1),
    claim("\"bf16: 2× memory reduction, can fit batch 2\"", "interview answer",
          f"model states unchanged (fp32 master weights, grads, AdamW: 16 bytes/param); "
          f"activations ×{act_ratio_bf16:.2f}, plus 2-byte weight copies; peak "
          f"×{peak_ratio_bf16:.2f} at 32 rows, ×{peak_ratio_small:.2f} in the small runs; "
          f"largest micro-batch within the budget: {fit['bf16']} (fp32: {fit['fp32']})",
          peak_ratio_bf16 <= 0.55),
    claim("bf16 trains like fp32 (within 1% per step)", "Kalamkar et al. 2019",
          f"largest relative loss difference {bf16_rel:.1e} over {PREC_STEPS} steps",
          bf16_rel < 1e-2),
    claim("loss scaling prevents fp16 underflow", "Micikevicius et al. 2018",
          f"unscaled, {uf['zero_fraction_unscaled']:.1%} of gradient entries (RMS 1e-5) become "
          f"0 in fp16; × 2^16: {uf['zero_fraction_scaled']:.3%} (only analytically-zero "
          f"biases). fp16 run: {n_skipped} of {len(skipped)} steps skipped, {n_first} while "
          "the scale came down from 2^24",
          uf["zero_fraction_unscaled"] > 0.05 and uf["zero_fraction_scaled_without_k_bias"] == 0),
    claim("gradient clipping prevents fp16 overflow (an interview answer)", "interview answer",
          f"an fp16 backward at scale 2^24: {clip['inf_after_backward']} of {clip['numel']} "
          f"gradient entries inf before clipping could act; after clipping (norm "
          f"{clip['norm']}) {clip['numel'] - clip['finite_after_clip']} are NaN",
          clip["inf_after_backward"] == 0 and clip["finite_after_clip"] == clip["numel"]),
    claim("our loss scaler = torch.amp.GradScaler", "torch.amp docs",
          f"{len(rep['torch']['scale'])} steps: same scale at every step "
          f"{rep['distlab']['scale'] == rep['torch']['scale']}, same skipped steps "
          f"{rep['distlab']['skipped'] == rep['torch']['skipped']}, parameter bitwise equal "
          f"{torch.equal(rep['distlab']['param'], rep['torch']['param'])}",
          rep["distlab"]["scale"] == rep["torch"]["scale"]
          and rep["distlab"]["skipped"] == rep["torch"]["skipped"]
          and torch.equal(rep["distlab"]["param"], rep["torch"]["param"])),
    claim("NaN detection names the step and the module", "distlab.debug.nan",
          f"rank {err.rank}, step {err.step}: '{nan_event['module']}' ({nan_event['phase']}); "
          "poisoned: rank 1, step 3, blocks.1.mlp.proj",
          (err.rank, err.step, nan_event["module"]) == (1, 3, "blocks.1.mlp.proj")),
    claim("\"accumulation = large batch\"", "interview answer; Goyal et al. 2017",
          f"same losses to {max(accum_diff, alone_diff):.0e} (micro-batches of 1 … 32 rows; "
          f"tolerance {ACCUM_TOL:g}); peak {peak_saved_accum:.0%} lower at 1 row",
          max(accum_diff, alone_diff) < ACCUM_TOL),
    # timed: every step after the first is a repeat; "32× slower" holds when accumulation's
    # steps lie above 16× (half the claim) the whole batch's, no when they lie below it
    timed_claim("\"32× slower\" at 1 row × 32", "interview answer",
                {True: False, False: True, None: None}[below(accum_steps, fp32_steps, 16)],
                {"1 row × 32": accum_steps, "32 rows at once": fp32_steps},
                interleaved_=False,
                note=f"step time ×{R['accumulation alone']['step_s'] / R['fp32']['step_s']:.1f} "
                     "(medians): a 1-row micro-batch costs less than a 32-row one"),
    claim("recipe: bf16 → checkpointing → accumulation → more ranks fits batch 32",
          "interview answer",
          f"fits with micro-batches of {b_fit} rows (fp32: 1): peak "
          f"{mib(R['+ accumulation']['peak'])} and {mib(R['+ more ranks']['peak'])} MiB on "
          f"2 ranks, budget {mib(budget)}; step {R['+ accumulation']['step_s'] * 1e3:.0f} ms, "
          f"{R['+ more ranks']['step_s'] * 1e3:.0f} ms on 2 ranks, vs "
          f"{R['accumulation alone']['step_s'] * 1e3:.0f} ms for accumulation alone (fastest "
          f"within the budget here: {fastest['step']}; CPU, no fast bf16 matmuls)",
          R["+ accumulation"]["peak"] <= budget and R["+ more ranks"]["peak"] <= budget),
]
# the bf16 answer's statements, each the claim; they read no where this run refutes them
bf16_rows = [
    claim("BF16 small gradients (below 1e-4) might underflow (an interview answer)",
          "the question sets' answer; torch.finfo(torch.bfloat16)",
          "cast to bf16: " + ", ".join(f"{t:g} {'kept' if v['bf16'] else 'becomes 0'}"
                                       for t, v in small["survives"].items())
          + "; in fp16: " + ", ".join(f"{t:g} {'kept' if v['fp16'] else 'becomes 0'}"
                                      for t, v in small["survives"].items()),
          not all(v["bf16"] for v in small["survives"].values())),
    claim("in BF16, 0.00012 rounds to 0.000122 or 0.000115 (an interview answer)",
          "the question sets' answer; IEEE-style rounding of bf16 (8 significant bits)",
          f"its bf16 neighbours are {lo:.6g} and {hi:.6g} (spacing {hi - lo:.2g}); "
          f"it becomes {small['as_bf16']:.6g}",
          {round(lo, 6), round(hi, 6)} == {0.000122, 0.000115}),
    claim("layer-wise learning rates: give layers with small gradients higher learning rates "
          "(an interview answer, with AdamW)", "the question sets' answer; Loshchilov & "
          "Hutter 2019 (AdamW)",
          "AdamW's first step for the gradient ×" + ", ×".join(
              f"{sc:g} → {d:.3g}" for sc, d in steps.items())
          + ": a small gradient does not make a small step",
          steps[min(steps)] < 0.5 * steps[max(steps)]),
]
# "Model: 10GB; batch 1: 2GB activations -> 12GB, fits a 16GB GPU": 10 GB of bf16 weights is
# 5B parameters; training them with Adam (mixed precision) keeps 16 bytes each (the ZeRO
# paper's count, which section 1's runs match byte for byte)
psi_10gb = 10e9 / 2
states_10gb = E.zero_model_states(psi_10gb, 1, 0, E.MIXED_ADAM).device
bf16_rows.append(claim(
    "a 10 GB model trains at batch 1 on a 16 GB GPU (2 GB of activations: 12 GB) (an "
    "interview answer)", "the question sets' answer; Rajbhandari et al. 2020 (16 bytes per "
    "parameter for mixed-precision Adam)",
    f"10 GB of bf16 weights = {psi_10gb / 1e9:.0f}B parameters; with Adam's states "
    f"{states_10gb / 1e9:.0f} GB + 2 GB of activations = {(states_10gb + 2e9) / 1e9:.0f} GB",
    states_10gb + 2e9 <= 16e9, basis="arithmetic"))
# E3's offloading code, the block that quotes DeepSpeed.initialize, run whole in a fresh Python
code_rows = claim_rows(run_all(["deepspeed_initialize"]))
# the answer's "activations ∝ seq_len", against the two lengths measured above
seq_row = seq_len_row(seq, k_share)
# FP8 (section 6): "survives" = the other values' error within 1.5x of no outlier's and under
# 1% of them flushed, at every size up to 10^4x (the sizes LLM outlier channels reach)
fp8_base = fp8_by[FP8_SIZES[0], "tensorwise"]["rel_error"]
fp8_up_to = [z for z in FP8_SIZES if z <= 1e4]
fp8_survives = {z: fp8_by[z, "tensorwise"]["rel_error"] <= 1.5 * fp8_base
                and fp8_by[z, "tensorwise"]["flushed"] < 0.01 for z in fp8_up_to}
plain, spiked = fp8_delayed.values()
fp8_rows = [
    claim("one scale per tensor survives an outlier channel (FP8 e4m3)", "torchao's float8 "
          "tensorwise recipe; DeepSeek-V3 (2024) §3.3.2 scales per tile for this reason",
          ", ".join(f"{z:g}x: error {fp8_by[z, 'tensorwise']['rel_error']:.4f}, flushed "
                    f"{100 * fp8_by[z, 'tensorwise']['flushed']:.2f}% "
                    f"({'survives' if ok else 'does not'})" for z, ok in fp8_survives.items())
          + f"; 'survives': within 1.5x of {fp8_base:.4f} and under 1% flushed",
          all(fp8_survives.values())),
    claim("scaling per 1x128 tile is 10x more accurate than per tensor beside outliers",
          "DeepSeek-V3 (2024) §3.3.2",
          f"the other values' error, tensorwise over 1x128, at most {fp8_ratio:.1f}x over "
          f"{', '.join(f'{z:g}x' for z in FP8_SIZES)}"
          + (f"; 10x from {fp8_cross:g}x" if fp8_cross else "; never 10x"),
          fp8_cross is not None and fp8_cross <= 1e4),
    claim("delayed scaling costs nothing while activations change slowly, and saturates at a "
          "spike", "Micikevicius et al. 2022 (FP8 formats); Transformer Engine's delayed "
          "scaling", f"mean error delayed {sum(r['delayed_error'] for r in plain) / len(plain):.4f}"
          f" vs dynamic {sum(r['dynamic_error'] for r in plain) / len(plain):.4f}; at a 10x "
          f"spike {100 * max(r['delayed_saturated'] for r in spiked):.1f}% saturated",
          sum(r["delayed_error"] for r in plain) <= 1.05 * sum(r["dynamic_error"] for r in plain)
          and max(r["delayed_saturated"] for r in spiked) > 0.1),
    claim("training in FP8 reaches bf16's loss", "DeepSeek-V3 (2024) §3.3: relative loss "
          "error below 0.25% against BF16 at scale; the bar here is 2%",
          ", ".join(f"{r['precision']} {100 * r['gap_to_bf16']:+.2f}%" for r in fp8_gaps
                    if r["precision"].startswith("fp8"))
          + f" from bf16's {S8T.final_loss(fp8_losses['bf16']):.4f} after {FP8_TRAIN_STEPS} "
          "steps",
          all(abs(r["gap_to_bf16"]) <= 0.02 for r in fp8_gaps)),
    claim("all-gathering FP8 weights halves FSDP's bytes against bf16 (the scales cost next to "
          "nothing)", "torchao's float8 all-gather for FSDP2 (as torchtitan trains with it)",
          f"FP8 weights plus amaxes: {fp8_e4m3['ratio_to_bf16']:.4f} of the bf16 "
          f"gather's bytes ({fmt_bytes(fp8_e4m3['scales'])} of amaxes a step); within 2% of "
          "half",
          abs(fp8_e4m3["ratio_to_bf16"] - 0.5) <= 0.01),
]
claims_table(claims + [seq_row] + bf16_rows + code_rows + fp8_rows)
interview = {4, 5, 8, 12}  # the interview answer's figures and the clipping answer: shown, either way
assert all(c["holds"] for i, c in enumerate(claims) if i not in interview), \
    [c["claim"] for i, c in enumerate(claims) if i not in interview and not c["holds"]]

# %% [markdown]
# ## 7. On a GPU
#
# Everything above ran on this CPU, where bf16 has no fast matmuls. On a GPU, bf16 autocast
# runs the matmuls on tensor cores, and `torch.cuda.max_memory_allocated` is the allocator's
# own peak, to set beside the estimator's model states plus activations. The cell below
# measures both with a small GPT (`distlab.studies.gpu.time_training`: the library's model, AdamW and
# autocast) when a CUDA GPU is present. Without one it says so, measures nothing, and shows
# instead what `benchmarks/gpu.py` printed the last time it ran on a GPU, as recorded in the
# repository (`benchmarks/results/`, with the machine, date and commit): a figure measured
# elsewhere, not by this run. `benchmarks/gpu.py` is the full-size version (a GPT that fills
# the GPU, FLOP/s and MFU), and `tests/gpu` checks every CUDA path; see the README.
#
# The usual answer says AMP makes training **2–3× faster**. On a GPU since Ampere, "fp32" has
# two speeds: with TF32 on (torch's `allow_tf32` switches), fp32 matmuls run on the tensor
# cores with a 10-bit mantissa, and bf16's lead shrinks. So the claim gets two rows, timed on a
# GPU over each step as a repeat: against fp32 with TF32 off and with it on. Here, without a
# GPU, both read "not measured here", beside what was recorded elsewhere.

# %%
if torch.cuda.is_available():
    gpu_cfg = RunConfig(n_layer=4, n_embd=512, n_head=8, seq_len=256, global_batch=16,
                        vocab_size=4096)
    gpu_rows = G.amp_timings(gpu_cfg, "cuda", steps=8, warmup=2)
    gpu_est = G.gpt_bytes_fp32(gpu_cfg)
    table(["precision", "step ms", "tokens/s", "max_memory_allocated MiB",
           "estimate (fp32 states + activations) MiB"],
          [[p, f"{r['step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}", mib(r["peak_bytes"]),
            mib(gpu_est)] for p, r in gpu_rows.items()])
    say(f"{torch.cuda.get_device_name()}: bf16 / fp32 step time, medians: "
        f"{gpu_rows['fp32, TF32 off']['step_s'] / gpu_rows['bf16 autocast']['step_s']:.2f}x "
        f"with TF32 off, "
        f"{gpu_rows['fp32, TF32 on']['step_s'] / gpu_rows['bf16 autocast']['step_s']:.2f}x on")
    rec = None
else:
    gpu_rows = None
    print("no CUDA GPU here: nothing above or below was measured on a GPU by this run")
    rec = recorded_gpu_speedup()
    if rec is None:
        print("and no GPU measurement is recorded in this copy (benchmarks/results/)")
    else:
        print(f"Recorded in {rec['file']}, measured elsewhere, not here:")
        print("  " + "\n  ".join(rec["header"][1:3] + rec["setup"]))
        print(f"  bf16 / fp32 step-time speed-up {rec['speedup']}x, bf16 MFU {rec['mfu']}%")
# "AMP is 2-3x faster": timed on a GPU, with TF32 off and on; not measured on a CPU
claims_table(amp_rows(gpu_rows, rec))
