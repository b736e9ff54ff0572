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
# **load-balancing loss**. The models trained now route differently: DeepSeek-V3 (2024)
# balances with a per-expert **bias** instead of a loss, Megatron-Core and torchtitan run
# **dropless** (no capacity), and DeepSeekMoE (Dai et al. 2024) adds **shared experts** and
# splits experts into many **fine-grained** ones. This notebook runs `distlab.models.moe` and
# `distlab.parallel.expert` on real ranks:
#
# 1. parameters against FLOPs per token as E grows (PyTorch's FLOP counter);
# 2. `ep` training the GPT with MoE blocks, against one process: Switch's routing and
#    DeepSeek's;
# 3. balance: Switch's loss at three coefficients, the bias, or nothing: MaxVio and the
#    language model's loss;
# 4. what the capacity factor trades, dropless beside it: dropped tokens, bytes, memory, and
#    their worst step;
# 5. the all-to-all's bytes against the formula;
# 6. shared and fine-grained experts: parameters, active parameters and FLOPs per token;
# 7. a widget to change the routing and train again, the load drawn live;
# 8. the closing table: what the papers say, what this run measured.

# %% tags=["parameters"]
import os

# CI sets WORKBOOK_QUICK=1: fewer steps and capacity factors, about a minute.
QUICK = os.environ.get("WORKBOOK_QUICK", "0") == "1"
# training steps of the equivalence run (ep against one process: routing is discrete, so a
# tie broken differently by a float32 ulp would show; 12 steps measured 4x under tolerance)
STEPS = 6 if QUICK else 12
LOAD_STEPS = 20 if QUICK else 40           # the capacity runs' steps
CFS = (0.5, 1.25) if QUICK else (0.5, 1.0, 1.25, 2.0)  # capacity factors of section 4
# section 3: steps and seeds of the balance runs (each seed one launch of 6 runs; 200 steps:
# MaxVio settles after about 100, measured)
BALANCE_STEPS = 30 if QUICK else 200
SEEDS = (0,) if QUICK else (0, 1, 2)
# Switch's coefficient: 1e-2 is the paper's, a decade either side (quick mode: the paper's)
COEFS = (1e-2,) if QUICK else (1e-3, 1e-2, 1e-1)
RATE = 1e-3  # the bias's rate: DeepSeek-V3's (§2.1.2)
RATES = (RATE,) if QUICK else (RATE, 10 * RATE)  # and ten times it
ATOL = 1e-5  # fp32, ep against one process (tests/test_expert_parallel.py)
E, N = 4, 2   # experts, ranks

# %%
from distlab import RunConfig
from distlab.lab.common import claim, claims_table, fmt_bytes, say, table
from distlab.lab.expert_routing import balance_figure, balance_study, traffic_study
from distlab.lab.experts import (
    ExpertsExplorer,
    capacity_figure,
    dispatch_bytes,
    dropped_fraction,
    flops_per_token,
    layouts_table,
)
from distlab.lab.runs import launch_together, worst_param_diff
from distlab.theory.context_and_experts import (
    ep_dispatch_bytes,
    fine_grained,
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
#
# Two routers. **Switch's**: top-1 of 4 experts, capacity factor 1.25, the balance loss.
# **DeepSeek's**: dropless, top-2 of 8 narrow experts (width 16 against the MLP's 64) and one
# shared expert, balanced by the bias alone (rate 1e-3, no loss); the bias moves after every
# step on the loads summed over the ranks, so both ranks move it alike, as one process does.

# %%
BASE = RunConfig(steps=STEPS, optimizer="sgd", lr=0.1, global_batch=8, seq_len=16, n_layer=2,
                 n_embd=32, n_head=2, mlp_ratio=2, n_experts=E, timeout_s=120)
DEEPSEEK = BASE.replace(n_experts=8, top_k=2, expert_hidden=16, n_shared_experts=1,
                        capacity_factor=0.0, aux_loss_coef=0.0, expert_bias_rate=RATE)
EP = BASE.replace(strategy="ep", world_size=N)
singles = launch_together({"switch": BASE.replace(moe_groups=N),
                           "deepseek": DEEPSEEK.replace(moe_groups=N)}, name="moe-single")
eps = launch_together({"switch": EP, "deepseek": DEEPSEEK.replace(strategy="ep", world_size=N)},
                      name="ep")
ep_run = eps["switch"]
ep_diffs = {name: max(worst_param_diff(s, singles[name].states[0]) for s in eps[name].states)
            for name in eps}
ep_diff = ep_diffs["switch"]
ds_dropped = dropped_fraction(eps["deepseek"])
table(["router", f"worst parameter difference after {STEPS} SGD steps", "choices dropped"],
      [[n, f"{d:.1e} (tolerance {ATOL:g})", f"{100 * dropped_fraction(eps[n]):.1f}%"]
       for n, d in ep_diffs.items()])
per_rank = moe_layer_per_rank(32, 64, E, N)["params_per_rank"]
say(f"each rank holds {E // N} of the {E} experts of each block: "
    f"{per_rank:,} of the MoE layer's {moe_params(32, 64, E)['total']:,} parameters.")
assert max(ep_diffs.values()) <= ATOL and ds_dropped == 0

# %% [markdown]
# ## 3. Balance: Switch's loss, the bias, or nothing
#
# Switch's auxiliary loss, E x Σ_i f_i P_i (f_i the fraction of tokens routed to expert i,
# P_i its mean router probability), is 1 for an even router and grows as the router favours
# a few experts; its gradient pushes the router towards balance, and away from what the
# language model alone would learn. DeepSeek-V3's **auxiliary-loss-free** balance (Wang et al.
# 2024) adds a bias b_i to the scores that *choose* the experts, never to the gates that weigh
# them, and after every step moves it against the load: b_i += u · sign(mean load − load_i).
# No gradient, so the loss is the language model's alone.
#
# Six runs per seed, the same data and steps (AdamW, lr 3e-3, top-1, dropless so that no
# dropped token hides the load): no balancing, Switch's loss at 1e-3, 1e-2 (the paper's) and
# 1e-1, the bias at DeepSeek-V3's rate 1e-3, and at 1e-2 (ten times it). The load is
# **MaxVio** (Wang et al. 2024): the busiest expert's tokens over the mean, minus 1, per step,
# summed over the ranks, averaged over the blocks; the table shows its mean over the second
# half of the run. The quality is the **language-model loss** (the cross-entropy: the logged
# loss minus the balance term each Switch run added), its mean over the last quarter. The
# seeds are the repeats: each seed is another initialisation and data stream.

# %%
DRIFT = EP.replace(lr=3e-3, optimizer="adamw", steps=BALANCE_STEPS)
study = balance_study(DRIFT, SEEDS, COEFS, RATES)
balance_figure(study.runs[SEEDS[0]]).show()
study.table()
BIAS = f"bias {RATE:g}"
lm_cost = study.lm_cost(BIAS)
say(f"Switch's best-balancing coefficient per seed: "
    f"{', '.join(f'seed {s}: {study.best_switch(s)}' for s in SEEDS)}. Its LM loss minus "
    f"the bias's: {', '.join(f'{v:+.4f}' for v in lm_cost)} (positive: the loss term cost "
    "quality).")

# %% [markdown]
# ## 4. What the capacity factor trades
#
# Capacity per expert = ⌈capacity factor x tokens x k / E⌉ (Switch, §2.2; `expert_capacity`).
# Below 1 some tokens must be dropped even with a perfect router; above 1 the slack absorbs
# an uneven one, and every kept token is a row sent to its expert and back, and activations
# the experts keep for backward. Same runs, four capacity factors: the fraction of choices
# dropped, the bytes the dispatch sent, and the bytes each rank's step saved for backward.

#
# **Dropless** (capacity factor 0 here) sends every choice to its expert: nothing dropped, but
# nothing bounds an expert's batch either. A capacity is what gives a dispatch its **static
# shapes**: whatever the router does, at most C rows reach each expert of a group, so a step's
# bytes and buffers have a ceiling known before it runs (GShard's and Switch's fixed-size
# dispatch relies on it). Beside each run's mean, its **worst step** over the run, and the
# ceiling each rule allows (`dispatch_bound`: C rows to each remote expert, or, dropless,
# every choice to a remote one).

# %%
traffic = traffic_study(EP, CFS, LOAD_STEPS)
traffic.table()
cap_rows = traffic.capacity_rows()
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
tokens = EP.micro_batch * EP.seq_len  # per rank per forward
even = ep_dispatch_bytes(tokens, 32, N)["forward"] // 2 * EP.n_layer
measured_dispatch = dispatch_bytes(traffic.runs[f"cf {max(CFS)}"])
say(f"dispatch per rank per step, {EP.n_layer} blocks: even routing {fmt_bytes(even)} "
    f"(formula); measured at capacity factor {max(CFS)} {fmt_bytes(measured_dispatch)} "
    f"({measured_dispatch / even:.2f}x).")

# %% [markdown]
# ## 6. Shared and fine-grained experts
#
# DeepSeekMoE (Dai et al. 2024) splits each expert into m narrower ones and routes each token
# to m times as many: the weights in all and per token stay, the choices a token can make
# grow from C(E, k) to C(mE, mk). Its **shared** experts take every token besides its routed
# ones (common knowledge in one place, not copied into every expert). Parameters (the
# module's, against `moe_params`), the parameters a token meets (`moe_active`: the router, k
# routed experts, the shared ones) and forward FLOPs per token counted by PyTorch's
# `FlopCounterMode` while the layer runs, against `moe_active`'s two per weight. Width 64;
# the MLP it replaces would be 256 wide.

# %%
fg = fine_grained(d, hid, 4, 1, m=4)
layouts = {"Switch: 4 experts of 256, top-1": (4, 1, 0, hid),
           f"fine-grained: {fg['n_experts']} of {fg['hidden']}, top-{fg['top_k']}":
               (fg["n_experts"], fg["top_k"], 0, fg["hidden"]),
           "DeepSeekMoE: 15 of 64, top-3, 1 shared": (15, 3, 1, fg["hidden"])}
fg_flops = layouts_table(d, layouts)

# %% [markdown]
# The three layers do nearly the same work per token: the fine-grained layers' extra FLOPs are
# their larger routers (d·E). What segmentation buys is choice: 4 ways to route a token become
# 1,820.

# %% [markdown]
# ## 7. Change the routing and train again
#
# Pick top-k, the capacity factor (or dropless), the balancing (Switch's loss, the bias, or
# none) and a shared expert, and press **Run**: the MoE GPT trains under `ep` on 2 ranks, and
# the bars (the tokens each expert got at the last step, stacked by the rank that sent them)
# are redrawn live as the steps come in. The cell runs it once itself, with DeepSeek's
# routing; the live dashboard (`distlab.lab.watch`) shows the same bars for any `ep` run.

# %%
explorer = ExpertsExplorer(EP)
res = explorer.run(top_k=2, capacity_factor=0.0, balance="bias (1e-3, no loss)",
                   n_shared_experts=1)
assert res["run"].status == "done"
explorer.widget

# %% [markdown]
# ## What the papers say, what this run measured
#
# Every figure comes from this run's variables, every verdict is computed from them (a row
# can read **no**).

# %%
drops = {r["capacity_factor"]: r["dropped"] for r in cap_rows}
vio = {n: study.max_vio(n) for n in study.names}
best_vio = [study.rows[s][study.best_switch(s)]["max_vio"] for s in SEEDS]
dropless, capped = traffic.rows["dropless"], traffic.rows["cf 1.25"]
rows = [
    claim("an MoE's parameters grow with E while its FLOPs per token do not",
          "Fedus et al. 2021 (Switch Transformer)",
          f"2 -> 16 experts: parameters {params_growth:.1f}x, measured FLOPs per token "
          f"{flops_growth:.2f}x (the router's d·E)", params_growth > 7 and flops_growth < 1.2),
    claim("expert parallelism computes what one process computes", "GShard (Lepikhin et al. "
          "2020): the same groups, the same capacity",
          f"ep on {N} ranks vs one process with {N} groups: {ep_diff:.1e} after {STEPS} steps "
          f"(tolerance {ATOL:g})", ep_diff <= ATOL),
    claim("dropless routing, the bias and shared experts under ep compute what one process "
          "computes, dropping no token", "DeepSeek-V3 (2024), §2.1.2; Megatron-Core's dropless "
          "MoE", f"top-2 of 8, 1 shared, bias 1e-3: {ep_diffs['deepseek']:.1e} after {STEPS} "
          f"steps (tolerance {ATOL:g}); {100 * ds_dropped:.1f}% dropped",
          ep_diffs["deepseek"] <= ATOL and ds_dropped == 0),
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
          f"MaxVio, second half of {BALANCE_STEPS} steps, per seed: Switch 0.01 "
          f"{', '.join(f'{v:.3f}' for v in vio['Switch 0.01'])}, none "
          f"{', '.join(f'{v:.3f}' for v in vio['none'])} (yes: at least 10% lower in every "
          "seed)", all(a <= 0.9 * b for a, b in zip(vio["Switch 0.01"], vio["none"]))),
    claim("the bias alone balances as well as the auxiliary loss at its best coefficient",
          "Wang et al. 2024; DeepSeek-V3 (2024), §2.1.2",
          f"MaxVio per seed: bias {RATE:g} {', '.join(f'{v:.3f}' for v in vio[BIAS])}; "
          f"Switch's best of {', '.join(f'{c:g}' for c in COEFS)}: "
          f"{', '.join(f'{v:.3f}' for v in best_vio)} "
          "(yes: at or below it in every seed)",
          all(b <= s_ for b, s_ in zip(vio[BIAS], best_vio))),
    claim("the auxiliary loss costs language-model quality that the bias does not",
          "Wang et al. 2024 (its gradient interferes with the LM's); Megatron-Bridge #947: "
          "loss 2.45 -> 2.56", f"LM loss, Switch's best-balancing run minus the bias's, per "
          f"seed: {', '.join(f'{v:+.4f}' for v in lm_cost)} (yes: higher in every "
          "seed)", all(v > 0 for v in lm_cost)),
    claim("dropless drops no token, and its worst step sends more than a capacity of 1.25 "
          "allows (what static shapes buy)", "Megatron-Core and torchtitan's dropless MoE; "
          "GShard's fixed-size dispatch", f"dropless: {100 * dropless['dropped']:.1f}% dropped, "
          f"worst dispatch {fmt_bytes(dropless['sent_max'])} per rank per step; capacity 1.25's "
          f"ceiling {fmt_bytes(traffic.bound('cf 1.25'))}, its worst step "
          f"{fmt_bytes(capped['sent_max'])}",
          dropless["dropped"] == 0
          and capped["sent_max"] <= traffic.bound("cf 1.25") < dropless["sent_max"]),
    claim("fine-grained and shared experts keep the FLOPs per token", "Dai et al. 2024 "
          "(DeepSeekMoE)", "measured forward FLOPs per token: " + ", ".join(
              f"{f:,.0f}" for f in fg_flops) + " (yes: within 10% of the first)",
          all(abs(f / fg_flops[0] - 1) <= 0.1 for f in fg_flops)),
]
claims_table(rows)
