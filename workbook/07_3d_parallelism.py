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
# # 07 · N-D parallelism: every dimension on one mesh, and the planner
#
# `3d` (distlab.parallel.mesh) puts every rank on a **mesh** of dp × tp × pp: tensor
# parallelism inside each group of tp ranks (Megatron's column/row splits), a pipeline
# across pp groups, and ZeRO-1 data parallelism across the dp replicas of each
# (stage, tp shard). Megatron-LM's rank order: tp fastest, then dp, then pp, so a tp group
# is consecutive ranks (one node's GPUs on a real cluster). This notebook:
#
# 1. trains `3d` on 2 × 2 × 2 = 8 ranks and shows which ranks talk to which over which
#    group, with the bytes each group moved per step beside the formula;
# 2. checks it against one process (`single`) on the same global batch;
# 3. measures the pipeline bubble inside the mesh, and ZeRO-1's optimizer state per rank;
# 4. asks the α-β link model where each group should sit (NVLink or InfiniBand);
# 5. asks the planner (`distlab.theory.plan`) the interview questions about layouts, GPU counts
#    and training time;
# 6. a widget that re-runs the real `3d` on another layout;
# 7. **every dimension at once**: the mesh of pp × dp_replicate × dp_shard × cp × tp (and ep
#    carved from the data-parallel ranks), who talks to whom along each, compositions
#    trained against one process with each dimension's bytes beside its formula, the
#    planner's long-context layout (tp × cp), and the planner's ranking trained;
# 8. the closing table: what the textbook says, what this run measured.
#
# Equivalence runs use SGD in fp32 (tests/test_mesh.py): 3d computes single's sums split
# into tp partial sums, micro-batch means and dp averages; only the summation order differs.

# %% tags=["parameters"]
import os

# CI sets WORKBOOK_QUICK=1: fewer steps, about a minute on 2 cores.
QUICK = os.environ.get("WORKBOOK_QUICK", "0") == "1"
STEPS = 6 if QUICK else 30                 # equivalence run
BUBBLE_STEPS = 3 if QUICK else 6           # delayed bubble runs (the first step is dropped)
CURVE_M = (1, 2, 4) if QUICK else (1, 2, 4, 8)  # micro-batch counts of the bubble curve
# dp, tp, pp: 8 ranks in quick mode too. Measured on 2 cores: this notebook's one 8-rank
# launch takes ~27 s (~15 s of it bringing up 8 ranks), a 4-rank one ~5 s; but a 4-rank
# mesh drops a dimension, so showing all three groups at work would need two launches
# and still no run where all three work at once.
DIMS = (2, 2, 2)
M, SCHEDULE = 2, "1f1b"                    # micro-batches and schedule of the main run
# Sleep per forward and per backward in the bubble runs, tests/test_pipeline.py's 0.2 s: it
# dwarfs the compute and the scheduling noise of 8 ranks on 2 cores (at 0.1 s the stage
# hand-offs' wake-up latency put the measured bubble above the formula's 0.05 tolerance
# while the test suite kept both cores busy).
DELAY_S = 0.2
# The widget's run in this notebook: a 4-rank mesh in quick mode (one more launch).
WIDGET = (dict(world=4, layout=(1, 2, 2), microbatches=2, schedule="1f1b") if QUICK else
          dict(world=8, layout=(4, 1, 2), microbatches=4, schedule="gpipe"))
# The planner's top layouts trained on this machine (section 9): how many, how often each
# (the verdict reads a clock, so it is decided over repeats), steps per training (the first 2
# dropped), and the all-reduce sizes its link is fitted on (16 KiB to 4 MiB; quick: 3 of them)
PLAN_TOP, PLAN_REPEATS, PLAN_STEPS = (2, 2, 3) if QUICK else (5, 3, 8)
PLAN_SIZES = (16 << 10, 256 << 10, 4 << 20) if QUICK else (16 << 10, 64 << 10, 256 << 10,
                                                          1 << 20, 4 << 20)
# A 4-layer, 32-wide GPT with 4 heads on 16-token rows, global batch 16.
GPT = dict(n_layer=4, n_embd=32, n_head=4, seq_len=16, global_batch=16)

# %%
from distlab import RunConfig
from distlab.comm import LINKS
from distlab.units import GB
from distlab.lab.common import claim, claims_table, fmt_bytes, say, table
from distlab.lab.data_parallel import loss_figure
from distlab.lab.parallelism_3d import wire_rows as mesh_wire_rows
from distlab.lab.parallelism_3d import (
    GROUP_HEADER,
    MeshExplorer,
    calls_with_bytes,
    describe_row,
    group_rows,
    group_table_rows,
    kind_bytes,
    layout_rank,
    layout_standing,
    layout_sweep,
    mesh_config,
    peers,
    placement_seconds,
    planner_order_claim,
    traffic_figure,
    zero1_optim_rows,
)
from distlab.theory.comm_bytes import messages_per_step, micro_batch_bytes, rank_numel
from distlab.lab.parallelism_nd import MeshND, dimension_rows, long_context_plan
from distlab.lab.pipeline_parallel import bubble_curve, bubble_curve_claim, bubble_rows
from distlab.studies.plan_check import planned_vs_measured
from distlab.lab.runs import launch_together, worst_param_diff
from distlab.parallel.mesh import KINDS, coords
from distlab.parallel.mesh import table as mesh_table
from distlab.parallel.pipeline.pp import bubble_formula
from distlab.theory.plan import (
    DAY,
    GPT3_175B,
    IB_HDR,
    RECOMPUTE,
    Cluster,
    Model,
    best,
    evaluate,
    max_micro_batch,
    memory_per_gpu,
    plan,
    tp_comm_time,
    training_time,
)
from distlab.theory.plan import table as plan_table

BASE = RunConfig(optimizer="sgd", lr=0.1, steps=STEPS, timeout_s=60, threads_per_rank=1,
                 **GPT)
MESH = mesh_config(BASE, *DIMS, microbatches=M, schedule=SCHEDULE)
# AdamW, so there is optimizer state for ZeRO-1 to shard (SGD without momentum has none)
ADAM = MESH.replace(optimizer="adamw", lr=1e-3, steps=2)
# GPipe runs m = 1 too (1F1B needs m >= pp); extra["pp_op_delay_s"]: a fixed sleep
DELAYED = MESH.replace(schedule="gpipe", steps=BUBBLE_STEPS,
                       pp_op_delay_s=DELAY_S)
# Tolerances. Parameters and losses vs single: 1e-5 (tests/test_mesh.py: only the
# summation order differs, ~1e-7 per step, which SGD does not amplify; a lost
# micro-batch, an unaveraged dp gradient or a doubled bias moves parameters by >1e-3).
# Bubble: 0.05 of the step (tests/test_pipeline.py, benchmarks/pipeline_bubble.py).
TOL, BUBBLE_TOL = 1e-5, 0.05
DP, TP, PP = DIMS

# %% [markdown]
# **Two launches.** `single` alone, then one launch of 8 ranks that trains, one after
# another: the SGD equivalence run, a 2-step AdamW run (optimizer state for ZeRO-1) and
# the delayed GPipe runs of the bubble curve and section 9's three N-D meshes
# (`lab.runs.launch_together`).

# %%
single = launch_together({"single": BASE}, name="single")["single"]
cfgs = {"3d": MESH, "3d adamw": ADAM}
cfgs |= {f"bubble m={m}": DELAYED.replace(microbatches=m) for m in CURVE_M}
# section 9's compositions of the N-D mesh (strategy "mesh", named by their degrees), in the
# same launch: the planner's long-context shape, torchtitan's 3D (ZeRO-3 with TP and PP), HSDP
# (quick mode: the long-context one alone; tests/test_mesh.py trains the others in CI)
ND = {"dp_shard2 × cp2 × tp2": BASE.replace(dp_shard=2, cp=2, tp=2),
      "pp2 × dp_shard2 × tp2": BASE.replace(pp=2, dp_shard=2, tp=2, microbatches=2,
                                            schedule="1f1b"),
      "dp_replicate2 × dp_shard2 × tp2": BASE.replace(dp_replicate=2, dp_shard=2, tp=2)}
ND = dict(list(ND.items())[:1]) if QUICK else ND
cfgs |= ND
runs = launch_together(cfgs, name="mesh-3d")
run = runs["3d"]
steps = run.history("step")
print(f"{len(cfgs)} configs trained in one launch of {MESH.world_size} ranks "
      f"(dp={DP} × tp={TP} × pp={PP})")

# %% [markdown]
# ## 1. The mesh: who talks to whom, over what
#
# rank = pp_idx·(dp·tp) + dp_idx·tp + tp_idx. Each rank logs its coordinates every step;
# the check below compares them with the formula. Every group kind partitions the
# 8 ranks: 4 tp groups, 4 dp groups, 4 pp groups of 2.

# %%
logged = {e["rank"]: e["mesh"]["coords"] for e in steps}
table(["rank", "pp", "dp", "tp", "its tp / dp / pp peers"],
      [[r, c["pp"], c["dp"], c["tp"],
        " / ".join(str(peers(r, *DIMS)[k]) for k in ("tp", "dp", "pp"))]
       for r, c in sorted(logged.items())])
table(["group", "index", "ranks", "what 3d sends over it"],
      [[g["kind"], g["group"], g["ranks"], g["carries"]] for g in mesh_table(*DIMS)])
assert all(c == coords(r, DP, TP, PP) for r, c in logged.items())

# %% [markdown]
# ## 2. Bytes per group, measured and by formula
#
# Each group has its own `Comm`, so every byte is booked to its group kind. "Booked"
# sums what the group's members' calls moved in one step (the same in every step:
# `group_rows` raises otherwise); pp's sends are counted bytes, the collectives' are ring
# bus bytes (distlab.comm): the check is that every group makes exactly the calls, on
# exactly the sizes, the formulas describe. What went on the wire follows the table. The formulas (distlab.lab.parallelism_3d), with S = (B/dp/m)·T·h·4 bytes, one
# micro-batch's hidden states on one replica, and L_s = n_layer/pp blocks per stage:
#
# - **tp**: 4·L_s·m all-reduces of S per rank, 2(t−1)/t·S each (Megatron's f and g, twice
#   per block, forward and backward);
# - **pp**: m·S of activations forward and m·S of gradients back per stage boundary (each
#   tp rank sends the whole S: Megatron's scatter/gather over tp is not written here);
# - **dp**: ZeRO-1's reduce-scatter of gradients and all-gather of parameters, each
#   (dp−1)/dp·4·P, P = the rank's parameters Ψ_r padded to a multiple of dp.

# %%
rows = group_rows(MESH, steps)
table(GROUP_HEADER, group_table_rows(rows))
S = micro_batch_bytes(MESH)
psi = {r: rank_numel(MESH, r) for r in range(MESH.world_size)}
print(f"S = {S:,} B, L_s = {MESH.n_layer // PP}, m = {M}; Ψ_r = {psi[0]:,} (first stage), "
      f"{psi[MESH.world_size - 1]:,} (last stage) parameters")
assert all(r["measured"] == r["predicted"] > 0 for r in rows)
per_rank = {r: kind_bytes(steps, r) for r in range(MESH.world_size)}
calls = calls_with_bytes(steps, 0)
table(["rank 0, per step", "bytes sent", "messages that carry bytes"],
      [[k, fmt_bytes(per_rank[0][k]), calls[k]] for k in KINDS])
tp_bytes, dp_bytes, pp_bytes = (per_rank[0][k] for k in ("tp", "dp", "pp"))

# %% [markdown]
# **On the wire.** The kernel's count of the bytes each rank wrote in its last step
# (`distlab.wire`, see `01_collectives`), beside what its groups booked. The ledger can pin
# bytes on one group's calls only when a call runs alone: here dp's blocking
# reduce-scatter and pp's barrier; tp's asynchronous all-reduces overlap the pipeline's
# sends and dp's all-gather, so those are measured together.

# %%
wrows = mesh_wire_rows(steps)
wire_seen = all(w["wire"] is not None for w in wrows)
table(["rank", "booked, all groups", "on the wire", "wire / booked", "measured alone"],
      [[w["rank"], f"{w['booked']:,}", f"{w['wire']:,}" if wire_seen else "not measured here",
        f"{w['wire'] / w['booked']:.3f}" if wire_seen else "—",
        ", ".join(f"{k} {v:,}" for k, v in w["alone"].items())] for w in wrows])
if not wire_seen:
    print(f"on the wire: not measured here ({wrows[0]['why']})")
wire_over_booked = [w["wire"] / w["booked"] for w in wrows] if wire_seen else []

# %% [markdown]
# The same bytes as a picture: one cell per (sender, receiver), labelled with the group
# that carried them. Ranks differing only in tp (r, r±1) exchange the most in this run;
# ranks four apart are pipeline neighbours; rank pairs in no common group never talk.

# %%
traffic_figure(MESH, steps).show()

# %% [markdown]
# ## 3. 3d computes what one process computes
#
# After STEPS SGD steps, every rank gathers the whole model (tp shards over the tp group,
# stages over the pp group) under `single`'s names; the loss is logged by the last stage
# of each dp replica and averaged.

# %%
param_diff = max(worst_param_diff(s, single.states[0]) for s in run.states)
loss_diff = max(abs(a - b) for a, b in zip(run.losses(), single.losses()))
print(f"after {STEPS} steps: worst parameter diff {param_diff:.1e}, worst loss diff "
      f"{loss_diff:.1e} (tolerance {TOL:g})")
loss_figure({"single": single.losses(), f"3d {DP}×{TP}×{PP}": run.losses()},
            "loss: 3d on 8 ranks vs one process", height=320).show()
assert len(run.losses()) == len(single.losses()) == STEPS
assert param_diff <= TOL and loss_diff <= TOL

# %% [markdown]
# ## 4. The pipeline bubble inside the mesh
#
# Each rank's pipeline records its forwards and backwards (distlab.lab.pipeline_parallel reads them);
# bubble = 1 − busy / step time, median over the steps after the first and over ranks.
# GPipe with p = pp = 2, against (p−1)/(m+p−1) (Huang et al. 2019). Every op sleeps
# DELAY_S so the stages cost the same, as the formula assumes. A bubble is read from a clock,
# so nothing here asserts it: the claims table reads it over every rank's steps (timed).
#
# > *"GPUs idle 50% of the time with pipeline parallelism. Root cause: not enough
# > micro-batches. More micro-batches: increase from 4 to 16."* (an answer to a production challenge)

# %%
brows = bubble_rows({k: r for k, r in runs.items() if k.startswith("bubble")})
table(["run", "p", "m", "measured (of step time)", "(p−1)/(m+p−1)"],
      [[r["run"], r["p"], r["m"], f"{r['measured']:.3f}", f"{r['total']:.3f}"] for r in brows])
bubble_curve(brows, f"3d {DP}×{TP}×{PP}, GPipe, p={PP}: measured bubble vs micro-batches").show()
# The challenge: 50% idle at m = 4 is p = 5 stages: (5-1)/(4+5-1) = 0.5
idle4, idle16 = bubble_formula("gpipe", 5, 4), bubble_formula("gpipe", 5, 16)
say(f"The challenge: p=5, m=4 idles {idle4:.0%}; m=16 idles {idle16:.0%}. Its trade-off, "
    f"more micro-batches = more activation memory, is GPipe's (all m stashed); 1F1B "
    f"stashes at most p (measured in 06_pipeline_parallel)")

# %% [markdown]
# ## 5. ZeRO-1 over dp shards the optimizer state by dp
#
# In the AdamW run each rank's optimizer steps only its 1/dp shard of its flat parameter
# buffer (Rajbhandari et al. 2020, P_os): exp_avg and exp_avg_sq of P/dp floats, plus
# AdamW's 4-byte step counter. Measured from the optimizer's own tensors
# (e["memory"]["optim"]), beside what an unsharded optimizer would hold.

# %%
zrows = zero1_optim_rows(runs["3d adamw"])
table(["rank", "Ψ_r (formula)", "Ψ_r (ZeRO's buffer)", "optimizer state, measured",
       "2·4·P/dp + 4", "unsharded 2·4·Ψ_r + 4", "measured / unsharded"],
      [[z["rank"], f"{z['numel']:,}", f"{z['zero_numel']:,}", f"{z['measured']:,}",
        f"{z['formula']:,}", f"{z['unsharded']:,}", f"{z['measured'] / z['unsharded']:.4f}"]
       for z in zrows])
assert all(z["measured"] == z["formula"] and z["numel"] == z["zero_numel"] for z in zrows)
optim_ratio = max(z["measured"] / z["unsharded"] for z in zrows)
assert abs(optim_ratio - 1 / DP) < 1e-3  # 1/dp, up to padding and the step counter

# %% [markdown]
# ## 6. TP inside a node, PP across nodes
#
# The α-β model (distlab.comm): a message costs α plus its bytes over the link's
# bandwidth. Rank 0's measured bytes per step and its messages (a ring all-reduce over n
# ranks is 2(n−1) messages, a send one), on NVLink 3 (300 GB/s, inside a DGX A100) or
# InfiniBand HDR (25 GB/s per GPU, between nodes), in two placements.
#
# > *"NVLink: high-speed interconnect between GPUs on the same node. Crucial for Tensor
# > Parallelism."* · *"Tensor parallelism slower than expected due to communication:
# > reduce TP degree, use NVLink or InfiniBand."* (an answer to a production challenge)

# %%
NV = LINKS["NVLink 3 (A100)"]
placements = {"tp on NVLink, pp and dp on InfiniBand": {"tp": NV, "pp": IB_HDR, "dp": IB_HDR},
              "pp on NVLink, tp and dp on InfiniBand": {"tp": IB_HDR, "pp": NV, "dp": IB_HDR}}
secs = {name: placement_seconds(MESH, 0, per_rank[0], pl) for name, pl in placements.items()}
table(["placement"] + [f"{k}: µs per step" for k in KINDS] + ["total µs"],
      [[name] + [f"{s[k] * 1e6:.1f}" for k in KINDS] + [f"{sum(s.values()) * 1e6:.1f}"]
       for name, s in secs.items()])
tp_in_node, pp_in_node = (sum(s.values()) for s in secs.values())
print(f"rank 0 per step: tp {messages_per_step(MESH, 0)['tp']} messages, "
      f"{fmt_bytes(tp_bytes)}; pp {messages_per_step(MESH, 0)['pp']} messages, "
      f"{fmt_bytes(pp_bytes)}")
# the same question at GPT-3's size: the planner's tp time of t = 8 on NVLink vs InfiniBand
g3 = best(GPT3_175B, Cluster(gpus=1024), 1536, 0.5)
tp_nv = tp_comm_time(GPT3_175B, Cluster(gpus=1024), g3.tp, g3.pp, g3.micro_batch,
                     g3.micro_batches, g3.recompute)
tp_ib = tp_comm_time(GPT3_175B, Cluster(gpus=1024, intra=IB_HDR), g3.tp, g3.pp,
                     g3.micro_batch, g3.micro_batches, g3.recompute)
say(f"GPT-3 on 1024 A100s ({describe_row(g3)}): tensor-parallel communication "
    f"{tp_nv:.2f} s per step on NVLink, {tp_ib:.2f} s on InfiniBand "
    f"(compute {g3.compute_s:.2f} s, pipeline sends {g3.pp_comm_s:.2f} s)")
assert tp_in_node < pp_in_node and tp_ib > 5 * tp_nv

# %% [markdown]
# ## 7. The planner answers the interview questions
#
# `distlab.theory.plan` searches dp × tp × pp × ZeRO stage × micro-batch size × recomputation
# for a model on a cluster: memory per GPU by the ZeRO paper and Korthikanti et al.,
# step time = compute at a fixed MFU + pipeline bubble + exposed dp/tp/pp communication
# (α-β). Defaults: A100 80 GB, 8 per node, NVLink 3 inside, InfiniBand HDR between,
# bf16 peak 312 TFLOP/s, MFU 0.5, mixed-precision Adam (16 bytes per parameter), data
# parallel communication not overlapped. Estimates, not measurements: near-ties (a few %)
# are not meaningful; rank with it, then measure the top few.

# %% [markdown]
# ### 7.1 GPT-3's 64 × 8 × 8
#
# > *"What is 3D parallelism? Example (GPT-3): 64-way data parallelism, 8-way pipeline
# > parallelism, 8-way tensor parallelism. Total: 64 × 8 × 8 = 4,096 GPUs."*
#
# What is published: Brown et al. 2020 (§2.3) trained GPT-3 on V100 GPUs, "on part of a
# high-bandwidth cluster provided by Microsoft", with "a mixture of model parallelism within
# each matrix multiply and model parallelism across the layers"; the paper gives no
# dp × tp × pp layout, so 64 × 8 × 8 is the question's, not GPT-3's. Narayanan et al. 2021
# (Table 1) list the tensor-, pipeline- and data-parallel sizes of their own runs of GPT
# models up to 1T parameters on up to 3072 A100s; read a 175B layout from that table
# rather than from here (its row is not reproduced in this repository). Below, the planner
# asks the question on A100s: GPT-3 175B's shape (96 layers, h = 12288, 96 heads,
# s = 2048) at its batch of 1536 sequences (3.2M tokens, Brown et al. 2020 Table 2.1) on
# 4096 A100s.

# %%
g3_rows = plan(GPT3_175B, Cluster(gpus=4096), 1536, 0.5)
print(plan_table(g3_rows, 5))
rank_888, row_888 = layout_rank(g3_rows, 64, 8, 8)
gap = row_888.step_s / g3_rows[0].step_s - 1
say(f"64 × 8 × 8 fits ({row_888.memory / GB:.1f} GB per GPU) and ranks #{rank_888} of "
    f"the layouts, {gap:.1%} slower than the fastest ({describe_row(g3_rows[0])}): a "
    f"near-tie. Every top layout uses tp = 8, one whole node, as Narayanan et al. 2021 do "
    f"for GPT models of 145.6B parameters and up (t = 8, p >= 8).")
assert row_888.fits and gap < 0.05 and all(r.tp == 8 for r in g3_rows[:5])

# %% [markdown]
# ### 7.2 512 GPUs: start with DP = 64, PP = 8, TP = 1; add TP when?
#
# > *"Don't know how to configure 3D parallelism for 512 GPUs. Start simple: DP=64, PP=8,
# > TP=1. Add TP if needed: DP=64, PP=4, TP=2. Rule of thumb: maximize DP, minimize TP
# > (TP has most communication)."* (an answer to a production challenge)
#
# The question names no model. Four GPT shapes (s = 2048) and three global batches: the
# planner's fastest layout, and where the two suggested layouts rank among all layouts.

# %%
MODELS = {"1.3B": Model(24, 2048, 16), "13B": Model(40, 5120, 40),
          "70B": Model(80, 8192, 64), "175B": GPT3_175B}
BATCHES = (512, 2048, 8192)
sweep = layout_sweep({(n, b): (MODELS[n], b) for n in MODELS for b in BATCHES},
                     Cluster(gpus=512), named=((64, 1, 8), (64, 2, 4)))
table(["model", "parameters", "global batch", "fastest layout", "step s", "MFU",
       "64×1×8 (TP=1)", "64×2×4 (TP=2)"],
      [[s["case"][0], f"{s['model'].params / 1e9:.1f}B", s["batch"], describe_row(s["best"]),
        f"{s['best'].step_s:.2f}",
        f"{s['best'].mfu:.2f}", layout_standing(s, (64, 1, 8)), layout_standing(s, (64, 2, 4))]
       for s in sweep])
best_tp = {s["case"]: s["best"].tp for s in sweep}
print("best tp as the batch grows 512 → 8192: " + "; ".join(
    f"{n}: " + " → ".join(str(best_tp[(n, b)]) for b in BATCHES) for n in MODELS))
print("best tp as the model grows 1.3B → 175B: " + "; ".join(
    f"batch {b}: " + " → ".join(str(best_tp[(n, b)]) for n in MODELS) for b in BATCHES))
# TP grows as the batch per replica shrinks and as the model grows
for n in MODELS:
    assert best_tp[(n, 512)] >= best_tp[(n, 8192)]
for b in BATCHES:
    assert best_tp[("175B", b)] >= best_tp[("1.3B", b)]
assert all(s["named"][(64, 1, 8)][0] is None for s in sweep if s["case"][0] == "175B")

# %% [markdown]
# Read row by row: **TP is added when the batch cannot be split further** — at 512
# sequences on 512 GPUs each dp replica gets 512/dp sequences, and with DP = 64 and PP = 8
# that is 8 micro-batches for 8 stages, a bubble of 7/15 of the step; more TP lets dp
# shrink and m grow. With a large batch the planner does maximize DP and minimize TP.
# **And TP is added when a layer does not fit**: at 175B no TP = 1 layout fits. Adding TP
# at fixed t·p = 8 does not shrink the model states per GPU at all (Ψ/(t·p) either way);
# it splits the activations (the 70B-class shape, 80 layers × h = 8192, ZeRO-1, no
# recomputation):

# %%
m70 = MODELS["70B"]
c512 = Cluster(gpus=512)
split = [evaluate(m70, c512, 512, 64, t, p, 1, 1, "none", 0.5) for t, p in ((1, 8), (2, 4), (4, 2))]
table(["dp × tp × pp", "model states GB", "activations GB", "fits in 80 GB"],
      [[f"64 × {r.tp} × {r.pp}", f"{r.states / GB:.1f}", f"{r.activations / GB:.1f}", r.fits]
       for r in split])
assert split[0].states == split[1].states and split[1].activations < split[0].activations

# %% [markdown]
# ### 7.3 A 70B model on 8 GPUs
#
# > *"70B model, 8 GPUs → FSDP stores ~9B params per GPU."*
# > · *"70B model, 64 GPUs: with ZeRO-3 ~4 GB per GPU."*
#
# 70B/8 = 8.75B parameters per GPU, right; but training holds 16 bytes per parameter with
# mixed-precision Adam. Shape: 80 layers, h = 8192, 64 heads, s = 4096, global batch 64.

# %%
m70b = Model(80, 8192, 64, 4096, 32000, n_params=70e9)
c8 = Cluster(gpus=8)
fits8 = plan(m70b, c8, 64, 0.5, zero23_with_pp=True)
least = min(r.memory for r in plan(m70b, c8, 64, 0.5, fits_only=False, zero23_with_pp=True))
offload = [r for r in plan(m70b, c8, 64, 0.5, zero_stages=(3,), offload=("optim",)) if r.dp == 8]
grow = {g: best(m70b, Cluster(gpus=g), 64, 0.5, zero23_with_pp=True) for g in (8, 16)}
z3_64 = memory_per_gpu(m70b, Cluster(gpus=64), 64, 1, 1, 3, 1, "full", 1)[0]
say(f"8 × 80 GB: layouts that fit: {len(fits8)}; the least memory any layout needs is "
    f"{least / GB:.0f} GB per GPU (FSDP/ZeRO-3 alone: 16 × 70e9 / 8 = "
    f"{16 * 70e9 / 8 / GB:.0f} GB of states)")
say(f"FSDP + optimizer offloaded to CPU (ZeRO-Offload): {offload[0].states / GB:.0f} GB of "
    f"states, {offload[0].memory / GB:.1f} GB per GPU with activations: fits "
    f"({describe_row(offload[0])})")
print(f"without offload, two nodes (16 GPUs) are the fewest whole nodes that fit it: "
      f"{describe_row(grow[16])}, {grow[16].memory / GB:.0f} GB per GPU")
say(f"on 64 GPUs ZeRO-3 holds {z3_64 / GB:.1f} GB of model states per GPU, not ~4 GB "
    f"(~4 GB is 70e9 × 4 bytes / 64: fp32 weights alone)")
assert not fits8 and grow[8] is None and grow[16] is not None and offload[0].fits

# %% [markdown]
# ### 7.4 8 × A100 80 GB, a 60 GB model: DDP or FSDP?
#
# > *"You have 8× A100 GPUs (80GB each). Your model is 60GB. DDP: batch_size=4 per GPU,
# > 65K tokens per step. FSDP: 72.5 GB free, batch_size=14, 229K tokens per step (3.5×
# > more!) ... Training 1T tokens: 1T / 16K tokens/sec ≈ 17 hours."*
#
# Reading "60 GB" as mixed-Adam model states: Ψ = 3.75B (16 bytes each); 18 layers,
# h = 4096, 32 heads, s = 2048. Largest micro-batch per GPU the memory allows:

# %%
m60 = Model(18, 4096, 32, 2048, 50257, n_params=3.75e9)
biggest = {z: [max_micro_batch(m60, c8, 8, 1, 1, z, rc) for rc in RECOMPUTE] for z in (0, 3)}
table(["strategy"] + [f"recompute {rc}" for rc in RECOMPUTE] + ["tokens per step (selective)"],
      [[name] + biggest[z] + [f"{8 * biggest[z][1] * m60.seq:,}"]
       for name, z in (("DDP (ZeRO-0)", 0), ("FSDP (ZeRO-3)", 3))])
ddp = best(m60, c8, 512, 0.5, zero_stages=(0,))
fsdp = [r for r in plan(m60, c8, 512, 0.5, zero_stages=(3,)) if r.tp * r.pp == 1][0]
table(["global batch 512", "layout", "step s", "tokens/s", "MFU"],
      [[n, describe_row(r), f"{r.step_s:.2f}", f"{r.tokens_per_s:,.0f}", f"{r.mfu:.2f}"]
       for n, r in (("DDP", ddp), ("FSDP", fsdp))])
days_1t = training_time(m60.params, 1e12, 8, 312e12, 0.5) / DAY
say(f"tokens per step is not throughput: with gradient accumulation DDP runs the same "
    f"global batch at {ddp.tokens_per_s / fsdp.tokens_per_s:.2f}× FSDP's tokens/s here. "
    f"1T tokens: 6·N·D at MFU 0.5 on 8 A100s takes {days_1t:.0f} days; at the answer's "
    f"16K tokens/s, {1e12 / 16e3 / DAY:.0f} days, not 17 hours")
assert ddp.tokens_per_s >= fsdp.tokens_per_s and days_1t > 100

# %% [markdown]
# ### 7.5 How long will training take?
#
# > *"How do you estimate training time? Time per step × steps per epoch × epochs. Factor
# > in communication overhead."*
#
# Two ways for GPT-3 175B on 300B tokens with 1024 A100s: the FLOP count C ≈ 6·N·D
# (Kaplan et al. 2020; 8·N·D with full recomputation, Narayanan et al. 2021 Section 5.1)
# over the achieved FLOP/s; or the planner's step time × steps, which adds the bubble and
# exposed communication to compute at MFU 0.5.

# %%
N, D, n = 175e9, 300e9, 1024
g3_steps = D / (1536 * GPT3_175B.seq)
est = [("6·N·D at 140 TFLOP/s per GPU", training_time(N, D, n, 140e12, 1.0)),
       ("8·N·D at 140 TFLOP/s (Narayanan et al.'s 34 days)",
        training_time(N, D, n, 140e12, 1.0, flops_per_param_token=8)),
       ("6·N·D at MFU 0.5 (156 TFLOP/s)", training_time(N, D, n, 312e12, 0.5)),
       (f"planner: {g3_steps:,.0f} steps × {g3.step_s:.2f} s ({describe_row(g3)})",
        g3_steps * g3.step_s)]
table(["estimate", "days"], [[name, f"{s / DAY:.1f}"] for name, s in est])
say(f"Narayanan et al.'s 34 days is 8·N·D at 140 TFLOP/s ({est[1][1] / DAY:.1f} days); "
    f"the same throughput counted as 6·N·D gives {est[0][1] / DAY:.1f}; the planner's "
    f"step (MFU {g3.mfu:.2f} after bubble and communication) gives {est[3][1] / DAY:.1f}")
assert abs(est[1][1] / DAY - 34) < 0.5 and est[0][1] < est[1][1]

# %% [markdown]
# ## 8. Try it
#
# Pick a world size, a dp × tp × pp layout (the list holds only the layouts this world
# size and model allow: tp divides the 4 heads, pp the 4 layers, each replica's rows split
# into m micro-batches, 1F1B needs m ≥ pp), micro-batches and schedule, and press
# **Run**: the real `3d` trains on that mesh and the bytes-per-group table, the traffic
# heatmap and the loss beside `single` are redrawn. A click does not block the kernel: the
# status line shows the run's progress and **Stop** ends it. The cell runs it once itself.

# %%
explorer = MeshExplorer(BASE, single)
res = explorer.run(**WIDGET)
assert all(r["measured"] == r["predicted"] for r in res["rows"])
assert res["param_diff"] <= TOL and res["loss_diff"] <= TOL
assert len(explorer.fig.data) == 3  # heatmap, single's loss, 3d's loss
explorer

# %% [markdown]
# ## 9. Every dimension on one mesh
#
# `3d` is one combination. The `mesh` strategy (distlab.parallel.parallelize) takes any
# degrees whose product is the world: **pp** (pipeline stages), **dp_replicate** (replicas of
# the same shards: HSDP), **dp_shard** (ranks that shard the model state with ZeRO stage
# `zero_stage`), **cp** (ranks that split every sequence), **tp** (ranks that split every
# layer), and **ep** carved from the data-parallel ranks for a mixture of experts. Rank order
# as torchtitan's: tp fastest, then cp, dp_shard, dp_replicate, pp. It applies the parallelisms
# in one written order, each the one-dimension code of the notebooks before, handed its
# group's `Comm`: TP's splits, CP's attention, the pipeline's cut, then ZeRO over dp_shard × cp
# (the cp ranks hold the same parameters) with each shard averaged over dp_replicate. A
# config names the degrees: `RunConfig(tp=2, cp=2, dp_shard=2)`.
#
# **The explorer** draws who talks to whom: one row per group kind, one column per rank, the
# number the rank's group along that kind. Move a degree; a mesh that cannot run says why.

# %%
explorer_nd = MeshND(BASE, tp=2, cp=2, dp_shard=2)
assert explorer_nd.config().world_size == 8
try:  # a mesh that cannot run is refused before any process starts, naming why
    BASE.replace(tp=2, cp=3, world_size=8, strategy="mesh")
    refused = ""
except ValueError as e:
    refused = str(e)
print("tp=2, cp=3 on 8 ranks:", refused)
assert "cp3" in refused and "world_size=8" in refused
explorer_nd

# %% [markdown]
# **Compositions, trained.** Three meshes from the launch above (one in quick mode), each
# against `single` (same tolerance as 3d's: only the summation order differs), and each group
# kind's bytes, summed over its members in the last step, against
# `distlab.theory.mesh_bytes` (tp's all-reduces, the ring's K/V and dK/dV hops, the
# pipeline's activations, ZeRO's reduce-scatter and all-gathers with padding, HSDP's
# all-reduce of shards).

# %%
nd_rows, nd_diff = [], {}
for name, cfg in ND.items():
    r = runs[name]
    nd_diff[name] = max(worst_param_diff(st, single.states[0]) for st in r.states)
    for d in dimension_rows(cfg, r):
        nd_rows.append([name, d["kind"], f"{d['measured']:,}", f"{d['predicted']:,.0f}",
                        f"{d['ratio']:.4f}"])
table(["mesh", "group kind", "booked, one step (all members)", "formula", "booked / formula"],
      nd_rows)
table(["mesh", "worst parameter diff vs single"],
      [[n, f"{d:.1e}"] for n, d in nd_diff.items()])
nd_ratios = [float(r[-1]) for r in nd_rows]
assert all(d <= TOL for d in nd_diff.values())
assert all(abs(x - 1) <= 0.02 for x in nd_ratios)

# %% [markdown]
# **The planner's long-context layout.** `distlab.theory.plan` (modelled) for an 8B
# Llama-shaped model at 256k-token sequences on 64 A100s of 80 GB (notebook 14 asks the
# same): no dp × tp × pp layout holds its activations; with context parallelism the fastest
# that fits splits layers and sequences both, tp × cp. The first composition above is that
# shape at small scale, trained.

# %%
lc = long_context_plan()
table(["search", "fastest layout that fits", "GB per GPU", "step s (modelled)"],
      [[k, "nothing fits" if r is None else describe_row(r) + f", cp {r.cp}",
        "" if r is None else f"{r.memory / GB:.1f}", "" if r is None else f"{r.step_s:.1f}"]
       for k, r in lc.items()])
lc_best = lc["with cp"]
assert lc["3D only"] is None and lc_best is not None

# %% [markdown]
# **The planner's ranking, trained** (distlab.studies.plan_check). This machine as the
# planner's cluster: one rank's FLOP/s on one thread (the planner's 6·N·tokens over the
# measured step), the loopback all-reduce's α and β fitted on 8 ranks. The planner ranks
# every dp × tp × pp × cp layout of 8 ranks for this notebook's GPT; its fastest few (the
# best row of each layout) train on the mesh, PLAN_REPEATS times each in alternating order.
# Its order holds between two layouts when the measured medians keep it (pairs it predicts
# within 5% are left out: near-ties mean nothing to it). Two launches.

# %%
pc = planned_vs_measured(BASE.replace(steps=PLAN_STEPS), gpus=8, top=PLAN_TOP,
                         repeats=PLAN_REPEATS, warmup=2, coll_reps=3, sizes=PLAN_SIZES)
table(["#", "layout (planner's row)", "predicted ms", "measured ms (median)", "repeats ms"],
      [[r["rank"], r["layout"], f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] * 1e3:.1f}",
        ", ".join(f"{x * 1e3:.1f}" for x in r["spread_s"])] for r in pc["rows"]])
order = pc["order"]
say(f"one rank: {pc['flops_per_rank'] / 1e9:.1f} GFLOP/s; all-reduce α "
    f"{pc['link']['alpha_call_s'] * 1e3:.1f} ms a call, β {pc['link']['beta_Bps'] / 1e6:.0f} "
    f"MB/s. The planner's order: {order['kept']} of {order['pairs']} pairs kept, "
    f"{order['decided']} decided beyond the repeats' spread")
assert len(pc["rows"]) == PLAN_TOP and all(r["measured_s"] > 0 for r in pc["rows"])

# %% [markdown]
# ## What the textbook says, what this run measured
#
# Every figure is computed from this run's variables or, marked "modelled", from the
# planner or the α-β model with the source named; every verdict is computed from them, and
# a row reads **no** where they disagree with the claim (the 512-GPU sweep decides the rule
# of thumb, not one chosen planner cell). The "timed" rows (the bubble, the planner's
# ranking) read a clock, so they depend on this machine and its load (8 ranks share 2 cores:
# whatever else runs slows whichever step it lands on): each is read over repeats (every
# rank's steps; the layouts' alternating repeats), shows min / median / max, and reads
# "undecided on this machine" when the middle halves of the repeats overlap its bound
# (`distlab.lab.timed`); quick mode's 2 repeats per layout leave the ranking undecided.

# %%
tp1_best = sum(tp == 1 for tp in best_tp.values())
claims = [
    claim("TP has the most communication", "Narayanan et al. 2021 Section 3",
          f"tp sent {fmt_bytes(tp_bytes)} in {calls['tp']} blocking all-reduces per step, dp "
          f"{fmt_bytes(dp_bytes)} in {calls['dp']}",
          tp_bytes > dp_bytes and calls["tp"] > calls["dp"]),
    claim("maximize DP, minimize TP (rule of thumb)", "interview answer; the planner "
          "(distlab.theory.plan) on the 512-GPU sweep of section 7.2",
          f"the fastest layout has tp = 1 in {tp1_best} of {len(best_tp)} cases; best tp "
          "for 1.3B as the batch grows " + " → ".join(str(best_tp[("1.3B", b)]) for b in BATCHES)
          + ", for 175B " + " → ".join(str(best_tp[("175B", b)]) for b in BATCHES),
          tp1_best == len(best_tp), basis="modelled"),
    claim("TP within a node, PP across nodes", "Narayanan et al. 2021 Section 3; the α-β "
          "model (distlab.comm LINKS) on this run's bytes and messages",
          f"rank 0's step: {tp_in_node * 1e6:.0f} µs of communication with tp on NVLink vs "
          f"{pp_in_node * 1e6:.0f} µs with pp on NVLink; GPT-3 t=8: {tp_nv:.2f} s on NVLink vs "
          f"{tp_ib:.2f} s on InfiniBand (the planner only places tp within a node, so its "
          "sweep cannot test this)", tp_in_node < pp_in_node and tp_nv < tp_ib,
          basis="modelled"),
    bubble_curve_claim(brows, BUBBLE_TOL),
    claim("ZeRO-1 over dp shards the optimizer state by dp", "Rajbhandari et al. 2020 (P_os)",
          f"dp={DP}: optimizer state {optim_ratio:.4f} of unsharded, = 2·4·P/dp + 4 on all "
          f"{len(zrows)} ranks; its reduce-scatter + all-gather: {fmt_bytes(dp_bytes)} per rank",
          all(z["measured"] == z["formula"] for z in zrows) and abs(optim_ratio - 1 / DP) < 1e-3),
    claim("every group makes the calls, on the sizes, its formula says",
          "Shoeybi et al. 2019; Narayanan et al. 2021; Rajbhandari et al. 2020",
          f"booked from the calls: {sum(r['measured'] == r['predicted'] for r in rows)} of "
          f"{len(rows)} groups equal the formula",
          all(r["measured"] == r["predicted"] for r in rows)),
    claim("the formulas give each rank's bytes on the wire (within 5%)",
          "the ring's bus bytes (nccl-tests' convention) applied to each group",
          ("not measured here" if not wire_seen else
           f"wire / booked per rank: {min(wire_over_booked):.3f} to "
           f"{max(wire_over_booked):.3f} (gloo's reduce-scatter over dp, its headers)"),
          wire_seen and all(abs(x - 1) <= 0.05 for x in wire_over_booked)),
    claim("3d computes what one process computes", "tests/test_mesh.py",
          f"after {STEPS} SGD steps: parameters {param_diff:.1e}, loss {loss_diff:.1e} "
          f"(tolerance {TOL:g})", param_diff <= TOL and loss_diff <= TOL),
    claim("the parallelisms compose: any mesh computes what one process computes",
          "torchtitan and Megatron-Core's N-D meshes; tests/test_mesh.py",
          "; ".join(f"{n}: {d:.1e}" for n, d in nd_diff.items()) + f" (tolerance {TOL:g})",
          all(d <= TOL for d in nd_diff.values())),
    claim("each dimension moves the bytes its formula says (within 2%)",
          "distlab.theory.mesh_bytes (Shoeybi et al. 2019, Liu et al. 2023, Rajbhandari et al. "
          "2020)", f"booked / formula over {len(nd_ratios)} group kinds: {min(nd_ratios):.4f} "
          f"to {max(nd_ratios):.4f}", all(abs(x - 1) <= 0.02 for x in nd_ratios)),
    claim("at 256k tokens an 8B model fits on 64 A100s only with cp, as tp × cp",
          "the planner (distlab.theory.plan), Korthikanti et al. 2022's activations",
          f"3D only: nothing fits; with cp: {describe_row(lc_best)}, cp {lc_best.cp}, "
          f"{lc_best.memory / GB:.1f} GB per GPU", lc["3D only"] is None and lc_best.tp > 1
          and lc_best.cp > 1, basis="modelled"),
    planner_order_claim(pc),
]
claims_table(claims)
# the planner's sweep decides the rule of thumb (modelled), the wire decides the wire row
# (on gloo, the reduce-scatter over dp makes it "no"), a clock the timed rows; every other row
# must hold
shown = [claims[1]] + [c for c in claims if "on the wire" in c["claim"]
                       or c["basis"] == "timed"]
assert all(c["holds"] for c in claims if c not in shown), [c["claim"] for c in claims]
