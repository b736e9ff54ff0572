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
# # 13 · Searching and timing: hyper-parameters, architectures, time to train, Horovod
#
# The questions around a training job rather than inside it: which learning rate, warm-up,
# batch size and weight decay (and how many runs it takes to find them), which shape of model
# for a budget, how long the job will take, and what Horovod was. Every trial here is a real
# distlab run, and every figure comes from this notebook's runs or from a formula whose
# source is named:
#
# 1. **hyper-parameter search** with Optuna: grid, random and Bayesian (TPE and a Gaussian
#    process) on the same budget of trials, the best loss against trials spent; bad trials
#    stopped early by a pruner reading the live run's losses, and the compute it saved;
# 2. **architecture search**: depth, width, heads and MLP ratio under a parameter budget from
#    the estimator, random against multi-objective search (NSGA-II), the Pareto front of loss
#    against size;
# 3. **time to train**: the FLOPs of a step counted by PyTorch against 6·N·D, the step's MFU,
#    throughput and scaling efficiency at 1, 2 and 4 ranks, the recipe "time per step ×
#    steps" checked on a real run, and applied to GPT-3's scale with its error bars;
# 4. **Horovod**: what it is, how it maps onto DDP and distlab, and whether it installs here.
#
# Each part ends with a table of textbook claims against this run's figures.

# %% [markdown]
# ## Hyper-parameter and architecture search
#
# A training run has knobs nobody can derive: the learning rate, the warm-up, the batch size,
# the weight decay, and the model's own shape. Search tries settings and keeps the best. Every
# trial below is a **real distlab run** (`launch(RunConfig(...))` of the tiny GPT on one
# rank); its objective is the **held-out loss** it measured at its end (64 rows no training
# step reads). Every trial starts from the same seed, so a setting's loss is the same number
# every time, and every study is seeded: the verdicts below are this machine's, reproducibly.
#
# Four ways to choose the next trial (Optuna's samplers, `distlab.lab.search.sampler`):
#
# * **grid**: every combination of a few values per parameter. Simple, and wasteful when only
#   some parameters matter: a 3 x 3 grid spends 9 trials on just 3 values of each.
# * **random**: independent draws. Bergstra & Bengio (2012): with the same budget, random search
#   tries a new value of *every* parameter in every trial, so it explores the parameters that
#   matter more finely than a grid does.
# * **TPE** (Bergstra et al. 2011): splits the trials so far into good and bad, fits a density
#   to each, and samples where good/bad is largest. Cheap, handles integers and categories.
# * **GP** (Snoek et al. 2012): a Gaussian-process posterior of the loss over the space; the
#   next trial maximises expected improvement. Better models per trial, more time per proposal.
#
# TPE and GP begin with the same 4 seeded random trials as random search (2 in quick mode:
# their startup draws are the random sampler's), so the curves below share their start and
# part where the model takes over. The space: learning rate (1e-4 to 1e-1, log), warm-up (0 to
# 16 steps), global batch (8, 16, 32) and AdamW weight decay (0 to 0.1). Each trial reads the
# same number of training rows, so a larger batch means fewer steps: the search has a real
# trade-off to find.

# %%
import math
import os
import statistics

import optuna

from distlab.units import MiB
from distlab.lab import arch_search, hp_search, search
from distlab.lab import search_figures as figs
from distlab.lab.common import claim, claims_table, say, table
from distlab.lab.timed import all_of, fmt_spread, timed_claim, within

# %% tags=["parameters"]
QUICK = os.environ.get("WORKBOOK_QUICK", "0") == "1"
ROWS = 96 if QUICK else 320  # training rows per trial (steps = ROWS // global_batch)
REPORT_ROWS = 32 if QUICK else 64  # pruning: the live loss is reported every REPORT_ROWS rows
N_METHOD = 4 if QUICK else 16  # trials per method
N_STARTUP = 2 if QUICK else 4  # TPE's and GP's random trials before their model takes over
# the grid of the method comparison (unlisted parameters: their lowest value); its product is
# N_METHOD
GRID = {"lr": 4} if QUICK else {"lr": 4, "warmup_steps": 2, "global_batch": [8, 32]}
# random vs grid: LEVELS x LEVELS trials each, random search once per seed
RVG_LEVELS, RVG_SEEDS = (2, (0,)) if QUICK else (3, (0, 1, 2))
N_PRUNE = 3 if QUICK else 10  # pruning: trials per study
PRUNE_REPEATS = 1 if QUICK else 3  # pruning: runs of each pruner's study
N_PARALLEL = 2 if QUICK else 4  # parallel workers: trials
N_ARCH, POPULATION = (3, 4) if QUICK else (10, 5)  # architecture search: runs per method
# its memory budget per rank; quick mode's few trials would rarely meet 1.5 MiB's limit
BUDGET = (0.75 if QUICK else 1.5) * MiB
STORAGE = search.storage_url()  # sqlite:///<runs>/search.db

# %% [markdown]
# ### Grid, random, TPE and GP on the same budget
#
# Each method gets the same number of trials; each trial is one run, followed live. The figure
# is the best held-out loss found so far against trials spent. The **target** is "as good as
# the best any method found": that loss plus 2% of the way back up to the untrained loss
# (ln V, the loss of a uniform guess). How many trials did each method need to get there?

# %%
spec = hp_search.HPSpec.make(rows=ROWS)
grid = search.grid_values(spec.space, GRID)
studies = hp_search.compare_methods(spec, N_METHOD, seed=0, grid=grid, n_startup=N_STARTUP,
                                    storage=STORAGE)
target = search.near_best(studies.values(), math.log(spec.config({}).vocab_size), 0.02)
figs.best_so_far_figure(studies, target).show()
table(figs.METHOD_HEADER, figs.method_rows(studies, target))
print("the grid:", "; ".join(f"{k} {', '.join(f'{v:.3g}' for v in vals)}"
                             for k, vals in grid.items()))

# %% [markdown]
# "run s / trial" is the run as the caller waited for it: launching the rank, training,
# evaluating, tearing down. "search s / trial" is everything else a trial cost: the sampler's
# proposal (the GP's fit is the expensive one), the SQLite writes of every reported value, the
# polling loop. A launch forks its rank from distlab's fork server, which already imported
# torch, so the launch itself is a small part of a trial:

# %%
cost = search.launch_overheads([t for s in studies.values() for t in s.trials])
median_overhead = cost["overhead_s"]
table(["trials", "median run wall s", "median steps s", "median launch + eval + teardown s"],
      [[cost["trials"], f"{cost['wall_s']:.3f}", f"{cost['train_s']:.3f}",
        f"{median_overhead:.3f}"]])

# %% [markdown]
# ### Random beats grid when few parameters matter
#
# Two parameters: the learning rate, which matters a great deal, and weight decay, which over
# a run this short barely does. A 3 x 3 grid and random search get 9 trials each. The grid
# tries 3 learning rates; random search tries 9. Neither learns from results, so all 9 trials
# of a study train one after another in ONE launch (`hp_search.optimize_together`), the same
# runs as 9 launches (a trial's run depends only on its config).

# %%
rvg_spec = hp_search.HPSpec.make(rows=ROWS, space={k: hp_search.HP_SPACE[k]
                                                   for k in ("lr", "weight_decay")})
rvg = hp_search.random_vs_grid(rvg_spec, RVG_LEVELS, RVG_SEEDS, storage=STORAGE)
figs.random_vs_grid_figure(rvg).show()
effects = hp_search.main_effects(rvg["grid"])
grid_best = rvg["grid"].best_value
random_best = [s.best_value for s in rvg["random"]]
distinct = [len({t.params["lr"] for t in search.completed(s)}) for s in rvg["random"]]
table(["study", "best loss", "distinct learning rates tried"],
      [["grid", f"{grid_best:.3f}", len({t.params['lr'] for t in rvg['grid'].trials})]]
      + [[f"random, seed {s}", f"{b:.3f}", d] for s, b, d in zip(RVG_SEEDS, random_best,
                                                                 distinct)])
say(f"main effect on the grid (spread of the mean loss over a parameter's values): "
    f"lr {effects['lr']:.3f} nats, weight decay {effects['weight_decay']:.4f} nats")
per_trial_together = sum(rvg["walls"]) / (len(rvg["walls"]) * rvg["trials_per_launch"])
print(f"one launch for {rvg['trials_per_launch']} trials: {per_trial_together:.3f} s per trial")

# %% [markdown]
# ### Early stopping: successive halving and Hyperband
#
# Most trials of a search are bad, and most bad trials look bad early. **Successive halving**
# (Jamieson & Talwalkar 2016) runs trials to a first rung of resource, keeps the best 1/η, runs
# those η times further, and so on. **Hyperband** (Li et al. 2018) hedges over how early to
# judge: several brackets of successive halving, from aggressive to patient. Here the resource
# is training rows (comparable across batch sizes) and η = 3. The pruner needs a loss *while the
# run runs*: `search.run_trial` reads the run's step events as they arrive (the lines
# `run.history("step")` returns, read from the ranks' logs every 20 ms), reports the mean loss
# of every 64 rows to the trial (32 in quick mode), and on `trial.should_prune()` stops the run
# (`run.stop()`): steps that were never run.
#
# The same configurations run three times: unpruned (to the end, every live loss reported),
# then under each pruner. Compute saved is measured: steps logged and wall seconds. The steps a
# pruned run takes are a race, though: the pruner decides at a report, and the run goes on
# stepping until the caller's stop reaches it, faster or slower with the machine's load (a
# short run may even finish first). So the claim is decided on the steps the decisions saved
# (those after each report that pruned a trial: a count), and the steps as run are shown
# beside them. Each pruner's study runs 3 times (once in quick mode): Hyperband assigns a
# trial's bracket from a hash of the study's name, which is new every run, so its decisions
# differ from run to run, and the claim needs every run to save.

# %%
prune_spec = hp_search.HPSpec.make(rows=ROWS, report_rows=REPORT_ROWS)
pruning = hp_search.pruning_comparison(prune_spec, N_PRUNE, seed=1, storage=STORAGE)
# the best trial kept means the same trial, with the same loss to the bit: a configuration
# trains the same every time (seeded, one thread; tests/test_search.py checks it)
figs.pruning_figure(pruning).show()
ref_best = pruning["unpruned"].best_trial
prune_rows, prune_ok = hp_search.pruning_rows(pruning)
table(["study", "pruned", "steps run", "steps saved", "run seconds", "seconds saved",
       "best trial"], prune_rows)
prune_reps = hp_search.pruning_repeats(pruning, prune_spec, PRUNE_REPEATS, storage=STORAGE)
print("steps saved per run of each pruner's study, as run (the stop lands after the decision) "
      "and as decided: " + "; ".join(
          f"{k}: {', '.join(f'{x:.0%}' for x in v['saved'])} run, "
          f"{', '.join(f'{x:.0%}' for x in v['decided'])} decided"
          for k, v in prune_reps.items()))

# %% [markdown]
# ### One study, several workers, one database
#
# The studies above live in `runs/search.db`, a SQLite file: each trial's parameters, every
# reported value, its result and what its run measured (user attributes). Any process can load
# a study by name and see all of it, and several workers can add trials to one study at once:
# each asks the storage for its next trial and writes back its result. Here the same trials run
# by one worker and by two (`study.optimize(..., n_jobs=2)`: two threads, each launching its
# own runs); `python -m distlab.lab.hp_search --storage ... --study NAME` is the same worker as a
# process of its own, on this machine or another. Across machines, the storage is a database
# server they all reach (PostgreSQL, MySQL: `optuna.create_study(storage="postgresql://...",
# study_name=..., load_if_exists=True)` on every machine); the docstring of
# `distlab.lab.search` says how.

# %%
params = [t.params for t in studies["random"].trials[:N_PARALLEL]]
par = hp_search.parallel_speedup(spec, params, n_jobs=2, storage=STORAGE)
speedup = par[1]["wall_s"] / par[2]["wall_s"]
reloaded = optuna.load_study(study_name=par[2]["study"].study_name, storage=STORAGE)
same = ([(t.params, t.value) for t in reloaded.trials]
        == [(t.params, t.value) for t in par[2]["study"].trials])
table(["workers", "trials", "wall s", "speed-up"],
      [[1, N_PARALLEL, f"{par[1]['wall_s']:.2f}", "1.00"],
       [2, N_PARALLEL, f"{par[2]['wall_s']:.2f}", f"{speedup:.2f}"]])
print(f"load_study({reloaded.study_name!r}) from {STORAGE}: {len(reloaded.trials)} trials, "
      f"the same parameters and losses: {same}")

# %% [markdown]
# On this 2-core machine two workers share the two cores (and whatever else runs on them):
# the speed-up is what the cores allow, not a property of the search.
#
# ### Architecture search under a memory budget
#
# Neural architecture search (Zoph & Le 2017) trains candidate networks and keeps the good ones.
# A candidate here is the GPT's depth (`n_layer`), width (`n_embd`), heads (`n_head`, which must
# divide `n_embd`) and MLP ratio, trained 40 steps; two objectives are minimised at once, the
# held-out loss and the parameter count. No single trial is best then, only the **Pareto front**:
# the trials no other beats on both. **NSGA-II** (Deb et al. 2002) breeds each generation from
# the front so far; random search only draws (NSGA-II's first generation is the same random
# draws).
#
# A budget of 1.5 MiB per rank (0.75 MiB in quick mode: parameters, gradients, AdamW state and
# activations, by `distlab.theory.estimate`) is checked **before anything starts**: a candidate over
# it, or one RunConfig refuses (3 heads in a width of 32), is pruned with its reason and costs
# no run. Each method runs until it has trained the same number of candidates.

# %%
arch_spec = arch_search.ArchSpec.make(
    arch_search.ARCH_BASE.replace(steps=ROWS // 8, eval_every=ROWS // 8), budget_bytes=BUDGET)
arch = {m: arch_search.arch_search(m, arch_spec, N_ARCH, seed=0, max_trials=8 * N_ARCH,
                                   population=POPULATION, storage=STORAGE)
        for m in ("random", "nsga2")}
figs.pareto_figure(arch).show()
hv = arch_search.front_shares(arch)
refused_total = sum(s.user_attrs["refused"] for s in arch.values())
table(["method", "trials drawn", "refused before running", "runs", "run folders created",
       "share of the joint front's hypervolume"],
      [[figs.NAMES[m], len(s.trials), s.user_attrs["refused"], len(search.completed(s)),
        s.user_attrs["run_folders"], f"{hv[m]:.1%}"] for m, s in arch.items()])
for t in arch_search.refused(arch["random"])[:3]:
    print(f"refused {t.params}: {t.user_attrs['refused'][:110]}")
estimate_gap = arch_search.estimate_vs_measured(arch.values())
say(f"distlab.theory.estimate against what the runs measured (params, grads, optimizer state, "
    f"activations): largest difference {estimate_gap:.0f} bytes over "
    f"{sum(len(search.completed(s)) for s in arch.values())} runs; budget "
    f"{arch_spec.budget_bytes / MiB:.2f} MiB")

# %% [markdown]
# The hypervolume is the area the front dominates up to a reference point just past the worst
# loss and the largest model seen (Zitzler & Thiele 1998): larger is a better front, and the
# joint front of both methods is 100%.
#
# ### What this run shows
#
# A trial's loss is reproducible (seeded, one thread); anything read from a clock is not. The
# rows with basis "timed" depend on this machine and on what else runs on it: they are read
# over repeats, the figure gives min / median / max, and the verdict is yes or no only when the
# middle halves of the repeats (`distlab.lab.timed`) do not overlap the claim's bound, else
# "undecided on this machine". Quick mode takes too few repeats to decide.

# %%
steps_to = {m: search.trials_to_reach(s, target) or N_METHOD + 1 for m, s in studies.items()}
wins = sum(b < grid_best for b in random_best)
# "barely matters": weight decay moves the loss a third as much as lr does, or less (measured
# here it is far less; lr's main effect is most of a nat)
few_matter = effects["weight_decay"] * 3 < effects["lr"]
folders_ok = all(s.user_attrs["run_folders"] == len(search.completed(s)) for s in arch.values())
no_run_refused = all("run" not in t.user_attrs for s in arch.values()
                     for t in arch_search.refused(s))
search_claims = [
    claim("Bayesian search needs fewer trials than random to reach a given loss",
          "Bergstra et al. 2011 (TPE); Snoek et al. 2012 (GP)",
          f"trials to reach {target:.3f}: TPE {steps_to['tpe']}, GP {steps_to['gp']}, random "
          f"{steps_to['random']}, grid {steps_to['grid']} ({N_METHOD} each; "
          f"{N_METHOD + 1} = never)",
          steps_to["tpe"] < steps_to["random"] and steps_to["gp"] < steps_to["random"]),
    claim("random beats grid when few parameters matter", "Bergstra & Bengio 2012",
          f"best of {RVG_LEVELS ** 2}: grid {grid_best:.3f}, random "
          f"{', '.join(f'{b:.3f}' for b in random_best)} (seeds {RVG_SEEDS}); lr tried: grid "
          f"{RVG_LEVELS}, random {distinct}; main effect lr {effects['lr']:.3f}, weight decay "
          f"{effects['weight_decay']:.4f} nats",
          few_matter and wins * 2 > len(random_best)),
    # decided on the steps the pruners' decisions saved, a count; the steps the runs actually
    # ran past a decision are a race with the stop (hyperband's read 0-16% over six runs here:
    # a short run can finish before its stop lands), so they are shown, not decided on
    claim("pruning saves compute (≥ 1% of the steps) without losing the best trial",
          "Jamieson & Talwalkar 2016; Li et al. 2018",
          "steps the decisions saved, per run of each study: " + "; ".join(
              f"{k} {', '.join(f'{x:.1%}' for x in v['decided'])}"
              for k, v in prune_reps.items())
          + "; as run, the stop landing after the decision (timed, min / median / max): "
          + "; ".join(
              f"{k} {fmt_spread(v['saved'], 100, '%', 2)}" for k, v in prune_reps.items())
          + "; best trial kept in every run: " + ", ".join(
              f"{k} {v['kept']}" for k, v in prune_reps.items())
          + f" (unpruned best {ref_best.value:.3f}, trial {ref_best.number})",
          all(v["kept"] and min(v["decided"]) >= 0.01 for v in prune_reps.values()),
          basis="measured"),
    claim("the architecture budget refuses trials before they run",
          "distlab.theory.estimate; Zoph & Le 2017 (NAS)",
          f"{refused_total} of {sum(len(s.trials) for s in arch.values())} candidates refused; "
          f"run folders created = runs completed: {folders_ok}; no refused trial has a run: "
          f"{no_run_refused}",
          refused_total > 0 and folders_ok and no_run_refused),
    claim("the budget's estimate is what the runs measured", "distlab.theory.estimate",
          f"largest difference {estimate_gap:.0f} bytes over the completed candidates",
          estimate_gap == 0),
    claim("NSGA-II finds a better front than random search with as many runs", "Deb et al. 2002",
          f"share of the joint front's hypervolume: NSGA-II {hv['nsga2']:.1%}, random "
          f"{hv['random']:.1%} ({N_ARCH} runs each)", hv["nsga2"] > hv["random"]),
    timed_claim("a fork-server launch costs a trial well under a second (< 1 s)",
                "distlab.caller.launch", within(cost["overheads_s"], hi=1.0),
                {"launch + evaluation + teardown": cost["overheads_s"]}, scale=1, unit="s",
                note=f"in one shared launch {per_trial_together:.3f} s per trial in all"),
    claim("workers share one study through its storage", "Optuna (RDB storage)",
          f"{len(reloaded.trials)} trials reloaded from SQLite, identical: {same}; 2 workers "
          f"{speedup:.2f}x as fast as 1", same and len(reloaded.trials) == N_PARALLEL),
]
# our code's rows, not textbook claims: a refused trial starts nothing, the budget's estimate
# is exact, and a study survives its storage
assert folders_ok, {s.study_name: s.user_attrs["run_folders"] for s in arch.values()}
assert no_run_refused and search_claims[4]["holds"] and same, (no_run_refused, estimate_gap, same)
claims_table(search_claims)

# %% [markdown]
# ## Time to train, from what this machine measures
#
# > *"How do you estimate training time? Time per step × steps per epoch × epochs; factor in
# > communication overhead (scaling efficiency below 100%)."*
#
# Four measurements turn that recipe into a number: the FLOPs of one step (counted by
# PyTorch, set beside the formula), the FLOP/s the step reaches against this machine's peak
# (MFU), the throughput at 1, 2 and 4 ranks (scaling efficiency), and a check that time per
# step × steps predicts a longer run. Then the recipe applied to a run of the size the
# interview questions ask about, with the error bars the measured efficiency implies.

# %%
import os

from IPython.display import Markdown, display

from distlab import RunConfig
from distlab.studies.flop_count import count_step_flops
from distlab.theory.plan import GPT3_175B, Cluster, best
from distlab.lab.common import claim, claims_table, say, table
from distlab.lab.timed import all_of, below, mean_note, mean_within, timed_claim, within
from distlab.lab.time_to_train import (
    achieved,
    cluster_days,
    flops_rows,
    prediction_errors,
    scaling_figure,
    scaling_rows,
    scaling_runs,
    step_samples,
)

QUICK = os.environ.get("WORKBOOK_QUICK", "0") == "1"
# a GPT large enough that its matmuls, not Python, take most of a step
TT = RunConfig(n_layer=2 if QUICK else 4, n_embd=64 if QUICK else 128, n_head=4,
               seq_len=32 if QUICK else 64, steps=8 if QUICK else 16, optimizer="sgd", lr=0.1,
               timeout_s=120)
TIME_REPEATS = 1 if QUICK else 5  # MFU pairs (peak, step), and predictions tested

# %% [markdown]
# ### FLOPs of a step: PyTorch's count against 6·N·D
#
# `torch.utils.flop_counter.FlopCounterMode` counts every matmul the step runs, forward and
# backward. The formula: 6 FLOPs per token for each of the N parameters that multiply an
# activation (2 forward, 4 backward: Kaplan et al. 2020, Section 2.1) plus 12·L·h·s per token
# for attention's two s×s matmuls (Chowdhery et al. 2022, PaLM, Appendix B). One thing found
# on the way: the counter has no formula for the CPU build's fused attention kernel, so the
# count runs the step with PyTorch's math attention, which it sees (`distlab.studies.flop_count` explains).

# %%
count = count_step_flops(TT.replace(global_batch=8))
table(["part", "counted by PyTorch", "formula", "formula's terms", "counted / formula"],
      flops_rows(count))

# %% [markdown]
# ### MFU: the FLOP/s a step reaches, against the peak
#
# Model FLOP utilisation (PaLM, Appendix B) is the formula's FLOPs per step over the step's
# time, divided by the hardware's peak. On a GPU the peak is the datasheet's dense figure; on
# this CPU it is what one large fp32 matmul reaches here, measured in the same cell on the
# same single thread. So the figure says how near this model's mix of kernels (matmuls, and
# LayerNorm, softmax, the optimizer, Python between them) comes to this CPU's best kernel: it
# is this model's on this machine, not a property of the method, and not comparable with a
# GPU's MFU against its tensor cores' peak. Both are clocks, and on a shared machine the load
# moves them: the peak and the step are measured in pairs, 5 times (once in quick mode), and
# each pair gives an MFU. One thread, because with both cores in use a process that takes one
# for a moment slows the matmul and the step unequally: at 2 threads this model read 55%
# on a quiet machine and 41–58% beside one busy process, at one thread 66–79% either way.

# %%
mfu = achieved(TT.replace(global_batch=8), repeats=TIME_REPEATS, threads=1)
display(Markdown(
    f"**{mfu['device']}**, the median pair: a step of {mfu['tokens_per_step']:,} tokens takes "
    f"{mfu['step_s'] * 1e3:.1f} ms (median), {mfu['flops_per_s'] / 1e9:,.1f} GFLOP/s of model "
    f"FLOPs; peak {mfu['peak'] / 1e9:,.1f} GFLOP/s ({mfu['peak_source']}): "
    f"**MFU {mfu['mfu']:.0%}**; over {len(mfu['mfus'])} pairs "
    f"{', '.join(f'{m:.0%}' for m in mfu['mfus'])}."))

# %% [markdown]
# ### Throughput at 1, 2 and 4 ranks
#
# Data parallelism with 8 rows per rank (the global batch grows with the ranks, as it does on
# a cluster), one thread per rank. Scaling efficiency at N ranks = tokens/s at N / (N × tokens/s
# at 1). On a 2-core machine 4 ranks share 2 cores, so 4 ranks cannot beat 2: the figure
# shows this machine, as a cluster's would show its network.

# %%
runs = scaling_runs(TT, worlds=(1, 2) if QUICK else (1, 2, 4))
rows = scaling_rows(runs)
scaling_figure(rows).show()
table(["ranks", "step (ms, median)", "tokens / s", "scaling efficiency"],
      [[r["world"], f"{r['step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
        f"{r['efficiency']:.0%}"] for r in rows])

# %% [markdown]
# ### How far from the limit
#
# Beating PyTorch's own implementation is not the limit; what the machine allows is. Each
# strategy's step is predicted from parts measured here, none borrowed from the run it
# predicts (`distlab.studies.step_limit`, `distlab.theory.step_time`):
#
# - **compute**: the strategy's step in one process as one of its ranks, on PyTorch's fake
#   process group, where every collective returns at once and moves nothing: the rank's
#   own shapes (a TP shard, a pipeline stage: the slowest), copies and optimizer step;
# - **each collective**: t = α + B/β (Hockney), α and β fitted on these ranks per kind;
# - **what overlaps**: DDP's buckets behind backward (Li et al. 2020), ZeRO-3's all-gathers
#   a unit ahead (forward's first between steps, so backward's first is the one that
#   waits), the pipeline's bubble (p−1)/m (Huang et al. 2019), ring attention's hops
#   behind its block compute (Liu et al. 2023); TP's all-reduces wait where they are issued.
#
# Then each strategy trains on the ranks, and its step splits into the time blocked in
# waits and the rest. Where the two bars part, the table says which of the two measured parts
# is larger: waits longer than the α-β fit prices them (the backend's cost), or compute
# slower than it ran alone, beside the CPU the backend's threads burned (on a CPU, a
# collective "hidden" behind compute still runs on a core the ranks compute on). The tick is
# the cores bound: N ranks that each need the CPU seconds they were measured to use, on this
# machine's cores. Hover over a predicted bar for its exposed terms.

# %%
from distlab.lab.how_far import (LIMIT_HEADER, TERM_HEADER, limit_figure, limit_rows,
                                 ratio_samples, term_rows)
from distlab.studies.step_limit import STRATEGIES, TARGET, blocked_by_core_wait, prefetch_shares
from distlab.studies.step_limit import limit_rows as measure_limits

limit = measure_limits(
    TT, 2, ("ddp", "zero3", "tp", "pp") if QUICK else STRATEGIES,
    repeats=1 if QUICK else 2, warmup=2 if QUICK else 3, coll_reps=3 if QUICK else 7,
    compute_reps=3 if QUICK else 7,
    sizes=(64 << 10, 1 << 20) if QUICK else (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20))
limit_figure(limit).show()
table(LIMIT_HEADER, limit_rows(limit))
table(TERM_HEADER, term_rows(limit))
zero3_rows = [r for r in limit["rows"] if r["strategy"] == "zero3"]
zero3_gathers = prefetch_shares(zero3_rows[0])  # per step, the ranks' mean share
zero3_cores = blocked_by_core_wait(zero3_rows[0]["steps"])  # None off Linux, or few steps
display(Markdown(
    "α-β fits (2 ranks): " + "; ".join(
        f"{k} α {f.alpha * 1e6:.0f} µs, β {f.beta / 1e9:.2f} GB/s (worst point "
        f"{limit['fit_worst'][k]:.0%} off)" for k, f in limit["fits"].items())
    + f". ZeRO-3's compute waited on parameter all-gathers for "
    f"{statistics.mean(zero3_gathers):.1%} of its step (the mean over steps of the ranks' "
    f"mean; the median step {statistics.median(zero3_gathers):.1%})."
    + (f" Its gathers move on gloo's threads, which share the cores with the ranks' compute: "
       f"a step, they waited {zero3_cores['others_wait_s'] * 1e3:.1f} ms for a core, the "
       f"training thread {zero3_cores['main_wait_s'] * 1e3:.1f} ms (Linux's run_delay). "
       f"Compute blocked {zero3_cores['blocked_least_waiting']:.1%} of the step in the half of "
       f"the steps where gloo's threads waited least, {zero3_cores['blocked_most_waiting']:.1%} "
       "in the other half: were the cores the cause, the second would be the larger."
       if zero3_cores else "")))

# %% [markdown]
# ### Which communication can hide
#
# A transfer can hide behind compute when two things hold: there is compute that does not need
# its result, and that compute lasts longer than the transfer. The second is arithmetic, the
# Ultra-Scale Playbook's (Tazi et al. 2025): a parallelism's compute time beside its bytes over
# the link, both from the model's shapes (`distlab.theory.overlap`, whose docstring derives
# each): DP's gradient all-reduce behind backward hides when the tokens per rank
# T ≥ (N−1)/N·b·F/(2β), TP's all-reduces behind a layer's matmuls when the hidden size
# h ≥ (t−1)·b·F/(6β), a pipeline's activation behind the next forward when (L/p)·h ≥ b·F/(24β),
# with F this machine's model FLOP/s on one thread (measured above), β the link's bytes a
# second and b = 4 bytes a value. Below for loopback (β fitted on these ranks) and for the
# simulated nodes' 100 Mbit/s link of notebook 17, and then what the ranks above showed: per
# step, the seconds blocked in communication over the model's seconds for all of it. The
# pipeline's waits are its bubble as much as its transfers, so its condition is not checked
# against them here.

# %%
from distlab.lab.overlap import (CONDITION_HEADER, MEASURED, condition_rows, conditions,
                                 exposed_shares, overlap_claim)

links = {"loopback": limit["fits"]["all_reduce"].beta, "100 Mbit/s (17's nodes)": 100e6 / 8}
conds = conditions(TT, 2, mfu["flops_per_s"], links)
table(CONDITION_HEADER, condition_rows(conds))
shares = {p: exposed_shares(limit, s) for p, s in MEASURED.items()}
say("Seen on the ranks (loopback), seconds blocked over the modelled communication, per step: "
    + "; ".join(f"{p} ({MEASURED[p]}) {fmt_spread(s, 1, '', 2)}" for p, s in shares.items())
    + ". DDP's buckets are all-reduced while backward goes on, so most of their time can pass "
    "unseen; Megatron's TP waits on each all-reduce where it is issued, as its result is the "
    "next matmul's input, so however the arithmetic comes out, nothing is there to hide it.")
overlap_row = overlap_claim(conds["loopback"], shares)

# %% [markdown]
# ### How cost grows with the work
#
# The same model, priced and measured as the work grows: ddp over more ranks at one width,
# and over a wider model at 2 ranks (`distlab.studies.step_limit.growth_points`; 1 rank is
# the plain single process). Each rank's compute comes from its one-process step, the
# communication from the α-β fits above (and fitted again on the larger worlds), so the
# dashed line is predicted before the solid one is measured. The two coloured lines are the
# model's parts: compute, and all the communication a step sends (hidden or not). Where the
# orange line crosses the blue one, communication costs more than compute, and adding ranks
# buys less than it costs: the ring's bytes per rank, 2(N−1)/N of the gradients, barely grow
# with N, but on shared cores each collective's α does. Over width the other way: compute
# grows with n_embd² per token, the bytes with the parameters, and the overlap rule hides
# more. The dotted line is the serial sum (nothing hidden); hover for bytes per rank.

# %%
from distlab.lab.how_far import growth_figure, growth_summary
from distlab.studies.step_limit import growth_points

width = TT.n_embd
# 8 ranks where there are at least 4 cores: on fewer, 8 processes time-slice each core and
# the step measures the scheduler more than the ring (benchmarks/step_model.py --scale runs
# them anyway and says so)
worlds = (2, 4) if QUICK else (1, 2, 4, 8) if (os.cpu_count() or 1) >= 4 else (1, 2, 4)
growth = growth_points(
    TT, [(w, width) for w in worlds]
    + [(2, e) for e in ((32,) if QUICK else (64, 256, 384))],
    repeats=1 if QUICK else 2, warmup=2 if QUICK else 3, coll_reps=3 if QUICK else 7,
    compute_reps=3 if QUICK else 7, fits={2: limit["fits"]},
    sizes=(64 << 10, 1 << 20) if QUICK else (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20))
growth_figure(growth).show()
summary = growth_summary(growth)


def crossover(curve):
    c = summary[curve]["crossover"]
    return ("modelled communication never exceeds compute on this curve" if c is None else
            f"modelled communication first exceeds compute at {c['world']} ranks, n_embd "
            f"{c['n_embd']} ({c['prediction'].comm_total * 1e3:.1f} ms against "
            f"{c['prediction'].compute.total * 1e3:.1f} ms)")


display(Markdown(
    f"Over ranks: measured within **{summary['ranks']['worst']:.0%}** of the prediction at "
    f"worst ({summary['ranks']['worst_serial']:.0%} of the serial sum); "
    f"{crossover('ranks')}. Over width: within **{summary['width']['worst']:.0%}** "
    f"({summary['width']['worst_serial']:.0%} of the serial sum); {crossover('width')}."))

# %% [markdown]
# ### Does time per step × steps predict a run?
#
# From the 2-rank run's median step, predict a run three times as long, then run it and
# measure the time its steps took (the slowest rank's step, summed). Both runs are clocks on a
# shared machine: a load that comes or goes between them moves the error, so the prediction
# is tested 5 times (once in quick mode), each from a fresh short run.

# %%
pred = prediction_errors(runs[2], 3 * TT.steps, TIME_REPEATS)
err = pred["errors"][0]
display(Markdown(
    f"Predicted {pred['steps']} steps × {pred['step_s'] * 1e3:.1f} ms = "
    f"**{pred['predicted_s']:.2f} s**; measured **{pred['measured_s']:.2f} s** "
    f"({err:+.0%}). The short run's steps spread {pred['spread']:.0%} of their median (10th "
    f"to 90th percentile). Error over {pred['repeats']} tests: "
    f"{', '.join(f'{e:+.0%}' for e in pred['errors'])}."))

# %% [markdown]
# ### The recipe at the interview's scale
#
# GPT-3 (175B parameters, 300B tokens; Brown et al. 2020) on 1024 A100s: the time is
# 6·N·D over the cluster's FLOP/s. Each GPU reaching MFU 0.5 of its 312 TFLOP/s (the A100
# datasheet's dense bf16) is an assumption, and so is the efficiency: 90%, the scaling
# efficiency Horovod's README (2018) reports for Inception V3 and ResNet-101 on 128 GPUs (32
# servers of 4 Pascal GPUs, 25 Gbit/s RoCE), and what the planner (`distlab.theory.plan`, the
# α-β model of NVLink and InfiniBand, Megatron's 3D layouts) computes for GPT-3's fastest
# layout on 1024 A100s: the share of its step that is compute. The efficiencies measured
# above are not used: 4 processes on 2 CPU cores measure cores shared, not a network, and
# say nothing about 1024 GPUs (an earlier version used them as the band's ends).
# Modelled, not measured: every input is named.

# %%
N_GPT3, D_GPT3, GPUS = 175e9, 300e9, 1024
effs = [r["efficiency"] for r in rows if r["world"] > 1]  # this machine's, for the claims
gpt3_plan = best(GPT3_175B, Cluster(gpus=GPUS), global_batch=1536)
planned = gpt3_plan.compute_s / gpt3_plan.step_s  # compute's share of the planned step
band = {"efficiency 100% (none lost)": 1.0, "efficiency 90% (Horovod's README)": 0.9,
        f"efficiency {planned:.0%} (the planner: dp {gpt3_plan.dp} × tp {gpt3_plan.tp} × pp "
        f"{gpt3_plan.pp}, bubble and exposed communication)": planned}
days = {k: cluster_days(N_GPT3, D_GPT3, GPUS, 312e12, 0.5, e) for k, e in band.items()}
table(["assumption", "days for 300B tokens on 1024 A100s at MFU 0.5"],
      [[k, f"{d:.1f}"] for k, d in days.items()])

# %% [markdown]
# ### What this run shows
#
# Every row below but the first and the last reads a clock, on this machine and under its
# load at the time: each is a spread over repeats (steps, pairs or runs), and reads
# "undecided on this machine" where the spread crosses the claim's bound: the middle half of
# the repeats, or for the prefetch row the interval that holds the mean share of the step with
# 95% confidence (the time a run loses is the mean's; the per-step shares are many small and a
# few large, 1-29% over 26 steps, whose median's interval reached down to the bar in one run
# of four). A second run here, or a run on another machine, can read differently; the
# figures say by how much.

# %%
time_claims = [
    claim("PyTorch's FLOP counter agrees with 6·N·D plus the attention term",
          "Kaplan et al. 2020; PaLM Appendix B", f"counted/formula = "
          f"{count['counted'] / count['formula']:.4f} ({count['counted']:,} FLOPs)",
          count["counted"] == count["formula"]),
    timed_claim("an MFU of 40–50% is what a good training run reaches",
                "PaLM Appendix B (46.2%)", within(mfu["mfus"], 0.40, 0.50),
                {"MFU": mfu["mfus"]}, scale=100, unit="%", digits=2,
                note=f"each repeat a step against {mfu['peak_source'].split(':')[0]} peak "
                     "taken beside it"),
    timed_claim("data parallelism scales near-linearly (≥ 90% efficiency)",
                "Horovod's README (90% on 128 GPUs)",
                # weak scaling: efficiency = step(1 rank) / step(N ranks), so ≥ 90% is
                # step(N) ≤ step(1) / 0.9
                all_of(*(below(step_samples(runs[r["world"]]), step_samples(runs[1]),
                               1 / 0.9) for r in rows[1:])),
                {f"{w} rank{'s' if w > 1 else ''}": step_samples(runs[w]) for w in runs},
                interleaved_=False, note="step time; efficiency at the medians " + ", ".join(
                    f"{r['world']} ranks {r['efficiency']:.0%}" for r in rows[1:])),
    timed_claim("time per step × steps predicts the training time (within 25%)",
                "time per step × steps per epoch × epochs", within(pred["errors"], -0.25, 0.25),
                {"measured / predicted − 1": pred["errors"]}, scale=100, unit="%", digits=2,
                note=f"first test: predicted {pred['predicted_s']:.2f} s, measured "
                     f"{pred['measured_s']:.2f} s"),
    timed_claim(f"each strategy written here steps within {TARGET}× of what this machine "
                "allows (compute + exposed communication)",
                "the α-β model (Hockney) and each strategy's overlap rule; the bar: 1.2×",
                all_of(*(within(ratio_samples(r), hi=TARGET) for r in limit["rows"])),
                {r["strategy"]: ratio_samples(r) for r in limit["rows"]}, scale=1, unit="×",
                interleaved_=False, note="each step over the prediction"),
    timed_claim("ZeRO-3's prefetch hides its all-gathers: compute waits on them at most 3% of "
                "the step", "FSDP's prefetch (Zhao et al. 2023); the bar: 3%",
                mean_within(zero3_gathers, hi=0.03),
                {"blocked on all-gathers (per step, the ranks' mean)": zero3_gathers},
                scale=100, unit="% of the step", digits=2,
                note=mean_note(zero3_gathers, 100, "%") + (
                    f"; {zero3_cores['blocked_least_waiting']:.1%} in the steps whose gloo "
                    f"threads waited least for a core, {zero3_cores['blocked_most_waiting']:.1%} "
                    "in the rest" if zero3_cores else "")),
    overlap_row,
    claim("with the model and global batch fixed, more ranks make communication cost more "
          "than compute", "the α-β model (Hockney 1994), priced with this machine's fits",
          crossover("ranks"), summary["ranks"]["crossover"] is not None, basis="modelled"),
]
claims_table(time_claims)
assert time_claims[0]["holds"], time_claims[0]

# %% [markdown]
# ## Horovod, and what it maps to here
#
# Horovod (Sergeev & Del Balso 2018, from Uber) made data-parallel training a few lines of
# change to a single-GPU script, for TensorFlow, Keras, PyTorch and MXNet alike, at a time
# when distributed TensorFlow meant parameter servers. Its ideas are the ones this workbook
# built: ring all-reduce of the gradients (Baidu's, run by NCCL, Gloo or MPI), Tensor Fusion
# (many small gradients all-reduced as one buffer: DDP's buckets), all-reducing each gradient
# as soon as backward produces it (DDP's overlap), and rank 0's weights broadcast at the start.
#
# | Horovod (PyTorch API) | PyTorch | distlab |
# |---|---|---|
# | `hvd.init()` | `dist.init_process_group("nccl")` | `launch(cfg)`, or a rank under `torchrun -m distlab` |
# | `hvd.rank()`, `hvd.size()`, `hvd.local_rank()` | `dist.get_rank()`, `dist.get_world_size()`, `LOCAL_RANK` | the loop's `rank`, `world` |
# | `hvd.DistributedOptimizer(opt, named_parameters=...)`: an all-reduce per gradient as backward makes it, averaged | `DistributedDataParallel(model)`: the same from the model's side, in buckets | `distlab.DistributedDataParallel`, `strategy="ddp"` |
# | Tensor Fusion: `HOROVOD_FUSION_THRESHOLD` (128 MB since v0.21), cycle time 1 ms | `bucket_cap_mb=25` | `RunConfig.bucket_mb` |
# | `hvd.broadcast_parameters(model.state_dict(), root_rank=0)`, `hvd.broadcast_optimizer_state` | DDP's constructor broadcasts rank 0's module | each strategy's `wrap` broadcasts rank 0's weights |
# | `backward_passes_per_step=k` | `no_sync()` for k−1 micro-batches | `RunConfig.grad_accum` |
# | `hvd.Compression.fp16` | DDP comm hook `fp16_compress_hook` | `compress="topk"` (top-k with error feedback: a different compressor) |
# | `horovodrun -np 4 -H host1:2,host2:2 python train.py` | `torchrun --nnodes 2 --nproc_per_node 2 ...` | `torchrun ... -m distlab ...` |
#
# **Does it run here?** `pip install horovod` (0.28.1, its newest release, from 2023) builds
# from source. Tried on this workbook's machine (gcc 12, torch 2.13, CPU, Gloo, no MPI), it
# compiled for ten minutes and failed: its PyTorch extension is compiled as C++14, and
# PyTorch's headers have required C++17 since torch 2.1 ("C++17 or later compatible compiler
# is required to use PyTorch"). So Horovod does not install against the torch this workbook
# supports (2.6 and later), and none of its cells run: the cell below checks, and says.
#
# What can be measured is the idea. Tensor Fusion is bucketing: the same `ddp` run with
# buckets capped at 1 KiB (close to Horovod with fusion off) and at 25 MiB.

# %%
import importlib.util

from distlab.lab.time_to_train import fusion_runs

print("horovod importable:", importlib.util.find_spec("horovod") is not None)
fusion = fusion_runs(RunConfig(strategy="ddp", world_size=2, n_layer=2, n_embd=64, n_head=4,
                               seq_len=32, steps=6, timeout_s=60, threads_per_rank=1))
table(["2 ranks, ddp", "all-reduce calls per step", "bytes per step (rank 0)",
       "step (ms, median)"],
      [[k, v["calls"], f"{v['bytes']:,}", f"{v['step_s'] * 1e3:.1f}"] for k, v in fusion.items()])

# %%
small, large = fusion["buckets of 1 KiB"], fusion["buckets of 25 MiB"]
horovod_claims = [
    claim("Tensor Fusion (bucketing) turns many small all-reduces into few, same bytes",
          "Sergeev & Del Balso 2018 (Horovod: Tensor Fusion)", f"{small['calls']} calls → "
          f"{large['calls']}, {small['bytes']:,} B both", large["calls"] < small["calls"]
          and large["bytes"] == small["bytes"]),
]
claims_table(horovod_claims)
assert horovod_claims[0]["holds"], horovod_claims
