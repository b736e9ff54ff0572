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
# # 17 · Several nodes: a slow link between them
#
# Every other notebook runs its ranks inside one machine, where they all share one fast
# loopback. Real training outgrows one machine, and then the question that shapes every
# layout is **what crosses the slow link between nodes**. Here that link is real: the
# launcher makes **simulated nodes** on this machine (a Linux network namespace per node,
# joined through a switch by links whose rate `tc` limits), and starts one real `torchrun`
# agent in each, the command you would run on each machine of a cluster:
#
#     torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d
#              --rdzv-endpoint <node 0>:29400 --local-addr <this node> -m distlab ...
#
# Ranks inside a node talk over the node's own address at memory speed; between nodes every
# byte crosses the throttled link. It needs root (network namespaces); without it this
# notebook says so and measures nothing. Sections:
#
# 1. DDP on 2 nodes × 2 ranks (one each in CI's quick run) against the same run on one
#    machine, with each node's link on the dashboard;
# 2. the step time over a sweep of link speeds, against t(L) = t0 + bits per step / L;
# 3. one all-reduce across the link: the flat ring, the hierarchical all-reduce and gloo's own,
#    against the two-tier model (full mode);
# 4. fewer bytes over the link: top-k compression, PowerSGD, local SGD and DiLoCo against DDP,
#    as loss against time (full mode);
# 5. HSDP: shard inside a node, replicate across, against sharding over every rank (full mode);
# 6. where each kind of parallelism sits: DP, TP and PP inside a node against across the link,
#    measured beside the α-β model's ranking (full mode);
# 7. a node dies mid-run and a replacement joins: torchrun's elastic restart (full mode);
# 8. the closing table: what the textbook says, what this run measured;
# 9. a control panel with the nodes and the link as knobs, to try other layouts.

# %% tags=["parameters"]
import os

# CI sets WORKBOOK_QUICK=1: fewer steps and two link speeds, under a minute.
QUICK = os.environ.get("WORKBOOK_QUICK", "0") == "1"
# Every run trains RunConfig's GPT (0.82M parameters, 3.3 MB of fp32 gradients): enough bytes
# that the transfer, not the compute, sets the step over these links
STEPS = 8 if QUICK else 30  # section 1's run
# Ranks: two per node; CI's quick run puts one on each node (each torchrun agent and rank
# imports torch: seconds of its 2 cores apiece). The ring's factor 2(N−1)/N follows N.
WORLD = 2 if QUICK else 4
LINK = 100.0  # Mbit/s, section 1
# Section 2: link speeds (Mbit/s) and steps per run
LINKS = (100, 400) if QUICK else (25, 50, 100, 200, 400)
SWEEP_STEPS = 6 if QUICK else 10
WARMUP = 2
# Sections 3 to 7 start clusters of their own (each agent and rank imports torch: seconds of
# CPU apiece), so CI's quick run leaves them out; the test suite runs their code
# (tests/test_hierarchical.py, test_diloco.py, test_hsdp.py, test_cluster.py).
# Section 3: the size of the all-reduce the algorithms race (MiB)
ALLREDUCE_MIB = 16.0
# Section 4: the ways raced against section 1's DDP run (same model, batches, link and steps)
RACE = ("ddp, top-k 1%", "ddp-torch, PowerSGD r=2", "local SGD, H=8", "DiLoCo, H=8")
# Section 5: steps per way of sharding (the first two warm-up; the figures are medians)
HSDP_STEPS = 8
# Section 6: steps per layout and placement (the first two warm-up; the figures are medians)
PLACE_STEPS = 10
# Section 7: steps, a checkpoint every CKPT_EVERY, node 1 killed once step KILL_AFTER is logged
FAULT_STEPS, CKPT_EVERY, KILL_AFTER = 24, 5, 12
# ddp's gradients are summed by gloo in an order that depends on the ranks' layout: the same
# four gradients may round differently in fp32's last bit across nodes; tests measure < 1e-5
LOSS_TOL = 1e-5

# %%
from distlab import RunConfig, lab, launch
from distlab.caller import cluster
from distlab.lab.common import claim, claims_table, fmt_bytes, say, table
from distlab.lab.multi_node import (fit_link, hsdp_figure, hsdp_study, link_figure, link_sweep,
                                    node_fault_figure, node_fault_study, placement_figure,
                                    order_study, placement_study, race_figure,
                                    race_target, ranking,
                                    reach_time, slow_link_race, slow_link_ways, two_tier_figure,
                                    two_tier_study)

WHY = cluster.available()  # None: simulated nodes can be made here
say("simulated nodes: available (root, iproute2)" if WHY is None else
    f"simulated nodes: not available here ({WHY}); the cells below measure nothing")

# %% [markdown]
# ## 1. DDP on two nodes
#
# `RunConfig(nodes=2, link_mbit=...)` puts the world's ranks on two nodes, half on each. The
# dashboard is the usual one, with one more pair of bars in the bytes chart: **each node's
# link**, from the link interface's own byte counter (per step), beside each rank's bytes.
# The same config then runs on one machine: DDP computes the same thing wherever its ranks
# live.

# %%
if WHY is None:
    cfg = RunConfig(strategy="ddp", world_size=WORLD, steps=STEPS, timeout_s=300)
    on_nodes = launch(cfg.replace(nodes=2, link_mbit=LINK))
    lab.watch(on_nodes)
    on_nodes.wait()

# %%
if WHY is None:
    one_machine = launch(cfg, block=True)
    loss_diff = max(abs(a - b) for a, b in zip(on_nodes.losses(), one_machine.losses()))
    grads = on_nodes.info("n_params") * 4
    crossing = on_nodes.link_bytes_per_step()
    took = {"2 nodes": on_nodes, "one machine": one_machine}
    table(["where", "steps", "final loss", "wall time (s)"],
          [[k, len(r.losses()), f"{r.losses()[-1]:.4f}", f"{r.ended - r.started:.1f}"]
           for k, r in took.items()])
    table(["node", "link sent, whole run", "link received, whole run", "sent per step",
           "per step / gradient bytes"],
          [[i, fmt_bytes(link["sent"]), fmt_bytes(link["received"]), fmt_bytes(per),
            f"{per / grads:.2f}"] for i, (link, per) in enumerate(zip(on_nodes.links, crossing))])
    say(f"largest per-step loss difference, 2 nodes vs one machine: {loss_diff:.1e} "
        f"(tolerance {LOSS_TOL:g}); gradients {fmt_bytes(grads)} per rank per step")
    assert on_nodes.status == "done" and loss_diff < LOSS_TOL

# %% [markdown]
# A ring all-reduce over 4 ranks, two on each node, crosses the link once in each
# direction: the ring's edge out of a node carries what every rank sends its successor,
# 2(N−1)/N of the gradients (1.5× at N = 4; Patarasuk & Yuan 2009), plus TCP/IP's headers.
# Inside a node the other two edges carry as much, at memory speed, without touching the link.
# gloo chooses its all-reduce algorithm by message size, so the factor is the ring's only
# where gloo runs a ring: the link's counter says what it did.
#
# ## 2. The link sets the step
#
# Over a slow link the all-reduce is many backward passes long, so DDP's overlap hides
# little of it, and the α-β model (Hockney 1994) with β the link's rate predicts
# **t(L) = t0 + (bits each link carries per step) / L**. The runs below sweep L; the slope of
# the dashed line is not fitted to the times but counted on the links (the bytes per step
# above), so the measured points can disagree with it. t0, the step with an infinitely fast
# link, is the fit's intercept. Section 1's run is the point at its link speed.

# %%
if WHY is None:
    sweep_cfg = RunConfig(strategy="ddp", world_size=WORLD, nodes=2, steps=SWEEP_STEPS,
                          timeout_s=300)
    rows = link_sweep(sweep_cfg, LINKS, warmup=WARMUP, done=[on_nodes])  # reuses section 1's
    fit = fit_link(rows)
    link_figure(rows, fit).show()
    table(["link (Mbit/s)", "step (ms, median)", "t0 + bits / L (ms)", "measured / model",
           "link per step / gradients", "transfer share of the step"],
          [[f"{r.link_mbit:g}", f"{1e3 * r.step_s:.1f}", f"{1e3 * fit.predict(r.link_mbit):.1f}",
            f"{r.step_s / fit.predict(r.link_mbit):.2f}", f"{r.link_bytes / r.grad_bytes:.2f}",
            f"{fit.counted / r.link_mbit / r.step_s:.0%}"] for r in rows])
    say(f"fit: t0 {1e3 * fit.t0:.1f} ms; slope {fit.slope:.2f} s·Mbit/s against "
        f"{fit.counted:.2f} Mbit counted per step on each link: {fit.ratio:.2f}× "
        "(1.00: the step gets the link's whole rate)")

# %% [markdown]
# ## 3. One all-reduce across the link
#
# DDP's all-reduce is gloo's. Across nodes, the algorithm decides what crosses the link. The
# **flat ring** (Patarasuk & Yuan 2009; `Comm.ring_all_reduce`, written here) puts all N ranks
# on one ring, so the ring edge that leaves each node carries 2(N−1)/N of the tensor. The
# **hierarchical** all-reduce (`distlab.parallel.data_parallel.hierarchical`; the two-level
# scheme of Horovod's hierarchical all-reduce) reduce-scatters inside each node, all-reduces each
# shard across nodes, and all-gathers inside again: a node's ranks send 2(n−1)/n of the
# tensor across in all, n the nodes. At 2 nodes × 2 ranks that is 1.5 against 1 tensor: the
# link's bytes predict the hierarchical one 1.5× faster. "One flow" sends the node's part
# through one leader rank. The **modelled** time is the link's bytes at its rate, plus for the
# hierarchical ones the fast tier's all-reduce inside a node, measured in the same job.

# %%
if WHY is None and not QUICK:
    algos = two_tier_study(nodes=2, ranks=2, link_mbit=LINK, mib=ALLREDUCE_MIB)
    two_tier_figure(algos, ALLREDUCE_MIB, LINK).show()
    table(["algorithm", "seconds (median of 3)", "node 0's link per all-reduce", "formula",
           "modelled (s)", "measured / modelled"],
          [[r.name, f"{r.seconds:.3f}", "—" if r.link_bytes is None else fmt_bytes(r.link_bytes),
            "—" if r.formula_bytes is None else fmt_bytes(r.formula_bytes),
            "—" if r.modelled_s is None else f"{r.modelled_s:.3f}",
            "—" if r.modelled_s is None else f"{r.seconds / r.modelled_s:.2f}"] for r in algos])
    by_algo = {r.name: r for r in algos}

# %% [markdown]
# ## 4. Fewer bytes over the link
#
# When the link sets the step, the cure is to send less. Three families, each run here on the
# same two nodes, link, model and batches as section 1's DDP:
#
# * **top-k sparsification** (`ddp`, `compress="topk"`): each rank sends only the 1% largest
#   entries of each gradient bucket, values and indices, and keeps the rest in an error memory
#   added to the next step's gradient (Stich et al. 2018; Lin et al. 2018, Deep Gradient
#   Compression);
# * **PowerSGD** (`ddp-torch`, `compress="powersgd"`): PyTorch's own hook sends each gradient
#   matrix as two rank-2 factors, with error feedback (Vogels et al. 2019);
# * **infrequent averaging** (`diloco`): each rank trains alone for H = 8 steps, then the
#   ranks average once: plainly (**local SGD**, Stich 2019) or through an outer Nesterov step
#   on the averaged change (**DiLoCo**, Douillard et al. 2023: outer lr 0.7, momentum 0.9).
#
# Compression changes the gradient and averaging lets the replicas drift, so the question is
# not only bytes but **loss against wall-clock time**: the chart below. The target loss is
# DDP's own, half-way through its run, averaged over 5 steps.

# %%
if WHY is None and QUICK:
    say("quick mode: sections 3 and 4 run in full mode only (five more clusters)")
if WHY is None and not QUICK:
    race = slow_link_race(slow_link_ways(on_nodes.cfg, ("ddp", *RACE)), done={"ddp": on_nodes})
    ddp_row = race[0]
    target = race_target(ddp_row)
    race_figure(race, LINK, target).show()
    reach = {r.name: reach_time(r, target) for r in race}
    table(["way", "step (ms, mean)", "link per step", "per step / DDP's",
           "final loss (last 5)", f"reaches {target:.3f} at (s)", "speed-up to it"],
          [[r.name, f"{1e3 * r.step_s:.0f}", fmt_bytes(r.link_bytes),
            f"{r.link_bytes / ddp_row.link_bytes:.3f}", f"{r.final_loss():.3f}",
            "never" if reach[r.name] is None else f"{reach[r.name]:.1f}",
            "—" if reach[r.name] is None else f"{reach['ddp'] / reach[r.name]:.1f}×"]
           for r in race])

# %% [markdown]
# Reading it: each way sends a small fraction of DDP's bytes, so its steps are several times
# shorter. (Bytes per step: each node's link counter, read by its ranks at every step's end,
# from the end of the first step to the end of the last, over the steps between.) Whether
# that buys time depends on how much worse each step's update is: top-k's error memory
# delivers every gradient entry eventually; PowerSGD was designed and measured with SGD and
# momentum, and here the optimizer is AdamW, which rescales every entry by its own history
# (1/√v), a setting its error feedback was not shown in; local SGD and DiLoCo let the replicas
# drift apart for H steps and pay once for the whole model.
#
# ## 5. HSDP: shard inside a node, replicate across
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
if WHY is None and not QUICK:
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
# ## 6. Where each kind of parallelism sits
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
# tiers: the link's rate between nodes and, inside a node, the rate of section 3's all-reduce
# within a node; its estimate is the step inside plus what its communication terms say the
# link adds (its ring formulas in fp32; its pipeline term counts the m + p − 1 slots of the
# critical path). Both rankings of the layouts are checked against the measured one. The layouts'
# compute differs (TP splits each layer, DP the batch), so what tells where each belongs is the
# time the link **adds** to its step, not the ratio.

# %%
if WHY is None and not QUICK:
    # the planner's fast tier: section 3's all-reduce inside a node (2 ranks: S each way)
    node_Bps = ALLREDUCE_MIB * 2**20 / by_algo["within a node"].seconds
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
if WHY is None and not QUICK:
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
# ## 7. A node dies: the elastic restart
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
if WHY is None and not QUICK:
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

# %%
if WHY is None:
    per_link = [b / grads for b in crossing]
    ring = 2 * (WORLD - 1) / WORLD  # the ring's bytes per rank, in gradients (1.5 at N = 4)
    shares = [fit.counted / r.link_mbit / r.step_s for r in rows]
    rows_claims = [
        claim("DDP across nodes computes what it computes on one machine",
              "Li et al. 2020 (PyTorch DDP)",
              f"2 nodes × {WORLD // 2} rank(s) vs one machine, {STEPS} steps: largest loss "
              f"difference {loss_diff:.1e} (tolerance {LOSS_TOL:g})", loss_diff < LOSS_TOL),
        claim("each node's link carries 2(N−1)/N of the gradients per step, as a ring "
              "all-reduce sends", "Patarasuk & Yuan 2009",
              f"N = {WORLD}: each link sent {' and '.join(f'{x:.2f}' for x in per_link)}× the "
              f"gradient bytes per step ({ring:.2f}× by the ring's formula, TCP/IP headers on "
              "top; gloo picks its algorithm by message size)",
              all(abs(x / ring - 1) < 0.1 for x in per_link)),
        claim("over a slow link the step is compute plus bits / rate (α-β, β the link)",
              "Hockney 1994",
              f"fitted slope / counted bits per step = {fit.ratio:.2f} over "
              f"{', '.join(f'{r.link_mbit:g}' for r in rows)} Mbit/s; worst point "
              f"{max(abs(r.step_s / fit.predict(r.link_mbit) - 1) for r in rows):.0%} off",
              abs(fit.ratio - 1) < 0.15),
        claim("across nodes the network is the bottleneck (an interview answer)",
              "interview answer",
              f"transfer share of the step {min(shares):.0%} to {max(shares):.0%} over "
              f"{min(LINKS)}–{max(LINKS)} Mbit/s with a 0.82M-parameter model; it falls as the "
              "link gets faster or the compute per byte grows",
              min(shares) > 0.5),
    ]
    by = {r.name: r for r in race} if not QUICK else {}
    if by:
        topk = by["ddp, top-k 1%"]
        rows_claims.append(
            claim("gradient compression (top-k sparsification) speeds up training over a slow "
                  "network (an interview answer)", "Lin et al. 2018 (Deep Gradient Compression)",
                  f"top-k 1% reached DDP's half-way loss {target:.3f} at "
                  + ("never" if reach[topk.name] is None else f"{reach[topk.name]:.1f} s")
                  + f", DDP at {reach['ddp']:.1f} s; {topk.link_bytes / ddp_row.link_bytes:.3f}× "
                  "DDP's bytes per step",
                  reach[topk.name] is not None and reach[topk.name] < reach["ddp"]))
    if "DiLoCo, H=8" in by:
        diloco = by["DiLoCo, H=8"]
        H = slow_link_ways(on_nodes.cfg)["DiLoCo, H=8"].sync_every
        rows_claims += [
            claim("averaging every H steps sends H× fewer bytes than averaging every step",
                  "Douillard et al. 2023 (DiLoCo); Stich 2019 (local SGD)",
                  f"H = {H}: over steps 2–{len(diloco.losses)}, DDP averaged at each of "
                  f"{len(diloco.losses) - 1} steps, DiLoCo at {diloco.averages} (the last step "
                  f"averages too): DDP's link bytes / DiLoCo's = "
                  f"{ddp_row.link_bytes / diloco.link_bytes:.2f}, against "
                  f"{(len(diloco.losses) - 1) / diloco.averages:.2f} (within 5%)",
                  abs(ddp_row.link_bytes / diloco.link_bytes
                      / ((len(diloco.losses) - 1) / diloco.averages) - 1) < 0.05),
            claim("DiLoCo reaches the loss of synchronous training with far less communication",
                  "Douillard et al. 2023",
                  f"{len(diloco.losses)} steps, H = {H}: final loss {diloco.final_loss():.3f} "
                  f"against DDP's {ddp_row.final_loss():.3f} (within 5%)",
                  diloco.final_loss() <= 1.05 * ddp_row.final_loss()),
        ]
    if not QUICK:
        hsdp_ratios = {k: r["payload"] / r["formula"] for k, r in hsdp.items() if r["formula"]}
        full_shard = hsdp["FSDP2, over all ranks"]
        rows_claims += [
            claim("HSDP sends across nodes only the gradient shards' all-reduce: "
                  "g · 2(n−1)/n · shard bytes per node and step",
                  "Zhao et al. 2023 (PyTorch FSDP)",
                  "payload / formula: "
                  + ", ".join(f"{k} {v:.4f}" for k, v in hsdp_ratios.items()) + " (within 2%)",
                  all(abs(v - 1) <= 0.02 for v in hsdp_ratios.values())),
            claim("across a slow link, shard inside a node and replicate across (HSDP) rather "
                  "than shard over every rank", "Zhao et al. 2023 (PyTorch FSDP)",
                  f"FSDP2: HSDP's link payload "
                  f"{hsdp['FSDP2, HSDP']['payload'] / full_shard['payload']:.2f}× and step "
                  f"{hsdp['FSDP2, HSDP']['seconds'] / full_shard['seconds']:.2f}× "
                  "sharding over all 4 ranks'",
                  hsdp["FSDP2, HSDP"]["seconds"] < full_shard["seconds"]),
        ]
    if not QUICK:
        flat_over = {k: by_algo["flat ring"].seconds / by_algo[k].seconds
                     for k in ("hierarchical", "hierarchical, one flow")}
        modelled = [r for r in algos if r.modelled_s is not None]
        rows_claims += [
            claim("across nodes a hierarchical all-reduce beats the flat ring by what the link "
                  "bytes predict (1.5× at 2 nodes × 2 ranks; at least 1.3× asked)",
                  "Patarasuk & Yuan 2009; the link's bytes by formula",
                  f"{ALLREDUCE_MIB:g} MiB: " + ", ".join(f"{k} {v:.2f}× faster"
                                                          for k, v in flat_over.items()),
                  min(flat_over.values()) >= 1.3),
            claim("every all-reduce across the link takes what the two-tier α-β model says, "
                  "within 1.3×", "Hockney 1994; this notebook",
                  ", ".join(f"{r.name} {r.seconds / r.modelled_s:.2f}×" for r in modelled),
                  all(1 / 1.3 <= r.seconds / r.modelled_s <= 1.3 for r in modelled)),
        ]
        added = {r.name: r.added_s for r in places}
        worst_model = max(abs(r.across_s / r.predicted_s - 1) for r in places)
        rows_claims += [
            claim("tensor parallelism inside a node, pipeline and data parallelism across nodes "
                  "(an interview answer)", "Narayanan et al. 2021 (Megatron-LM), §3.3",
                  "2 ranks, one per node, against both in one node: the 100 Mbit/s link adds "
                  + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in added.items())
                  + " a step (holds when it adds most to TP and least to PP)",
                  max(added, key=added.get) == "TP"
                  and min(added, key=added.get).startswith("PP")),
            claim("at the same degrees, put tensor parallelism inside a node and data "
                  "parallelism across it rather than the reverse (an interview answer)",
                  "Narayanan et al. 2021 (Megatron-LM), §3.3",
                  "dp = tp = 2 on 2 nodes × 2 ranks, step across the link: "
                  + ", ".join(f"{r.name} {1e3 * r.across_s:.0f} ms (link {fmt_bytes(r.link_bytes)}"
                              f" a step, formula {fmt_bytes(r.formula_bytes)})" for r in orders),
                  orders[0].across_s < orders[1].across_s),
            claim("the α-β model, from the step inside a node and the bytes by formula, ranks "
                  "the layouts across the link as they measure", "Hockney 1994; this notebook",
                  f"measured {' < '.join(measured_order)}; modelled "
                  f"{' < '.join(modelled_order)}; worst step {worst_model:.0%} off the model",
                  measured_order == modelled_order),
            claim("the planner, given this machine's two tiers, ranks the layouts across the "
                  "link as they measure", "distlab.theory.plan (Narayanan et al. 2021's terms)",
                  "the link adds, measured / by the planner: "
                  + ", ".join(f"{r.name} {1e3 * r.added_s:.0f} / {1e3 * r.planner_added_s:.0f}"
                              " ms" for r in places)
                  + f"; planner's order {' < '.join(planner_order)}",
                  measured_order == planner_order),
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
    if "ddp-torch, PowerSGD r=2" in by:
        power = by["ddp-torch, PowerSGD r=2"]
        rows_claims.append(claim(
            "PowerSGD at rank 2 trains as well as uncompressed all-reduce",
            "Vogels et al. 2019 (measured there with SGD and momentum)",
            f"with AdamW, {len(power.losses)} steps: final loss {power.final_loss():.3f} "
            f"against DDP's {ddp_row.final_loss():.3f} (within 5%); "
            f"{power.link_bytes / ddp_row.link_bytes:.3f}× DDP's bytes per step",
            power.final_loss() <= 1.05 * ddp_row.final_loss()))
    claims_table(rows_claims)
    assert rows_claims[0]["holds"]


# %% [markdown]
# ## Try it
#
# The control panel has the nodes and the link as knobs (the link shows once there are two
# nodes): change the link's speed, the strategy or the world size and press **Run**; each run
# stays on the dashboard, with each node's link beside the ranks' bytes. Without root the
# runs go on this machine's loopback and the status line says so.

# %%
panel = lab.ControlPanel(strategy="ddp", world_size=4, nodes=2, link_mbit=100.0, steps=STEPS,
                         timeout_s=300)
panel
