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
# 5. the closing table: what the textbook says, what this run measured;
# 6. a control panel with the nodes and the link as knobs, to try other layouts.
#
# [18 · Across nodes](18_across_nodes.ipynb) goes on over the same simulated nodes: HSDP,
# where each kind of parallelism sits, and a node that dies mid-run.

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
LINKS = (100, 400) if QUICK else (25, 100, 400)
SWEEP_STEPS = 6 if QUICK else 10
WARMUP = 2
# Sections 3 and 4 start clusters of their own (each agent and rank imports torch: seconds of
# CPU apiece), so CI's quick run leaves them out; the test suite runs their code
# (tests/test_hierarchical.py, test_diloco.py, test_cluster.py).
# Section 3: the size of the all-reduce the algorithms race (MiB), and how many times each
# runs (the algorithms take turns in every repeat). 4 MiB 12 times costs what 8 MiB 6 times
# did (30 s) and decides its rows on twice the repeats: at 8 MiB × 6 the two-flow variant's
# lower quartile sat on the 1.3× bar in one full run (1.20 / 1.34 / 1.46×) and over it in the
# next (1.36 / 1.39 / 1.54×); 4 MiB × 12 read 1.24 / 1.42 / 1.48× (lower quartile 1.35×)
ALLREDUCE_MIB, ALLREDUCE_REPEATS = 4.0, 12
# Section 4: the ways raced against section 1's DDP run (same model, batches, link and steps)
RACE = ("ddp, top-k 1%", "ddp-torch, PowerSGD r=2", "local SGD, H=8", "DiLoCo, H=8")
# ddp's gradients are summed by gloo in an order that depends on the ranks' layout: the same
# four gradients may round differently in fp32's last bit across nodes; tests measure < 1e-5
LOSS_TOL = 1e-5

# %%
from distlab import RunConfig, lab, launch
from distlab.caller import cluster
from distlab.lab.common import claim, claims_table, fmt_bytes, say, table
from distlab.lab.multi_node import (fit_link, link_figure, link_sweep, race_figure,
                                    race_target, reach_samples, reach_time, slope_ratios,
                                    slow_link_race, slow_link_ways, transfer_shares,
                                    two_tier_figure, two_tier_study)
from distlab.lab.timed import all_of, below, ratios, timed_claim, within

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
    algos = two_tier_study(nodes=2, ranks=2, link_mbit=LINK, mib=ALLREDUCE_MIB,
                           repeats=ALLREDUCE_REPEATS)
    two_tier_figure(algos, ALLREDUCE_MIB, LINK).show()
    table(["algorithm", f"seconds (median of {ALLREDUCE_REPEATS})", "node 0's link per all-reduce", "formula",
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

# %% [markdown]
# ## What the textbook says, what this run measured
#
# Rows that read a clock have the basis **timed**: each is decided over repeats (each step after
# the warm-up is one; in section 3 each all-reduce, the algorithms taking turns) and shows the
# min / median / max. It reads yes or no only when the middle halves of the spreads decide it,
# else "undecided on this machine". Load from other programs on this machine stretches some
# steps and not others: the spreads widen and a verdict can turn undecided; a second run on a
# quiet machine decides it again. The byte and loss rows do not depend on the load.

# %%
if WHY is None:
    per_link = [b / grads for b in crossing]
    ring = 2 * (WORLD - 1) / WORLD  # the ring's bytes per rank, in gradients (1.5 at N = 4)
    # timed rows (distlab.lab.timed): each step after warm-up is a repeat, and a verdict is
    # yes or no only when the middle halves of the spreads decide it
    slope_q = slope_ratios(rows, fit)
    share_q = {f"{r.link_mbit:g} Mbit/s": transfer_shares(r, fit) for r in rows}
    # decided where the link is section 1's or slower; faster links are shown, not judged: the
    # share falls as the link speeds up, and where it crosses 50% depends on the compute
    judged = [q for r, q in zip(rows, share_q.values()) if r.link_mbit <= LINK]
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
        timed_claim("over a slow link the step is compute plus bits / rate (α-β, β the link)",
                    "Hockney 1994", within(slope_q, 0.85, 1.15),
                    {"fitted slope / counted bits, one fit per step": slope_q}, scale=1, unit="",
                    digits=3, interleaved_=False,
                    note=f"over {', '.join(f'{r.link_mbit:g}' for r in rows)} Mbit/s (within "
                         f"15%); the medians' fit {fit.ratio:.2f}, its worst point "
                         f"{max(abs(r.step_s / fit.predict(r.link_mbit) - 1) for r in rows):.0%}"
                         " off"),
        timed_claim("across nodes the network is the bottleneck (an interview answer)",
                    "interview answer", all_of(*(within(q, lo=0.5) for q in judged)),
                    share_q, scale=100, unit="%", digits=2, interleaved_=False,
                    note=f"the transfer's share of each step, judged over 50% at {LINK:g} Mbit/s "
                         "and slower, with a 0.82M-parameter model; it falls as the link gets "
                         "faster or the compute per byte grows"),
    ]
    by = {r.name: r for r in race} if not QUICK else {}
    if by:
        topk = by["ddp, top-k 1%"]
        topk_q, ddp_q = reach_samples(topk, target, WARMUP), reach_samples(ddp_row, target, WARMUP)
        compression = ("gradient compression (top-k sparsification) speeds up training over a "
                       "slow network (an interview answer)", "Lin et al. 2018 (Deep Gradient "
                       "Compression)")
        note = (f"DDP's half-way loss {target:.3f}, reached by (steps it took) × (each step's "
                f"seconds); measured at {reach['ddp']:.1f} s (DDP) and "
                + ("never" if reach[topk.name] is None else f"{reach[topk.name]:.1f} s")
                + f" (top-k); top-k sends {topk.link_bytes / ddp_row.link_bytes:.3f}× DDP's "
                "bytes per step")
        rows_claims.append(
            claim(*compression, f"top-k 1% never reached it; {note}", False, basis="timed")
            if topk_q is None else
            timed_claim(*compression, below(topk_q, ddp_q), {"top-k 1%": topk_q, "DDP": ddp_q},
                        scale=1, unit="s", interleaved_=False, note=note))
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
        # the algorithms take turns within each repeat: flat / hierarchical pairs one turn's
        flat_over = {f"flat / {k}": ratios(by_algo["flat ring"].samples, by_algo[k].samples)
                     for k in ("hierarchical", "hierarchical, one flow")}
        over_model = {r.name: [x / r.modelled_s for x in r.samples]
                      for r in algos if r.modelled_s is not None}
        rows_claims += [
            timed_claim("across nodes a hierarchical all-reduce beats the flat ring by what the "
                        "link bytes predict (1.5× at 2 nodes × 2 ranks; at least 1.3× asked)",
                        "Patarasuk & Yuan 2009; the link's bytes by formula",
                        all_of(*(within(q, lo=1.3) for q in flat_over.values())), flat_over,
                        scale=1, unit="×", interleaved_=True,
                        note=f"{ALLREDUCE_MIB:g} MiB, the flat ring's time over each "
                             "hierarchical one's in the same repeat"),
            timed_claim("every all-reduce across the link takes what the two-tier α-β model "
                        "says, within 1.3×", "Hockney 1994; this notebook",
                        all_of(*(within(q, 1 / 1.3, 1.3) for q in over_model.values())),
                        over_model, scale=1, unit="×", interleaved_=True,
                        note="measured / modelled, each repeat"),
        ]
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
