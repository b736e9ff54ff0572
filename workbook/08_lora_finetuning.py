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
# # 08 · LoRA, transfer learning and forgetting
#
# A model pre-trained on one task is fine-tuned on a second. This notebook trains the tiny
# GPT on **task 0** (a Markov chain), then on **task 1** (the same chain with half of its
# rows redrawn: half the structure is shared, half conflicts), and measures:
#
# 1. LoRA (Hu et al. 2021, `distlab.finetune.lora`): the adapter, its parameter count against the
#    formula r·(d_in + d_out), and the gradient and optimizer memory it saves;
# 2. transfer: fine-tuning from task 0 against training task 1 from scratch;
# 3. full fine-tuning vs LoRA at several ranks, target sets and learning rates: the
#    interview's "LoRA quality drop" and its fixes, as measured sweeps;
# 4. catastrophic forgetting (task-0 loss while training on task 1) and two mitigations,
#    a replay buffer and Elastic Weight Consolidation (`distlab.finetune.forgetting`);
# 5. LoRA under data parallelism: only the adapters' gradients travel;
# 6. merging the adapter for inference: the same outputs, no extra latency;
# 7. a widget that fine-tunes with another rank / targets / learning rate;
# 8. the closing table: the interview answers beside what this run measured.
#
# Quality is the **held-out loss** (nats per token) on each task: every fine-tuning run
# logs an `eval` event on held-out rows of task 0 and task 1 every few steps. The loss
# floor of each task (its chain's conditional entropy) is the best any model can do.

# %% tags=["parameters"]
import os

# CI sets WORKBOOK_QUICK=1: short runs and small sweeps, under a minute.
QUICK = os.environ.get("WORKBOOK_QUICK", "0") == "1"
PRE_STEPS = 200 if QUICK else 600       # pre-training on task 0
FT_STEPS = 100 if QUICK else 300        # fine-tuning on task 1
RANKS = (4, 16) if QUICK else (1, 4, 16)
TARGETS = ("qv", "attn_mlp") if QUICK else ("qv", "attn", "attn_mlp")
LRS = (1e-3, 1e-2)                      # AdamW learning rates of the LoRA sweep
REPLAY = (0.25,) if QUICK else (0.1, 0.25, 0.5)
EWC = (1e5,) if QUICK else (1e4, 1e5, 1e6)
DDP_STEPS = 10                           # LoRA under ddp vs single (SGD)
# A 2-layer, 64-wide GPT on 16-token rows: a few ms a step, so sweeps of dozens of
# fine-tuning runs fit in one launch.
GPT = dict(n_layer=2, n_embd=64, n_head=4, seq_len=16, global_batch=16)

# %%
import torch

from distlab import RunConfig
from distlab.comm import ring_allreduce_bytes
from distlab.finetune.forgetting import task_data
from distlab.lab.common import claim, claims_table, fmt_bytes, say, table
from distlab.lab.lora_finetuning import (
    LoRAExplorer,
    best_first,
    curves_figure,
    final_eval,
    frozen_keys,
    last_memory,
    last_step_bytes_sent,
    last_step_wire,
    memory_figure,
    merge_check,
    merge_latency_claim,
    model_of,
    preset_shapes,
    start_eval,
    steps_to_reach,
    sweep_configs,
    sweep_figure,
    sweep_rows,
    tradeoff_figure,
    tradeoff_points,
    trainable_of,
    weights_path,
)
from distlab.lab.runs import launch_together, worst_param_diff
from distlab.config import LORA_TARGETS as PRESETS
from distlab.finetune.lora import (
    inject_lora,
    lora_layer_count,
    lora_parameter_count,
    target_shapes,
    trainable_parameters,
)
from distlab.models import GPT as TinyGPT
from distlab.models import GPTConfig
from distlab.models.gpt import gpt_param_count
from distlab.theory.estimate import fp32_adamw_state_bytes

BASE = RunConfig(lr=3e-3, timeout_s=120, threads_per_rank=1, **GPT)
PRE_PATH = weights_path("lora-pretrained")     # the pre-training run writes it
PRE = BASE.replace(steps=PRE_STEPS, save_final=PRE_PATH, eval_every=PRE_STEPS // 10)
# Fine-tuning on task 1 from the task-0 weights; held-out loss on both tasks 10 times.
FT = BASE.replace(task=1, init_from=PRE_PATH, steps=FT_STEPS, eval_every=FT_STEPS // 10)
# The LoRA baseline of the interview challenge: q and v only, rank 4, a low learning
# rate (the challenge: "rank 8 on Q/V at 1e-4"; the tiny model's scale is smaller).
LORA = FT.replace(lora_rank=4, lora_targets="qv", lr=1e-3)
floors = {f"task{t}": task_data(BASE, t).loss_floor for t in (0, 1)}
print({k: round(v, 3) for k, v in floors.items()})

# %% [markdown]
# **Two launches.** Bringing up ranks costs seconds, so `launch_together` trains every
# config needing one process in one launch, one after another: the pre-training run comes
# first and writes its weights (`save_final`); every fine-tuning run after it starts from
# that file (`init_from`). A second launch of two ranks trains LoRA and full fine-tuning
# under `ddp`.

# %%
cfgs = {"pre-training (task 0)": PRE,
        "full fine-tuning": FT,
        "from scratch (task 1)": BASE.replace(task=1, steps=FT_STEPS,
                                              eval_every=FT_STEPS // 10)}
cfgs |= {f"replay {f:g}": FT.replace(replay=f) for f in REPLAY}
cfgs |= {f"EWC λ={lam:g}": FT.replace(ewc_lambda=lam) for lam in EWC}
lora_cfgs = sweep_configs(FT, TARGETS, RANKS, LRS)
lora_cfgs |= sweep_configs(LORA, ["qv"], [4], [1e-3], steps=[2 * FT_STEPS])  # longer
cfgs |= lora_cfgs
# SGD references for LoRA and full fine-tuning under ddp (section 5)
SGD = dict(optimizer="sgd", lr=0.3, steps=DDP_STEPS, eval_every=0)
cfgs["sgd full"] = FT.replace(**SGD)
cfgs["sgd lora"] = LORA.replace(**SGD, lora_targets="attn_mlp")
runs = launch_together(cfgs, name="lora")
ddp = launch_together({k: cfgs[k].replace(strategy="ddp", world_size=2)
                       for k in ("sgd full", "sgd lora")}, name="lora-ddp")
print(f"{len(cfgs)} configs in one launch of 1 process, 2 in one launch of 2")

# %% [markdown]
# ## 1. LoRA: a frozen weight plus a low-rank update
#
# A pre-trained Linear computes h = W x + b with W of shape d_out × d_in. LoRA freezes W
# and learns ΔW = (α/r)·B·A with A (r × d_in) and B (d_out × r):
#
#     h = W x + b + (α/r) · B (A x)        A ~ Kaiming-uniform,  B = 0
#
# B = 0 makes the fine-tuned model start *exactly* at the pre-trained one. One adapted
# layer trains **r·(d_in + d_out)** values instead of **d_in·d_out**. Which Linears get
# an adapter is chosen by module name; this GPT keeps q, k and v as separate Linears, so
# "q and v only" is simply `attn.q` and `attn.v`. Everything else (embeddings,
# LayerNorms, head, every W and b) is frozen. The table counts the trainable values on
# the module (`trainable_parameters`) beside the formula.

# %%
c = GPTConfig.from_run(BASE)
n_full = gpt_param_count(c)
rows = []
for t in PRESETS:
    for r in (1, 4, 16):
        torch.manual_seed(0)
        model = TinyGPT(c)
        shapes = target_shapes(model, t)
        assert shapes == preset_shapes(c, t)      # the formula's shapes are the model's
        inject_lora(model, t, r, alpha=8.0)
        measured = trainable_parameters(model)
        formula = lora_parameter_count(shapes, r)
        assert measured == formula
        rows.append([t, r, len(shapes), f"{formula:,}", f"{measured:,}",
                     f"{measured / n_full:.2%}"])
table(["targets", "rank", "adapted Linears", "Σ r·(d_in+d_out)", "measured trainable",
       f"of all {n_full:,}"], rows)
# The interview's example: rank 8 on one 4096 x 4096 weight.
ex_lora, ex_full = lora_layer_count(4096, 4096, 8), 4096 * 4096
print(f"4096x4096, r=8: {ex_lora:,} vs {ex_full:,} values ({ex_full / ex_lora:.0f}x fewer)")
assert (ex_lora, ex_full) == (65_536, 16_777_216)

# %% [markdown]
# The share of trainable values depends on the width: one adapted layer trains
# r·(d_in + d_out) / (d_in·d_out) = 2r/d of a square weight. At d = 64 that is a lot; at
# d = 4096 it is tiny. The same presets by formula on a 32-layer, 4096-wide GPT (the
# shape of a 7B model; `gpt_param_count` counts its values):

# %%
big = GPTConfig(vocab_size=32_000, block_size=4096, n_layer=32, n_embd=4096, n_head=32)
n_big = gpt_param_count(big)
share = {}
for t in PRESETS:
    for r in (8, 16, 64):
        share[(t, r)] = lora_parameter_count(preset_shapes(big, t), r) / n_big
table(["targets", "rank", "trainable values", f"of {n_big / 1e9:.2f} B"],
      [[t, r, f"{share[(t, r)] * n_big:,.0f}", f"{share[(t, r)]:.3%}"]
       for (t, r) in share])


# %% [markdown]
# ### Memory: gradients and optimizer state follow the trainable values
#
# Measured on rank 0 after a step (`strategy.state_bytes`): the parameters are all held
# (frozen ones too), but gradients exist only for trainable values (4 bytes each) and
# AdamW keeps two moments (8 bytes a value) plus a 4-byte step counter per tensor. The
# cell checks each measured figure against that formula.

# %%
mem_runs = {"full fine-tuning": runs["full fine-tuning"]}
mem_runs |= {f"LoRA {t} r={r}": runs[f"{t} r={r} lr=0.01"]
             for t, r in (("qv", RANKS[0]), ("attn_mlp", RANKS[-1]))}
groups = {}
for label, run in mem_runs.items():
    measured = {k: last_memory(run)[k] for k in ("params", "grads", "optim")}
    assert measured == fp32_adamw_state_bytes(model_of(run.cfg)), label
    groups[label] = measured
memory_figure(groups, "bytes held on rank 0: parameters, gradients, AdamW state").show()
full_go = groups["full fine-tuning"]["grads"] + groups["full fine-tuning"]["optim"]
for label, g in groups.items():
    print(f"{label:28s} gradients + optimizer state {fmt_bytes(g['grads'] + g['optim'])}"
          f" = {(g['grads'] + g['optim']) / full_go:.1%} of full fine-tuning's")

# %% [markdown]
# ## 2. Transfer: starting from task 0 vs from scratch
#
# Pre-training on task 0 first: its held-out loss falls towards the floor. Then task 1,
# either from those weights (full fine-tuning) or from a fresh model: the pre-trained
# model already knows the half of the chain the tasks share. (At step 0 it is *worse*
# than a uniform guess on task 1: it confidently predicts task 0's successors on the
# redrawn rows.)

# %%
pre, full, scratch = (runs[k] for k in ("pre-training (task 0)", "full fine-tuning",
                                         "from scratch (task 1)"))
curves_figure({"pre-training": pre}, "task0", "pre-training: task-0 held-out loss",
              floors["task0"], xaxis="pre-training step").show()
curves_figure({"fine-tuned from task 0": full, "from scratch": scratch}, "task1",
              "task 1: fine-tuning vs training from scratch", floors["task1"]).show()
ft_end, sc_end = final_eval(full)["task1"], final_eval(scratch)["task1"]
reach = steps_to_reach(full, "task1", sc_end)
say(f"task-1 loss after {FT_STEPS} steps: fine-tuned {ft_end:.3f}, scratch {sc_end:.3f};"
    f" fine-tuning reached scratch's final loss at step {reach}")
assert ft_end < sc_end and reach is not None and reach < FT_STEPS

# %% [markdown]
# ## 3. Full fine-tuning vs LoRA: the quality drop and its fixes
#
# The interview challenge: *"LoRA fine-tuning gives 20% lower accuracy than full
# fine-tuning. Root cause: rank too low or wrong layers. Fixes: increase rank (16 or 32
# instead of 8), apply LoRA to more layers (all attention, not just Q/V), train longer,
# try a higher learning rate (1e-3 instead of 1e-4)."* Every point below is a LoRA
# fine-tuning run of this launch: task-1 held-out loss reached against trainable values.
# "Recovered" is the share of full fine-tuning's task-1 improvement a run reached,
# (start − loss) / (start − full).

# %%
start1 = start_eval(full)["task1"]
full1 = final_eval(full)["task1"]
rows = sweep_rows({k: runs[k] for k in lora_cfgs}, start1, full1)
n_trainable_full = trainable_of(FT)
sweep_figure(rows, full1, start1, n_trainable_full, floors["task1"],
             "task-1 loss reached vs trainable values").show()
ranked = best_first(rows)
table(["run", "trainable", "task-1 loss", "recovered", "task-0 loss"],
      [[r["run"], f"{r['trainable']:,}", f"{r['task1']:.3f}", f"{r['recovered']:.0%}",
        f"{r['task0']:.3f}"] for r in ranked])
by = {r["run"]: r for r in rows}
best = ranked[0]
print(f"full fine-tuning: {n_trainable_full:,} trainable, task-1 loss {full1:.3f}")
print(f"best LoRA: {best['run']}, {best['recovered']:.0%} of the gain with "
      f"{best['trainable'] / n_trainable_full:.1%} of the trainable values")

# %% [markdown]
# Each fix alone, from the baseline (q and v, rank 4, lr 1e-3), then all together:

# %%
base_row = by["qv r=4 lr=0.001"]
fixes = {"baseline: qv, r=4, lr 1e-3": base_row,
         f"rank 4 → {RANKS[-1]}": by[f"qv r={RANKS[-1]} lr=0.001"],
         "q,v → attention + MLP": by["attn_mlp r=4 lr=0.001"],
         "lr 1e-3 → 1e-2": by["qv r=4 lr=0.01"],
         f"{FT_STEPS} → {2 * FT_STEPS} steps": by[f"qv r=4 lr=0.001 {2 * FT_STEPS} steps"],
         "all: attention + MLP, higher rank, lr 1e-2": by[f"attn_mlp r={RANKS[-1]} lr=0.01"]}
table(["change", "task-1 loss", "recovered", "gap to full fine-tuning"],
      [[k, f"{r['task1']:.3f}", f"{r['recovered']:.0%}", f"{r['task1'] - full1:+.3f}"]
       for k, r in fixes.items()])
# more layers, a higher learning rate and all together each beat the baseline
for k in ("q,v → attention + MLP", "lr 1e-3 → 1e-2", "all: attention + MLP, higher rank, lr 1e-2"):
    assert fixes[k]["task1"] < base_row["task1"] - 0.1, k
assert best["recovered"] > 0.8 and base_row["recovered"] < best["recovered"]

# %% [markdown]
# Read it as a chain of bottlenecks. With q and v only, the adapters can change *what is
# attended to* and *what is read out of it*, but task 1 changes a lookup table (which
# tokens follow which), which lives mostly in the MLP: adapting the MLP is the largest
# single fix. At a low learning rate the adapters barely move in this many steps, so a
# higher rank adds directions nobody walks along; with a higher learning rate, rank
# starts to matter. Full fine-tuning stays ahead: here the change between the tasks is
# not low-rank (half of a 64-token table is redrawn), which is LoRA's assumption.

# %% [markdown]
# ## 4. Catastrophic forgetting, replay and EWC
#
# While fine-tuning on task 1 every run also evaluates on task 0. Full fine-tuning forgets:
# the redrawn rows are overwritten, and task-0 loss climbs. Two mitigations
# (`distlab.finetune.forgetting`):
#
# * **Replay**: a fraction of every batch's rows comes from a buffer of task-0 rows (the
#   first rows pre-training saw), so the gradient keeps pulling towards task 0 too.
# * **EWC** (Kirkpatrick et al. 2017): a penalty (λ/2)·Σ F_i (θ_i − θ*_i)² ties each
#   weight to its task-0 value θ*, weighted by the diagonal Fisher information F_i
#   estimated on task-0 rows at the start: weights task 0 depends on become stiff.
#
# LoRA is a third, implicit one: it can only move the model within a small subspace.

# %%
best_lora = runs[best["run"]]
shown = {"full fine-tuning": full, f"LoRA ({best['run']})": best_lora,
         f"replay {REPLAY[-1]:g}": runs[f"replay {REPLAY[-1]:g}"],
         f"EWC λ={EWC[len(EWC) // 2]:g}": runs[f"EWC λ={EWC[len(EWC) // 2]:g}"]}
curves_figure(shown, "task0", "forgetting: task-0 held-out loss while fine-tuning on task 1",
              floors["task0"]).show()
curves_figure(shown, "task1", "learning: task-1 held-out loss", floors["task1"]).show()
t0_start = start_eval(full)["task0"]
points = tradeoff_points(runs, ["full fine-tuning"] + [f"replay {f:g}" for f in REPLAY]
                         + [f"EWC λ={lam:g}" for lam in EWC], rows, FT_STEPS, lr=0.01)
tradeoff_figure(points, f"after {FT_STEPS} steps on task 1 (task-0 loss before: "
                        f"{t0_start:.2f})").show()
rise = {k: p["task0"] - t0_start for k, p in points.items()}
table(["run", "task-0 loss rise (forgetting)", "task-1 loss (learning)"],
      [[k, f"{rise[k]:+.3f}", f"{points[k]['task1']:.3f}"] for k in points])
r_full = rise["full fine-tuning"]
r_replay = rise[f"replay {REPLAY[-1]:g}"]
r_ewc = rise[f"EWC λ={EWC[len(EWC) // 2]:g}"]
assert r_full > 1.0 and r_replay < 0.5 * r_full and r_ewc < r_full

# %% [markdown]
# ## 5. LoRA under data parallelism: only adapter gradients travel
#
# Frozen weights have no gradient, so `ddp` buckets and all-reduces only the adapters':
# 2(N−1)/N · 4 bytes · trainable values per step (ring all-reduce), against the whole
# model's for full fine-tuning. ZeRO likewise shards only the trainable values
# (`tests/test_lora.py` checks zero1/2/3 and torch's DDP too). Both ddp runs are checked
# against one process with the same global batch (SGD, fp32): only the summation order of
# the gradient differs (tolerance 1e-5 as in tests/test_lora.py); frozen weights must be
# bitwise untouched.

# %%
N = 2
booked, on_wire = {}, {}
for k in ("sgd full", "sgd lora"):
    n = trainable_of(cfgs[k])
    formula = ring_allreduce_bytes(4 * n, N)
    booked[k], on_wire[k] = last_step_bytes_sent(ddp[k]), last_step_wire(ddp[k])
    assert booked[k] == formula, (k, booked[k], formula)
    diff = worst_param_diff(ddp[k].states[0], runs[k].states[0])
    assert diff < 1e-5, (k, diff)
    say(f"{k}: {n:,} trainable, {fmt_bytes(booked[k])} per step per rank booked "
        f"(formula {fmt_bytes(formula)}), "
        + ("on the wire not measured here" if on_wire[k] is None else
           f"{fmt_bytes(on_wire[k])} on the wire")
        + f"; worst parameter diff vs single {diff:.1e}")
lora_state, ref = ddp["sgd lora"].states[0], runs["sgd lora"].states[0]
assert all(torch.equal(lora_state[k], ref[k]) for k in frozen_keys(ref))
ratio = booked["sgd lora"] / booked["sgd full"]
wire_seen = None not in on_wire.values()
wire_ratio = on_wire["sgd lora"] / on_wire["sgd full"] if wire_seen else None
print(f"LoRA books {ratio:.1%} of full fine-tuning's bytes"
      + (f", and writes {wire_ratio:.1%} of them on the wire" if wire_seen else ""))
if wire_seen:  # the all-reduce follows the ring on gloo: the wire is the formula + headers
    assert all(0 <= on_wire[k] / booked[k] - 1 < 0.10 for k in booked), (on_wire, booked)

# %% [markdown]
# ## 6. Merging for inference
#
# W' = W + (α/r)·B·A is an ordinary weight. Folded in, the adapted model *is* a plain
# model: no extra matmuls, no extra latency (Hu et al. 2021, Section 4.1). Below: the best
# LoRA run's final weights, forward of 16 rows unmerged, merged, and as a plain GPT loaded
# with the merged state dict (median of repeated forwards, one thread; merged and plain take
# turns, so load on this shared machine falls on both alike). Outputs agree to
# float32 rounding (1e-5: (W + sBA)x and Wx + s·B(Ax) associate the same sums
# differently; tests/test_lora.py).

# %%
x, _ = task_data(BASE, 1).eval_batch(0, 16)
m = merge_check(best_lora.cfg, best_lora.states[0], x, repeats=20 if QUICK else 200)
table(["forward of 16 rows", "median time", "max |output − unmerged|"],
      [["unmerged (adapter path)", f"{m['unmerged_s'] * 1e3:.2f} ms", "0"],
       ["merged", f"{m['merged_s'] * 1e3:.2f} ms", f"{m['max_diff_merged']:.1e}"],
       ["plain GPT, merged weights", f"{m['plain_s'] * 1e3:.2f} ms", f"{m['max_diff_plain']:.1e}"]])
assert m["max_diff_merged"] < 1e-5 and m["max_diff_plain"] < 1e-5

# %% [markdown]
# ## 7. Explore: rank, targets, learning rate
#
# **Run** fine-tunes the pre-trained model with the chosen LoRA settings (one launch) and
# draws its task-1 (solid) and task-0 (dotted) held-out loss beside full fine-tuning's.
# A click does not block the kernel: the status line shows the run's progress and **Stop**
# ends it. The cell below runs it once, as a click would (and waits for it).

# %%
explorer = LoRAExplorer(LORA, {"full fine-tuning": full})
explorer

# %%
got = explorer.run(rank=8, targets="attn", lr=1e-2)
print(explorer.status_text)
assert got["trainable"] == lora_parameter_count(preset_shapes(c, "attn"), 8)
assert got["task1"] < start1

# %% [markdown]
# ## What the interview answers say, what this run measured
#
# Sources: common interview answers (quoted in the claim column) and the papers cited
# above. Every figure is built from this run's variables (or, marked "modelled", from the
# formula r·(d_in + d_out), which section 1 checked against the modules' own counts), and
# every verdict is computed from them: a row reads **no** when the run disagrees. The rows
# that rest on counts and bytes are asserted; the ones that rest on how well this tiny
# model learns, or on timing, are shown. The "timed" row (merged vs plain latency) reads a
# clock, so it depends on this machine and its load (another process on the cores slows
# whichever forward it lands on): it is read over the interleaved pairs' ratios, shows min /
# median / max, and reads "undecided on this machine" when their middle half straddles its
# bound (`distlab.lab.timed`).

# %%
qv4 = share[("qv", 8)]  # by formula, 32 layers x 4096 wide
am = share[("attn_mlp", 8)]
tiny = by["qv r=4 lr=0.001"]["trainable"] / n_full
lora_mem = list(groups)[1]
mem_ratio = (groups[lora_mem]["grads"] + groups[lora_mem]["optim"]) / full_go
hi_rank_lo_lr = fixes[f"rank 4 → {RANKS[-1]}"]["task1"]
lo_rank_hi_lr, hi_rank_hi_lr = (by[f"qv r={r} lr=0.01"]["task1"] for r in (4, RANKS[-1]))
longer = fixes[f"{FT_STEPS} → {2 * FT_STEPS} steps"]["task1"]
rank_helps = (hi_rank_lo_lr < base_row["task1"] - 0.1, hi_rank_hi_lr < lo_rank_hi_lr - 0.1)
lora_rises = [rise[k] for k in points if k.startswith("LoRA")]
claim_rows = [
    claim("LoRA trains rank·(in+out) instead of in·out: r=8 on 4096×4096 is 65K vs 16M (250×)",
          "interview answer; Hu et al. 2021", f"r·(in+out) = {ex_lora:,} vs {ex_full:,} = "
          f"{ex_full / ex_lora:.0f}× (the formula equals the modules' count in section 1)",
          abs(ex_full / ex_lora - 250) <= 0.05 * 250, basis="modelled"),
    claim("LoRA trains 0.1–1% of the parameters (a 7B-class model)", "interview answer",
          f"4096-wide 32-layer GPT, r=8: qv {qv4:.3%}, attn+MLP {am:.3%} (both must be "
          "within 0.1–1%)",
          0.001 <= qv4 <= 0.01 and 0.001 <= am <= 0.01, basis="modelled"),
    claim("LoRA trains 0.1–1% of the parameters (this 64-wide GPT)", "interview answer",
          f"qv r=4: {tiny:.1%} of the parameters trainable, counted on the model (2r/d per "
          "layer is large at small d)", 0.001 <= tiny <= 0.01),
    claim("gradient and optimizer memory shrink with the trainable values", "Hu et al. 2021",
          f"{lora_mem}: gradients + AdamW state {mem_ratio:.1%} of full fine-tuning's, "
          "measured on the ranks", mem_ratio < 0.05),
    # the verdict reads the setting fixed before the sweep (Hu et al.'s q,v); the best of the
    # sweep was picked on the very task it is scored on, so it is its own, optimistic row
    claim("LoRA reaches 90–95% of full fine-tuning's quality (an interview answer)",
          "the question sets' answer; Hu et al. 2021's q,v recipe",
          f"the q,v setting fixed before the sweep ({base_row['run']}) recovered "
          f"{base_row['recovered']:.0%} of full fine-tuning's task-1 gain",
          base_row["recovered"] >= 0.9),
    claim(f"tuned, LoRA recovers at least 90% (the best of {len(ranked)} settings, picked "
          "on the task it is scored on: optimistic)", "this notebook's sweep",
          f"best: {best['run']}, {best['recovered']:.0%}",
          best["recovered"] >= 0.9),
    claim("quality drop fixes: more layers, higher learning rate", "interview answer",
          f"attn+MLP {fixes['q,v → attention + MLP']['task1']:.3f}, lr 1e-2 "
          f"{fixes['lr 1e-3 → 1e-2']['task1']:.3f} vs baseline {base_row['task1']:.3f}",
          max(fixes[k]["task1"] for k in ("q,v → attention + MLP", "lr 1e-3 → 1e-2"))
          < base_row["task1"]),
    claim("quality drop fixes: higher rank, longer training", "interview answer",
          f"rank 4 → {RANKS[-1]}: {base_row['task1']:.3f} → {hi_rank_lo_lr:.3f} at lr 1e-3, "
          f"{lo_rank_hi_lr:.3f} → {hi_rank_hi_lr:.3f} at lr 1e-2 (gains of 0.1 or more: "
          f"{rank_helps[0]} at lr 1e-3, {rank_helps[1]} at 1e-2); 2× steps: {longer:.3f}",
          any(rank_helps) and longer < base_row["task1"] - 0.1),
    claim("transfer learning needs much less data and compute (here: half the steps or "
          "fewer)", "interview answer",
          f"fine-tuned reached scratch's {FT_STEPS}-step task-1 loss ({sc_end:.3f}) at step "
          f"{reach} ({reach / FT_STEPS:.0%} of the steps); task 1 shares half of task 0's rows",
          reach <= FT_STEPS / 2),
    claim("training on task B makes the model forget task A", "interview answer",
          f"task-0 loss {t0_start:.3f} → {t0_start + r_full:.3f} after full fine-tuning",
          r_full > 1.0),
    claim("fix: replay buffer, EWC", "interview answer; Kirkpatrick et al. 2017",
          f"task-0 rise {r_full:+.2f} (full) → {r_replay:+.2f} (replay {REPLAY[-1]:g}), "
          f"{r_ewc:+.2f} (EWC λ={EWC[len(EWC) // 2]:g}), at a task-1 cost",
          r_replay < r_full and r_ewc < r_full),
    claim("LoRA learns less and forgets less", "Biderman et al. 2024",
          f"LoRA (lr 1e-2) task-0 rise {min(lora_rises):+.2f} to {max(lora_rises):+.2f} vs "
          f"{r_full:+.2f} full; task-1 loss {min(r['task1'] for r in rows):.3f} at best vs "
          f"{full1:.3f}", max(lora_rises) < r_full and best["task1"] > full1),
    claim("DDP with LoRA all-reduces only adapter gradients", "Hu et al. 2021 (memory, comm)",
          f"booked {fmt_bytes(booked['sgd lora'])} vs {fmt_bytes(booked['sgd full'])} per step "
          f"({ratio:.1%}), = 2(N−1)/N·4·trainable (asserted above)"
          + (f"; on the wire {fmt_bytes(on_wire['sgd lora'])} vs "
             f"{fmt_bytes(on_wire['sgd full'])} ({wire_ratio:.1%})" if wire_seen else ""),
          (wire_ratio if wire_seen else ratio) < 0.1),
    merge_latency_claim(m),
]
claims_table(claim_rows)
asserted = [claim_rows[i] for i in (0, 3, 12)]  # count, memory, bytes: not learning, timing
assert all(r["holds"] for r in asserted), [r["claim"] for r in asserted if not r["holds"]]
