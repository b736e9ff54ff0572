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
# # 15 · Experts: mixture of experts and expert parallelism
#
# "How does an MoE model place its experts?" A **mixture of experts** (MoE) replaces a block's
# MLP by E expert MLPs and a **router** that sends each token to k of them (Switch Transformer,
# Fedus et al. 2021: k = 1; GShard, Lepikhin et al. 2020: k = 2). The parameters grow with E;
# the work per token does not (each token meets k experts). **Expert parallelism** (ep) puts
# E/N experts on each of N ranks: every rank routes its own tokens, sends each token's row to
# its expert's rank with an **all-to-all** (dispatch), and gets the outputs back with a
# second one (combine).
#
# Two things make it hard in practice, both measured below: an expert can only take so many
# tokens (its **capacity**: tokens over it are **dropped** and ride the residual connection
# unchanged), and a router left alone sends most tokens to a few experts, so Switch adds a
# **load-balancing loss**. This notebook runs `distlab.models.moe` and
# `distlab.parallel.expert` on real ranks:
#
# 1. parameters against FLOPs per token as E grows (PyTorch's FLOP counter);
# 2. `ep` training the GPT with MoE blocks, against one process;
# 3. the load per expert, step by step, with the balance loss on and off;
# 4. what the capacity factor trades: dropped tokens against bytes sent;
# 5. the all-to-all's bytes against the formula;
# 6. a widget to change top-k, the capacity factor and the balance loss and train again;
# 7. the closing table: what the papers say, what this run measured.

# %% tags=["parameters"]
import os

# CI sets WORKBOOK_QUICK=1: fewer steps and capacity factors, about a minute.
QUICK = os.environ.get("WORKBOOK_QUICK", "0") == "1"
# training steps of the equivalence run (ep against one process: routing is discrete, so a
# tie broken differently by a float32 ulp would show; 12 steps measured 4x under tolerance)
STEPS = 6 if QUICK else 12
LOAD_STEPS = 20 if QUICK else 40           # the capacity runs' steps
CFS = (0.5, 1.25) if QUICK else (0.5, 1.0, 1.25, 2.0)  # capacity factors of section 4
ATOL = 1e-5  # fp32, ep against one process (tests/test_expert_parallel.py)
E, N = 4, 2   # experts, ranks

# %%
from distlab import RunConfig
from distlab.lab.common import claim, claims_table, fmt_bytes, say, table
from distlab.lab.experts import (
    ExpertsExplorer,
    activation_bytes,
    capacity_figure,
    dispatch_bytes,
    dropped_fraction,
    expert_load,
    flops_per_token,
    imbalance,
    load_figure,
)
from distlab.lab.runs import launch_together, worst_param_diff
from distlab.theory.context_and_experts import (
    ep_dispatch_bytes,
    expert_capacity,
    moe_layer_per_rank,
    moe_params,
)

# %% [markdown]
# ## 1. More experts, the same work per token
#
# One MoE layer (width 64, expert width 256) in one process: its parameters by formula
# (`moe_params`, checked against the module in the tests) and its forward FLOPs per token
# counted by PyTorch's `FlopCounterMode` while it runs, as E grows, top-1.

# %%
d, hid = 64, 256
flop_rows = {e: (moe_params(d, hid, e)["total"], flops_per_token(d, hid, e, 1))
             for e in (2, 4, 8, 16)}
table(["experts E", "parameters", "forward FLOPs per token (measured)",
       "modelled: 2 x (router + one expert's weights)"],
      [[e, f"{p:,}", f"{f:,.0f}", f"{2 * (d * e + 2 * d * hid):,}"]
       for e, (p, f) in flop_rows.items()])
params_growth = flop_rows[16][0] / flop_rows[2][0]
flops_growth = flop_rows[16][1] / flop_rows[2][1]

# %% [markdown]
# The parameters grow 8x from 2 to 16 experts; the FLOPs per token grow only by the router's
# d·E (the measured counts match the model: two FLOPs per weight a token meets). That is the
# MoE bargain: capacity to learn scales with E, the step's arithmetic with k.

# %% [markdown]
# ## 2. `ep` against one process
#
# The GPT with a MoE in every block (RunConfig.n_experts), trained under `ep` on 2 ranks: each
# rank takes its rows of the global batch and holds E/N experts of every block. The reference
# is one process on the whole batch with `moe_groups=2`: GShard's groups, each group's tokens
# routed with their own capacity and balance loss, exactly as each rank routes its own.

# %%
BASE = RunConfig(steps=STEPS, optimizer="sgd", lr=0.1, global_batch=8, seq_len=16, n_layer=2,
                 n_embd=32, n_head=2, mlp_ratio=2, n_experts=E, timeout_s=120)
EP = BASE.replace(strategy="ep", world_size=N)
single = launch_together({"single": BASE.replace(moe_groups=N)}, name="moe-single")["single"]
ep_run = launch_together({"ep": EP}, name="ep")["ep"]
ep_diff = max(worst_param_diff(s, single.states[0]) for s in ep_run.states)
say(f"ep on {N} ranks against one process after {STEPS} SGD steps: worst parameter "
    f"difference {ep_diff:.1e} (tolerance {ATOL:g}).")
per_rank = moe_layer_per_rank(32, 64, E, N)["params_per_rank"]
say(f"each rank holds {E // N} of the {E} experts of each block: "
    f"{per_rank:,} of the MoE layer's {moe_params(32, 64, E)['total']:,} parameters.")
assert ep_diff <= ATOL

# %% [markdown]
# ## 3. The load per expert, with and without the balance loss
#
# Switch's auxiliary loss, E x Σ_i f_i P_i (f_i the fraction of tokens routed to expert i,
# P_i its mean router probability), is 1 for an even router and grows as the router favours
# a few experts. Two runs of 40 AdamW steps (lr 3e-3, capacity factor 2 so that drops do not
# hide the routing), the balance loss on (coefficient 0.01, Switch's) and off; the line is the
# busiest expert's tokens over the mean, block 0, summed over the ranks. Whether the loss
# evens the load on this small model is what the run says, not the paper.

# %%
DRIFT = EP.replace(lr=3e-3, optimizer="adamw", capacity_factor=2.0, steps=40)
balance = launch_together({"balance loss on": DRIFT,
                           "balance loss off": DRIFT.replace(aux_loss_coef=0.0)},
                          name="ep-balance")
load_figure(balance).show()
late = {name: sum(imbalance(l_) for l_ in expert_load(run)[-5:]) / 5
        for name, run in balance.items()}
table(["run", "busiest / mean, last 5 steps", "final loss"],
      [[n, f"{late[n]:.2f}", f"{run.losses()[-1]:.3f}"] for n, run in balance.items()])

# %% [markdown]
# ## 4. What the capacity factor trades
#
# Capacity per expert = ⌈capacity factor x tokens x k / E⌉ (Switch, §2.2; `expert_capacity`).
# Below 1 some tokens must be dropped even with a perfect router; above 1 the slack absorbs
# an uneven one, and every kept token is a row sent to its expert and back, and activations
# the experts keep for backward. Same runs, four capacity factors: the fraction of choices
# dropped, the bytes the dispatch sent, and the bytes each rank's step saved for backward.

# %%
cap_runs = launch_together({f"cf {cf}": EP.replace(capacity_factor=cf, steps=LOAD_STEPS)
                            for cf in CFS},
                           name="ep-capacity")
tokens = EP.micro_batch * EP.seq_len  # per rank per forward
cap_rows = [{"capacity_factor": cf, "capacity": expert_capacity(tokens, E, cf),
             "dropped": dropped_fraction(run), "dispatch_bytes": dispatch_bytes(run),
             "activations": activation_bytes(run)}
            for cf, run in zip(CFS, cap_runs.values())]
table(["capacity factor", f"capacity per expert ({tokens} tokens, {E} experts)",
       "choices dropped", "dispatch sent per rank per step", "activations per rank (measured)"],
      [[r["capacity_factor"], r["capacity"], f"{100 * r['dropped']:.1f}%",
        fmt_bytes(r["dispatch_bytes"]), fmt_bytes(r["activations"])] for r in cap_rows])
capacity_figure(cap_rows).show()

# %% [markdown]
# ## 5. The all-to-all's bytes
#
# With every token routed evenly and none dropped, each rank's dispatch sends (N-1)/N of its
# tokens x k rows of width h (`ep_dispatch_bytes`), per block and per step: the formula below.
# A real router is not even: the rows a rank sends are the ones whose experts live elsewhere,
# so the measured figure scatters around it (the tests check the exact rows on a router made
# even by hand, `tests/test_expert_parallel.py`).

# %%
even = ep_dispatch_bytes(tokens, 32, N)["forward"] // 2 * EP.n_layer
measured_dispatch = dispatch_bytes(cap_runs[f"cf {max(CFS)}"])
say(f"dispatch per rank per step, {EP.n_layer} blocks: even routing {fmt_bytes(even)} "
    f"(formula); measured at capacity factor {max(CFS)} {fmt_bytes(measured_dispatch)} "
    f"({measured_dispatch / even:.2f}x).")

# %% [markdown]
# ## 6. Change the routing and train again
#
# Pick top-k, the capacity factor and whether the balance loss is on, and press **Run**: the
# MoE GPT trains under `ep` on 2 ranks, and the bars (the tokens each expert got at the last
# step, stacked by the rank that sent them) are redrawn live as the steps come in. The cell
# runs it once itself.

# %%
explorer = ExpertsExplorer(EP)
res = explorer.run(top_k=2, capacity_factor=1.25, aux_loss_coef=0.01)
assert res["run"].status == "done"
explorer.widget

# %% [markdown]
# ## What the papers say, what this run measured
#
# Every figure comes from this run's variables, every verdict is computed from them (a row
# can read **no**).

# %%
drops = {r["capacity_factor"]: r["dropped"] for r in cap_rows}
rows = [
    claim("an MoE's parameters grow with E while its FLOPs per token do not",
          "Fedus et al. 2021 (Switch Transformer)",
          f"2 -> 16 experts: parameters {params_growth:.1f}x, measured FLOPs per token "
          f"{flops_growth:.2f}x (the router's d·E)", params_growth > 7 and flops_growth < 1.2),
    claim("expert parallelism computes what one process computes", "GShard (Lepikhin et al. "
          "2020): the same groups, the same capacity",
          f"ep on {N} ranks vs one process with {N} groups: {ep_diff:.1e} after {STEPS} steps "
          f"(tolerance {ATOL:g})", ep_diff <= ATOL),
    claim("a capacity factor below 1 drops tokens; a larger one drops fewer",
          "Fedus et al. 2021, §2.2",
          ", ".join(f"cf {cf}: {100 * d_:.1f}% dropped" for cf, d_ in drops.items()),
          drops[min(CFS)] > 0 and all(drops[a] >= drops[b] for a, b in zip(CFS, CFS[1:]))),
    claim("more capacity costs memory: the experts keep more activations", "Fedus et al. "
          "2021, §2.2",
          ", ".join(f"cf {r['capacity_factor']}: {fmt_bytes(r['activations'])}"
                    for r in cap_rows) + " saved for backward per rank per step",
          all(a["activations"] <= b["activations"] for a, b in zip(cap_rows, cap_rows[1:]))),
    claim("more capacity sends more rows through the all-to-all", "Fedus et al. 2021, §2.2",
          ", ".join(f"cf {r['capacity_factor']}: {fmt_bytes(r['dispatch_bytes'])}"
                    for r in cap_rows) + " dispatched per rank per step",
          all(a["dispatch_bytes"] <= b["dispatch_bytes"] for a, b in zip(cap_rows,
                                                                           cap_rows[1:]))),
    claim("the load-balancing loss evens the load across experts", "Fedus et al. 2021, §2.2",
          f"busiest / mean over the last 5 steps: on {late['balance loss on']:.2f}, off "
          f"{late['balance loss off']:.2f} (yes: at least 10% lower with it)",
          late["balance loss on"] <= 0.9 * late["balance loss off"]),
]
claims_table(rows)
