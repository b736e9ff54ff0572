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
# # 12 · When training goes wrong: out of memory after hours
#
# Some runs train normally for hours and then die. This notebook builds the usual causes as
# runs and measures each one: a rare long sequence (and three fixes, measured), a leak that
# keeps graphs alive across steps, and the CUDA allocator's fragmentation.
#
# It ends with a table of textbook claims against this run's figures. Bugs that make
# training slow, flat or wrong without a crash are notebook 11's debugging drills.

# %% [markdown]
# ## Out of memory after hours of training
#
# *"Training ran normally for five hours, then died with CUDA out of memory. Nobody changed
# the code."* Memory that was enough for hours and then is not has three usual causes, and
# this section builds each one as something that runs and is measured:
#
# 1. **a rare long sequence**: batches padded to their longest row; one long document
#    multiplies the step's activations, and it arrives when the data brings it;
# 2. **a leak**: the loop keeps tensors that hold their autograd graph, and memory grows
#    every step until it runs out;
# 3. **fragmentation** of CUDA's caching allocator: enough memory is free, but in holes too
#    small for the request.
#
# **What "out of memory" means on this CPU.** Nothing here crashes. We model a device of
# `BUDGET_MIB` MiB (a parameter below) and measure each training step's peak with
# `distlab.memory.PeakMemoryTracker` (the bytes aten ops allocated and still held, at their
# highest in the step: the CPU stand-in for `torch.cuda.max_memory_allocated`). A step whose
# measured peak exceeds the budget is where a device of that size would have raised, and the
# run ends there, as a real one would. The runs are in this process (`distlab.studies.memory_budget`,
# `distlab.studies.leak`): distlab's GPT, plain SGD, one thread.

# %% tags=["parameters"]
import os

QUICK = os.environ.get("WORKBOOK_QUICK", "0") == "1"
# The device: a budget in MiB for everything the step allocates (parameters, the batch,
# activations, backward's buffers). 3 MiB holds 8 rows of ~70 tokens of the GPT below.
BUDGET_MIB = 3.0
ROWS = 8  # rows per batch (pad to longest, length cap)
# Document lengths: Pareto(min_len, alpha) clipped at the model's block size
MIN_LEN, MAX_LEN, ALPHA = 8, 256, 2.5
# Each policy runs STEPS_PER_MEAN times the mean number of steps to the first OOM of the plain
# loader (1/p, p the modelled chance that a batch pads past what fits): P(no OOM at all in
# the run) = (1 − p)^(k/p) ≈ e^−k, 14% at k = 2 (quick), 2% at k = 4.
STEPS_PER_MEAN = 2 if QUICK else 4
LEAK_STEPS = 4 if QUICK else 12
SEED = 0

# %%
import math

import torch

from distlab.studies.allocator_limits import measure_allocator_limits
from distlab.studies.fragmentation import measure_fragmentation
from distlab.lab import out_of_memory as O
from distlab.lab.common import MiB, claim, claims_table, say, table
from distlab.studies.leak import KEEPS, leak_run
from distlab.studies.long_sequences import Documents
from distlab.studies.memory_budget import fit_length, train_under_budget
from distlab.models.gpt import GPTConfig

torch.set_num_threads(1)
MODEL = GPTConfig(vocab_size=64, block_size=MAX_LEN, n_layer=2, n_embd=32, n_head=2)
BUDGET = int(BUDGET_MIB * MiB)

# %% [markdown]
# ### 1. A rare long sequence
#
# Real documents have heavy-tailed lengths: most are short, a few are very long. Ours are
# Pareto-distributed, P(L > l) = (min_len / (l + 1))^α, clipped at the model's block size,
# and their tokens come from the workbook's Markov chain (`distlab.studies.long_sequences`). A
# loader that pads each batch to its longest row computes rows × longest: one long document
# among seven short ones makes the whole batch long.
#
# The budget fixes the longest padded length that fits, L\*; it comes from the formula
# `memory_budget.predicted_peak` (checked against the measurement below). A batch of R rows
# pads past L\* with probability p = 1 − (1 − P(L > L\*))^R per step, so the first OOM
# comes after a geometric number of steps, 1/p on average: small p, late death. At one step
# per second, p = 1/18,000 is five hours on average, with nothing wrong until then.

# %%
fit = fit_length(MODEL, ROWS, BUDGET)
p_step = Documents(1, MIN_LEN, MAX_LEN, ALPHA).pad_probability(fit, ROWS)
steps = math.ceil(STEPS_PER_MEAN / p_step)
cap, max_tokens = fit, ROWS * fit  # the fixes get what the budget allows
# enough documents for the policy that reads the most (buckets: up to max_tokens / MIN_LEN)
docs = Documents(steps * max_tokens // MIN_LEN, MIN_LEN, MAX_LEN, ALPHA, seed=SEED)
say(f"device budget {BUDGET / MiB:.2f} MiB: {ROWS} rows fit up to L* = {fit} tokens "
    f"(predicted); P(one document > L*) = {docs.tail(fit):.3%}, "
    f"P(a batch of {ROWS} pads past L*) = p = {p_step:.2%} per step, "
    f"mean {1 / p_step:.0f} steps to the first OOM; each policy runs {steps} steps")
O.lengths_figure(docs, fit, ROWS).show()

# %% [markdown]
# **Policies**, each run for the same number of steps from the same model initialisation:
#
# * **pad to longest**: the plain loader, `ROWS` consecutive documents per step;
# * **pad + reserve at start**: the same, after one step at the worst shape it can make
#   (`ROWS` × the block size) run first. It changes nothing about memory; it changes *when*
#   you find out: if the worst batch does not fit, the run fails at step 0, in the first
#   minute, not five hours in. (On a GPU this also makes the caching allocator reserve its
#   largest blocks first.) With AdamW the probe must run after the optimizer's state exists:
#   AdamW allocates it lazily at the end of its first `step()`, after that step's activations
#   are freed, so a step-0 probe would under-count every later step by 8 bytes per
#   parameter; plain SGD here keeps none;
# * **length cap**: the same rows, each truncated to L\* tokens: the peak is bounded, the
#   tokens past the cap are never trained;
# * **buckets + reserve at start**: bucketing by length with a token budget. Within windows
#   of 256 documents, sort by length and cut batches while rows × longest ≤ `ROWS` × L\*
#   tokens, then shuffle the batches: a long document comes with few rows, short ones with
#   many, and there is little padding. Its worst shape (a batch of block-size rows within the
#   token budget) is probed first: here reserving at start should pass.
#   (On a GPU without a flash kernel, attention also keeps an s × s score matrix per head,
#   so a token budget bounds it only if it is set for the longest s; on this CPU
#   scaled_dot_product_attention keeps only a·s floats per row, and the peak is linear in
#   tokens.)
#
# In full mode, the plain loader runs once more with the budget ignored (`stop_at_oom=False`),
# to show every step that would have failed.

# %%
batches = O.policy_batches(docs, ROWS, cap, max_tokens, steps)
runs = O.run_policies(docs, batches, BUDGET, MODEL, seed=SEED)
unbounded = None if QUICK else train_under_budget(
    docs, batches["pad to longest"], BUDGET, MODEL, seed=SEED, stop_at_oom=False,
    name="pad to longest")
O.peak_figure(runs, BUDGET, unbounded).show()
table(*O.policy_table(runs, docs.data.loss_floor))

# %%
cause = O.oom_cause(runs["pad to longest"], batches["pad to longest"])
if cause is None:
    say(f"pad to longest: no step over the budget in {steps} steps (P = "
        f"{math.exp(-STEPS_PER_MEAN):.0%} by the model); nothing to diagnose in this run")
else:
    fitted = runs["pad to longest"].survived
    say(f"pad to longest dies at step {cause['step']}, {cause['elapsed_s']:.2f} s in: its "
        f"batch pads to {cause['T']} tokens for one document of {cause['longest']} "
        f"(next longest {cause['second']}, median {cause['median']}); the "
        f"{len(fitted)} steps before it peaked at most "
        f"{O.highest_peak(fitted) / MiB:.2f} MiB of {BUDGET / MiB:.2f}")
if unbounded is not None:
    over = O.steps_over_budget(unbounded)
    worst = O.longest_step(unbounded)
    say(f"had it gone on: {len(over)} of {steps} steps over the budget "
        f"({len(over) / steps:.1%}; modelled p = {p_step:.1%}), the largest "
        f"{unbounded.max_peak / MiB:.2f} MiB at step {worst.step} ({worst.rows} × {worst.T})")

# %% [markdown]
# **The measured peak against the formula.** At these sizes activations outweigh the model,
# and the peak comes at the start of backward: every tensor saved for backward is alive,
# and the first two backward ops have written their gradients of the logits and of
# log_softmax's output (4·R·T·V bytes each). So a step of R rows padded to T tokens peaks at
# 4Ψ (parameters) + `distlab.theory.estimate.gpt_activation_bytes` (what the forward saves, the
# batch included) + 8·R·T·V. Tolerance 1%: the formula's only known residual is its batch
# term (it assumes inputs and targets are views of one array: 8·R bytes), while one missing
# saved tensor of one layer would be 4·R·T·h bytes, ~2.7% of the peak here.

# %%
checks = O.formula_checks(runs, MODEL, unbounded)  # each run's largest batch
table(*O.formula_table(checks))
worst_err = max(c["rel_err"] for c in checks.values())  # |measured − formula| / formula

# %% [markdown]
# ### 2. A leak: what the loop keeps
#
# The textbook leak is `history.append(loss)` where `loss.item()` was meant: the kept tensor
# holds its graph, and a graph holds what its forward saved for backward. Measured below,
# five ways of keeping the loss, each for a few steps (`distlab.studies.leak.leak_run`): live bytes at
# each step's end are `PeakMemoryTracker.current`, every aten-allocated storage still alive,
# taken off by a weakref callback the moment it is freed: exact to the byte for everything a
# step allocates here. "One step's activations" is `ActivationMeter`'s count for the forward
# whose result is kept.
#
# The finding to read in the table: `backward()` frees the saved tensors as it goes (that is
# why a second backward through the same graph fails), so a loss kept *after* its backward
# keeps only itself, a 4-byte scalar, and its graph's nodes (small objects on the host that
# the tracker does not see). The step's activations stay alive only when the kept graph was
# never backwarded (an evaluation loss computed without `torch.no_grad()`, kept for a plot)
# or backwarded with `retain_graph=True` (often added to silence "Trying to backward through
# the graph a second time"). Then memory grows by exactly one step's activations per step.

# %%
leaks = {k: leak_run(k, steps=LEAK_STEPS, seed=SEED) for k in KEEPS}
O.leak_figure(leaks).show()
table(*O.leak_table(leaks))
kept = {k: O.leak_summary(r) for k, r in leaks.items()}  # growth, activations, nodes per way

# %% [markdown]
# On a GPU the caching allocator rounds each tensor up to 512 bytes, so the kept scalars of
# `.detach()` (or of a loss kept after backward) cost 512 bytes a step: about 9 MiB after
# 18,000 steps, not an OOM. A kept graph with its activations costs a whole step's
# activations per step, and the run dies after (free memory) / (one step's activations)
# steps: minutes, not hours, unless it happens only at evaluation time, every N steps.

# %% [markdown]
# ### 3. Fragmentation of the CUDA caching allocator
#
# torch does not give freed GPU memory back to the driver: its caching allocator keeps the
# *segments* it got from `cudaMalloc` and carves blocks out of them. `torch.cuda.
# memory_allocated()` counts bytes in live blocks; `memory_reserved()` counts the segments,
# and reserved − allocated is free to torch but taken from everyone else. A large request is
# served from a free block at least as large, split if much larger; free blocks merge only
# with *adjacent* free blocks of the same segment. After hours of tensors of varying sizes
# (the variable-length batches above), free memory lies in holes between live blocks, and a
# request larger than every hole needs a new segment although the holes add up to more. The
# allocator's stats say so: fragmentation = 1 − allocated / reserved, `inactive_split_bytes`
# (free pieces of segments that still hold live blocks; `torch.cuda.empty_cache()` cannot
# release them, it releases only wholly free segments), and `num_alloc_retries` (cudaMalloc
# failed, the allocator freed every wholly free cached segment and tried again: a warning
# sign before the OOM, whose message then reports gigabytes "reserved but unallocated").
#
# Remedies: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (a segment is a virtual
# range that grows by mapping pages, so memory need not be contiguous in one cudaMalloc),
# `max_split_size_mb` (large blocks are never split), fewer distinct shapes (bucketing,
# padding to a few lengths), and `empty_cache()` between phases (wholly free segments only).
# `torch.cuda.set_per_process_memory_fraction(f)` caps what the process's allocator may hold
# at f × the device (to share a GPU, or to rehearse a smaller one): a request past it raises
# the OOM although the device has room. `distlab.studies.allocator_limits` measures both on a
# GPU (`tests/gpu/test_allocator_limits.py`); on a machine without one their rows below read
# "not measured here".
#
# `distlab.studies.fragmentation.measure_fragmentation` runs a workload that fragments on purpose:
# thirty 6 MiB tensors (three to a 20 MiB segment), every other one freed, then 14 MiB
# requests that no hole can hold; with `cap_mib` the process may hold only that much more, and
# the requests run out while the holes would hold them. It needs CUDA; `tests/gpu/
# test_fragmentation.py` runs it for real.

# %%
frag = measure_fragmentation(cap_mib=220)
if not frag.cuda:
    print(frag.reason)
else:
    print(f"{frag.device}, PYTORCH_CUDA_ALLOC_CONF={frag.allocator or '(default)'}: "
          f"{frag.large_granted} of 5 large requests granted; OOM: {frag.oom or 'none'}")
    table(*O.fragmentation_table(frag))

# %% [markdown]
# ### What the runs say

# %%
pad, res, capr, bkt = (runs[k] for k in ("pad to longest", "pad + reserve at start",
                                         "length cap", "buckets + reserve at start"))
floor = docs.data.loss_floor
all_tokens = O.tokens_in(batches["pad to longest"])
big = O.largest_batch(checks)
oom_claims = [
    claim("a rare long sequence can OOM a run hours in, with no code changed",
          "a common production failure (variable-length data)",
          "no OOM in this run" if cause is None else
          f"first OOM at step {cause['step']} of {steps} ({cause['elapsed_s']:.2f} s in): one "
          f"document of {cause['longest']} tokens (next {cause['second']}, median "
          f"{cause['median']}; {ROWS} rows fit up to {fit}); the {cause['step']} steps before "
          f"it fit; modelled p = {p_step:.1%} per step, mean {1 / p_step:.0f} steps",
          # holds: ≥ 10 steps trained first, and one document did it (the next row fits)
          cause is not None and cause["step"] >= 10 and cause["second"] <= fit),
    claim("the peak is rows × longest row: 4Ψ + activation formula + the logits' gradients",
          "distlab.theory.estimate.gpt_activation_bytes (Korthikanti et al. 2022's count, our GPT)",
          f"largest batch {big['rows']} × {big['T']}: measured {big['measured'] / MiB:.3f} "
          f"MiB, formula {big['predicted'] / MiB:.3f}; worst of all runs' largest batches "
          f"{worst_err:.3%} (tolerance 1%)",
          worst_err <= 0.01),
    claim("a length cap bounds the peak, at the cost of the tokens past the cap",
          "common practice",
          f"max peak {capr.max_peak / MiB:.3f} MiB ≤ {BUDGET / MiB:.2f}, no OOM in {steps} "
          f"steps; trained {capr.tokens_trained:,} of the same documents' {all_tokens:,} tokens",
          capr.first_oom is None and capr.max_peak <= BUDGET),
    claim("bucketing with a token budget bounds the peak", "common practice; fairseq's "
          "max_tokens",
          f"max peak {bkt.max_peak / MiB:.3f} MiB ≤ {BUDGET / MiB:.2f}, no OOM in {steps} "
          f"steps (its probe included); padding {bkt.padding_fraction:.0%} (pad to longest "
          f"{pad.padding_fraction:.0%}); {bkt.tokens_trained:,} tokens trained",
          bkt.first_oom is None and bkt.max_peak <= BUDGET),
    claim("reserving for the maximum at start moves the OOM to step 0", "common practice",
          f"pad + reserve: OOM at step {res.first_oom.step if res.first_oom else '—'} "
          f"({res.steps[0].peak / MiB:.2f} MiB probe, {res.steps[0].elapsed_s:.2f} s in), "
          f"not step {cause['step'] if cause else '—'}; buckets + reserve: probe "
          f"{bkt.steps[0].rows} × {bkt.steps[0].T} at {bkt.steps[0].peak / MiB:.3f} MiB fits, "
          f"{'no OOM after it' if bkt.first_oom is None else 'OOM after it'}",
          res.first_oom is not None and res.first_oom.step == 0 and res.first_oom.probe
          and bkt.first_oom is None),
    claim("the fixes still learn", "common practice",
          f"held-out loss: cap {capr.eval_before:.2f} → {capr.eval_after:.2f}, buckets "
          f"{bkt.eval_before:.2f} → {bkt.eval_after:.2f} (floor {floor:.2f}; learns: "
          f"{O.LEARN_SHARE:.0%} of the way down)",
          O.learned(capr, floor) and O.learned(bkt, floor)),
    claim("keeping the loss tensor (history.append(loss)) leaks one step's activations per "
          "step", "common practice",
          f"after backward(): +{kept['tensor']['growth']:.0f} B/step, "
          f"{kept['tensor']['ratio']:.6f} of a step's activations "
          f"({kept['tensor']['activations'] / 1024:.0f} KiB): backward freed them; the graph's "
          f"{kept['tensor']['nodes']:.0f} nodes/step stay, on the host",
          abs(kept["tensor"]["ratio"] - 1) < 0.01),
    claim("a kept graph that backward did not free leaks one step's activations per step",
          "torch.autograd (retain_graph)",
          f"retain_graph=True: +{kept['retain_graph']['growth']:,.0f} B/step; eval loss without "
          f"no_grad: +{kept['eval_tensor']['growth']:,.0f} B/step; activations + the 4-byte "
          f"loss: {kept['retain_graph']['activations'] + 4:,} B",
          all(kept[k]["growth"] == kept[k]["activations"] + 4 for k in ("retain_graph",
                                                                  "eval_tensor"))),
    claim("loss.item() keeps memory flat", "common practice",
          f".item(): +{kept['item']['growth']:.0f} B/step; .detach(): "
          f"+{kept['detach']['growth']:.0f} B/step (the kept scalar)",
          kept["item"]["growth"] == 0 and kept["detach"]["growth"] == 4),
]
# the allocator's rows: measured on a GPU, "not measured here" on this machine without one
oom_claims += O.gpu_allocator_claims(frag, measure_allocator_limits())
claims_table(oom_claims)
# rows that check our code: the formula, the fixes verified, the drill caught, the tracker exact
assert all(oom_claims[i]["holds"] for i in (1, 2, 3, 4, 7, 8)), \
    [oom_claims[i]["claim"] for i in (1, 2, 3, 4, 7, 8) if not oom_claims[i]["holds"]]
