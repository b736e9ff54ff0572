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
# # 18 · Across nodes: what to shard, where to place, when a node dies
#
# [17 · Several nodes](17_multi_node.ipynb) made simulated nodes on this machine (a network
# namespace per node, a link whose rate `tc` limits, one `torchrun` agent per node) and showed
# that the slow link sets the step. This notebook asks what a layout should put on that link,
# over the same nodes and the same 100 Mbit/s link:
#
# 1. HSDP: shard inside a node, replicate across, against sharding over every rank;
# 2. where each kind of parallelism sits: DP, TP and PP inside a node against across the link,
#    measured beside the α-β model's ranking and the planner's;
# 3. a node dies mid-run and a replacement joins: torchrun's elastic restart;
# 4. the closing table: what the textbook says, what this run measured.
#
# It needs root (network namespaces); without it the notebook says so and measures nothing.
# Each section starts clusters of its own (every agent and rank imports torch: seconds of CPU
# apiece), so CI's quick run leaves them to full mode; the test suite runs their code
# (tests/test_hsdp.py; tests/test_cluster.py, a node killed and replaced).

# %% tags=["parameters"]
import os

# CI sets WORKBOOK_QUICK=1: the sections below run in full mode only
FULL = os.environ.get("WORKBOOK_QUICK", "0") != "1"
LINK = 100.0  # Mbit/s between the two nodes
WARMUP = 2  # steps left out of every median and spread
# Section 1: steps per way of sharding (the first WARMUP warm up)
HSDP_STEPS = 8
# Section 2: steps per layout and placement (the first WARMUP warm up)
PLACE_STEPS = 10
# Section 3: steps, a checkpoint every CKPT_EVERY, node 1 killed once step KILL_AFTER is logged
FAULT_STEPS, CKPT_EVERY, KILL_AFTER = 24, 5, 12
# The planner's fast tier: an all-reduce of this many MiB between two ranks on this machine
FAST_TIER_MIB = 8.0

# %%
from distlab import RunConfig
from distlab.caller import cluster
from distlab.lab.common import claim, claims_table, fmt_bytes, say, table
from distlab.lab.multi_node import (fast_tier_Bps, hsdp_figure, hsdp_study, node_fault_figure,
                                    node_fault_study, order_study, placement_figure,
                                    placement_study, ranking)
from distlab.lab.timed import all_of, below, in_order, timed_claim

WHY = cluster.available()  # None: simulated nodes can be made here
say("simulated nodes: available (root, iproute2)" if WHY is None else
    f"simulated nodes: not available here ({WHY}); the cells below measure nothing")
if WHY is None and not FULL:
    say("quick mode: sections 1 to 3 run in full mode only (ten more clusters)")

# %%
# the fast tier inside a node, for section 2's planner: two ranks over loopback, S / the
# all-reduce's median seconds (full mode: a launch of its own, seconds of CI's time otherwise)
if WHY is None and FULL:
    node_Bps = fast_tier_Bps(FAST_TIER_MIB)
    say(f"all-reduce of {FAST_TIER_MIB:g} MiB between 2 ranks over this machine's loopback: "
        f"{node_Bps / 2**20:,.0f} MiB/s (S / seconds), against the link's {LINK / 8:g} MB/s")

# %% [markdown]
# ## 1. HSDP: shard inside a node, replicate across
#
# Sharding the model over every rank (ZeRO-3, FSDP) puts its all-gathers and reduce-scatters
# on the slow link: each step crosses it with the parameters twice (forward and backward) and
# the gradients once. **HSDP** (hybrid sharding; Zhao et al. 2023, PyTorch FSDP, §3.2.2)
# shards inside each node and keeps a replica per node: the gathers stay on the node's fast
# tier, and only the gradient shards are all-reduced across nodes. A node's g ranks each send
# 2(n−1)/n of their shard, so the node sends **g · 2(n−1)/n · (its shard's bytes)** per step:
# the whole gradient once at n = 2.
#
# Four ways train the same GPT with SGD on the same batches, on 2 nodes × 2 ranks over the
# same 100 Mbit/s link: our `fully_shard` over a node's ranks plus `replicate_gradients`
# across nodes, FSDP2's `fully_shard` on a 2-D device mesh (`RunConfig(strategy="fsdp-torch",
# shard_ranks=2)` is the same in the training loop), and both sharding over all four ranks.
# Each step's bytes come from node 0's link counters read by its rank between barriers;
# **payload** is the frames less their headers (66 bytes a packet: Ethernet, IPv4, TCP with
# timestamps).

# %%
if WHY is None and FULL:
    hsdp = hsdp_study(nodes=2, ranks=2, link_mbit=LINK, steps=HSDP_STEPS)
    hsdp_figure(hsdp).show()
    table(["way", "step (ms)", "link frames per step", "payload per step", "formula",
           "payload / formula"],
          [[name, f"{1e3 * r['seconds']:.0f}", fmt_bytes(r["frames"]), fmt_bytes(r["payload"]),
            "—" if r["formula"] is None else fmt_bytes(r["formula"]),
            "—" if r["formula"] is None else f"{r['payload'] / r['formula']:.4f}"]
           for name, r in hsdp.items()])
    hsdp_losses = [r["losses"] for r in hsdp.values()]
    hsdp_diff = max(abs(a - b) for run in hsdp_losses for a, b in zip(run, hsdp_losses[0]))
    say(f"largest loss difference between the four ways over {HSDP_STEPS} steps: "
        f"{hsdp_diff:.1e} (the same SGD steps, summed in other orders)")

# %% [markdown]
# ## 2. Where each kind of parallelism sits
#
# The usual layout rule is "tensor parallelism inside a node, pipeline and data parallelism
# across nodes" (Narayanan et al. 2021, Megatron-LM, §3.3: TP's all-reduces sit on every layer's
# critical path; PP sends one activation per micro-batch). Here the same three 2-rank layouts
# of `3d` run twice: both ranks in one node, then one rank on each node with the 100 Mbit/s
# link between them. Everything rank 0 sends then crosses the link, and
# `distlab.theory.comm_bytes.predicted_bytes` counts it per step: ZeRO-1's reduce-scatter and
# all-gather of the gradients and parameters (gloo's reduce-scatter writes twice the ring's
# bytes, measured in 01), TP's 4 all-reduces of the residual stream per layer, PP's activations
# (B·T·h·4 bytes a step, whatever the micro-batches). The **modelled** step across the link is
# the measured step inside a node plus those bytes at the link's rate. The **planner**
# (`distlab.theory.plan`, the one 07 uses for GPU clusters) gets this machine's two
# tiers: the link's rate between nodes and, inside a node, the rate of an all-reduce between
# two ranks over this machine's loopback, the path a node's own ranks talk over (measured in the
# first cell below); its estimate is the step inside plus what its communication terms say the
# link adds (its ring formulas in fp32; its pipeline term counts the m + p − 1 slots of the
# critical path). Both rankings of the layouts are checked against the measured one. The layouts'
# compute differs (TP splits each layer, DP the batch), so what tells where each belongs is the
# time the link **adds** to its step, not the ratio.

# %%
if WHY is None and FULL:
    places = placement_study(RunConfig(strategy="ddp", world_size=2, steps=PLACE_STEPS),
                             LINK, warmup=WARMUP, node_Bps=node_Bps)
    placement_figure(places).show()
    table(["layout, 2 ranks", "inside a node (ms)", "across the link (ms)", "added (ms)",
           "link bytes per step", "formula", "modelled across (ms)", "measured / modelled",
           "planner across (ms)"],
          [[r.name, f"{1e3 * r.inside_s:.0f}", f"{1e3 * r.across_s:.0f}", f"{1e3 * r.added_s:.0f}",
            fmt_bytes(r.link_bytes), fmt_bytes(r.formula_bytes), f"{1e3 * r.predicted_s:.0f}",
            f"{r.across_s / r.predicted_s:.2f}", f"{1e3 * r.planner_s:.0f}"] for r in places])
    measured_order = ranking({r.name: r.across_s for r in places})
    modelled_order = ranking({r.name: r.predicted_s for r in places})
    planner_order = ranking({r.name: r.planner_s for r in places})
    say(f"fastest to slowest across the link, measured: {' < '.join(measured_order)}; "
        f"modelled: {' < '.join(modelled_order)}; planner: {' < '.join(planner_order)}")

# %% [markdown]
# **The same degrees, the other order.** Above, each layout had both its ranks inside a node or
# across. With two nodes of two ranks, `3d` at dp = tp = 2 has one group of each kind per rank,
# and `RunConfig(mesh_order=...)` decides which crosses the link: Megatron-LM's order
# (`"tp-dp-pp"`, tp fastest) puts each tp group inside a node and each dp group across it;
# `"dp-tp-pp"` does the opposite. The compute is the same; the link carries ZeRO-1's gradient
# and parameter traffic in the first and TP's per-layer all-reduces in the second. The
# formula's bytes per node (`lab.multi_node.node_link_formula`: the two ranks' traffic over
# groups that span the nodes) at the link's rate, added to the step inside one node, is the
# **modelled** step.

# %%
if WHY is None and FULL:
    orders = order_study(RunConfig(strategy="ddp", world_size=2, steps=PLACE_STEPS), LINK,
                         warmup=WARMUP)
    placement_figure(orders, title="dp = tp = 2 on 2 nodes × 2 ranks: which group crosses "
                     "the link").show()
    table(["layout, 2 nodes × 2 ranks, dp = tp = 2", "inside a node (ms)",
           "across the link (ms)", "added (ms)", "link bytes per step", "formula",
           "modelled across (ms)", "measured / modelled"],
          [[r.name, f"{1e3 * r.inside_s:.0f}", f"{1e3 * r.across_s:.0f}",
            f"{1e3 * r.added_s:.0f}", fmt_bytes(r.link_bytes), fmt_bytes(r.formula_bytes),
            f"{1e3 * r.predicted_s:.0f}", f"{r.across_s / r.predicted_s:.2f}"] for r in orders])

# %% [markdown]
# ## 3. A node dies: the elastic restart
#
# On a cluster a machine fails mid-run. `torchrun --max-restarts 1 --nnodes 1:2` makes the job
# elastic: when a rank fails, its node's agent restarts the node's ranks into a new rendezvous
# round, which starts once at least the minimum of nodes (here 1 of 2) has joined and, within
# its last call, up to the maximum. Here node 1 (its agent and its ranks) is SIGKILLed once
# rank 0 has logged step 12, and a new agent starts on node 1 a second later, as a scheduler
# replaces a machine. The surviving ranks fail in their next collective (gloo: "connection
# closed by peer"), their agent restarts them, the replacement joins the round, and every rank
# loads the newest checkpoint that verifies (`resume_from="auto"`; one every 5 steps) and
# trains on. The steps since that checkpoint run twice. The same run, uninterrupted, is the
# reference: the checkpoint holds the model, the optimizer and every rank's RNGs, and the
# batch is a function of the step, so each loss should come out **bit for bit** the same.

# %%
if WHY is None and FULL:
    fault = node_fault_study(RunConfig(strategy="ddp", world_size=4, nodes=2, link_mbit=LINK,
                                       steps=FAULT_STEPS, checkpoint_every=CKPT_EVERY,
                                       timeout_s=20), KILL_AFTER)
    node_fault_figure(fault).show()
    fault_diff = max(abs(fault.recovered[s] - fault.uninterrupted[s]) for s in fault.uninterrupted)
    say(f"node 1 killed after step {fault.killed_after_step}; the restarted ranks resumed from "
        f"{fault.resumed_from} steps done and logged their first step "
        f"{fault.kill_to_resumed_s:.1f} s after the kill (1 s of it the replacement's delay); "
        f"steps {fault.rerun[0]}–{fault.rerun[-1]} ran twice. Largest loss difference from the "
        f"uninterrupted run over {FAULT_STEPS} steps: {fault_diff:.1e}. The runs took "
        f"{fault.seconds[0]:.0f} s and {fault.seconds[1]:.0f} s; agents' exit codes "
        f"{fault.exit_codes} (node 0, node 1 killed, its replacement); processes left: "
        f"{len(fault.left)}")

# %% [markdown]
# ## What the textbook says, what this run measured
#
# Rows that read a clock have the basis **timed**: each is decided over repeats (each step after
# the warm-up is one) and shows the min / median / max. It reads yes or no only when the middle
# halves of the spreads decide it, else "undecided on this machine". Load from other programs
# on this machine stretches some steps and not others: the spreads widen and a verdict can turn
# undecided. The byte and loss rows do not depend on the load.

# %%
if WHY is None and FULL:
    hsdp_ratios = {k: r["payload"] / r["formula"] for k, r in hsdp.items() if r["formula"]}
    full_shard = hsdp["FSDP2, over all ranks"]
    rows_claims = [
        claim("HSDP sends across nodes only the gradient shards' all-reduce: "
              "g · 2(n−1)/n · shard bytes per node and step",
              "Zhao et al. 2023 (PyTorch FSDP)",
              "payload / formula: "
              + ", ".join(f"{k} {v:.4f}" for k, v in hsdp_ratios.items()) + " (within 2%)",
              all(abs(v - 1) <= 0.02 for v in hsdp_ratios.values())),
        timed_claim("across a slow link, shard inside a node and replicate across (HSDP) "
                    "rather than shard over every rank", "Zhao et al. 2023 (PyTorch FSDP)",
                    below(hsdp["FSDP2, HSDP"]["samples"], full_shard["samples"]),
                    {"FSDP2 HSDP": hsdp["FSDP2, HSDP"]["samples"],
                     "FSDP2 over all 4 ranks": full_shard["samples"]}, interleaved_=False,
                    note=f"step times; HSDP's link payload "
                         f"{hsdp['FSDP2, HSDP']['payload'] / full_shard['payload']:.2f}× "
                         "sharding over all 4 ranks'"),
    ]
    added = {r.name: r.added_samples() for r in places}
    across = {r.name: r.across_steps for r in places}
    tp, pp = "TP", next(k for k in added if k.startswith("PP"))
    worst_model = max(abs(r.across_s / r.predicted_s - 1) for r in places)
    rows_claims += [
        timed_claim("tensor parallelism inside a node, pipeline and data parallelism across "
                    "nodes (an interview answer)", "Narayanan et al. 2021 (Megatron-LM), §3.3",
                    all_of(*(below(added[k], added[tp]) for k in added if k != tp),
                           *(below(added[pp], added[k]) for k in added if k != pp)),
                    added, interleaved_=False,
                    note=f"what the {LINK:g} Mbit/s link adds to a step, 2 ranks one per "
                         "node against both in one node (holds when it adds most to TP and "
                         "least to PP)"),
        timed_claim("at the same degrees, put tensor parallelism inside a node and data "
                    "parallelism across it rather than the reverse (an interview answer)",
                    "Narayanan et al. 2021 (Megatron-LM), §3.3",
                    below(orders[0].across_steps, orders[1].across_steps),
                    {r.name: r.across_steps for r in orders}, interleaved_=False,
                    note="dp = tp = 2 on 2 nodes × 2 ranks, steps across the link; link "
                         + ", ".join(f"{r.name} {fmt_bytes(r.link_bytes)} a step (formula "
                                     f"{fmt_bytes(r.formula_bytes)})" for r in orders)),
        timed_claim("the α-β model, from the step inside a node and the bytes by formula, "
                    "ranks the layouts across the link as they measure",
                    "Hockney 1994; this notebook", in_order(across, modelled_order), across,
                    interleaved_=False,
                    note=f"steps across the link; modelled order "
                         f"{' < '.join(modelled_order)}, the medians' "
                         f"{' < '.join(measured_order)}; worst median {worst_model:.0%} off "
                         "the model"),
        timed_claim("the planner, given this machine's two tiers, ranks the layouts across "
                    "the link as they measure",
                    "distlab.theory.plan (Narayanan et al. 2021's terms)",
                    in_order(across, planner_order), across, interleaved_=False,
                    note=f"steps across the link; planner's order "
                         f"{' < '.join(planner_order)}; the link adds, medians measured / "
                         "by the planner: "
                         + ", ".join(f"{r.name} {1e3 * r.added_s:.0f} / "
                                     f"{1e3 * r.planner_added_s:.0f} ms" for r in places)),
    ]
    rows_claims.append(claim(
        "after a node fails, an elastic restart from the last checkpoint continues the run "
        "exactly as if nothing had happened", "torchrun (torch.distributed.elastic)",
        f"node 1 killed after step {fault.killed_after_step}, replaced, resumed from "
        f"{fault.resumed_from} steps done: the {len(fault.recovered)} losses and the "
        f"{len(fault.rerun)} re-run steps' first tries equal the uninterrupted run's bit "
        f"for bit: {'yes' if fault.identical else 'no'} (largest difference "
        f"{fault_diff:.1e}); processes left {len(fault.left)}",
        fault.identical and not fault.left))
    claims_table(rows_claims)
