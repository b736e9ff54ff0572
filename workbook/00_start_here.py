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
# # 00 · Start here
#
# This workbook teaches distributed training by running it. Each notebook explains one
# technique, launches real multi-process training runs of it on this machine (one process
# per rank, talking through `torch.distributed`), and plots what the run measures while it
# runs: the loss, the memory each rank holds by category, and the bytes each rank puts on
# the wire. Every piece of code lives in the `distlab` library; the notebooks only call it.
# Nothing a notebook says is a claim that its runs do not measure: the checks in these
# cells are `assert`s on measured values.
#
# This notebook shows how to launch a run, read the live dashboard, compare a run on one
# process with the same run on four, find a run's files, and use the control panel.
# Coming next: `01_collectives` (all-reduce from send/recv and the α-β cost model), then
# `02_data_parallel` (DP, parameter servers, DDP), `03_memory_and_precision` (memory per rank,
# mixed precision, activation checkpointing), `04_zero_and_fsdp`, `05_tensor_parallel`,
# `06_pipeline_parallel`, `07_3d_parallelism`, `08_lora_finetuning`,
# `09_checkpoints_and_faults`, `10_your_model`, `11_debugging`, `12_out_of_memory`,
# `13_search_and_time` (hyper-parameter search and the time to train), and the last two
# dimensions: `14_long_context` (context parallelism: ring attention and Ulysses) and
# `15_experts` (mixture of experts and expert parallelism). `16_exercises` has you write a ring
# all-reduce, a DDP bucket hook, a ZeRO-1 step, Megatron's linears and the 1F1B schedule
# yourself, each checked on real ranks. `17_multi_node` runs DDP on simulated nodes joined by a
# slow link, one torchrun agent per node, and measures what the link does to the step;
# `18_across_nodes` asks, over the same nodes, what to shard and where to place each kind of
# parallelism, and kills a node mid-run.
# The [interview index](../docs/interview_index.md) lists the interview questions the workbook
# answers, each with the section that answers it and what its runs measured.

# %% tags=["parameters"]
import os

# CI sets WORKBOOK_QUICK=1: a tiny model and few steps, so the notebook runs in seconds.
QUICK = os.environ.get("WORKBOOK_QUICK", "0") == "1"
# Full mode: 50 steps, where RunConfig's GPT has closed most of the gap to the loss floor and
# its curve has flattened (the cell under the dashboard prints how much): more steps would
# only delay the 4-rank comparison that follows.
STEPS = 30 if QUICK else 50
MODEL = dict(n_layer=2, n_embd=64, n_head=4) if QUICK else {}  # {}: RunConfig's GPT

# %%
from distlab import Run, RunConfig, lab, launch
from distlab.comm import ring_allreduce_bytes
from distlab.lab.common import claim, claims_table
from distlab.lab.runs import in_rank_step_order, median_step_change
from distlab.lab.start_here import allocated_bytes, memory_rows

# %% [markdown]
# ## Launching a first run
#
# A `RunConfig` holds every knob of a run and checks them before any process starts.
# `launch(cfg)` spawns the ranks and returns a `Run` handle at once; training goes on in
# the background. `lab.watch(run)` shows a live dashboard under the cell, and
# `run.wait()` blocks until the run ends (interrupting the kernel stops the run). When
# the cell ends with its runs over, the live figure gives way to a static copy of its last
# drawing: a live figure lives in the kernel and would not survive a reload, the copy is
# saved with the notebook.
#
# The first run uses strategy `single`: one process trains on the whole batch. It is the
# baseline every parallel strategy in this workbook is compared with.

# %%
cfg = RunConfig(strategy="single", steps=STEPS, **MODEL)
single = launch(cfg)
dash = lab.watch(single)
single.wait()

# %% [markdown]
# ## Reading the live dashboard
#
# **Loss** (top): the mean cross-entropy per token at each step, averaged over ranks. The
# data is a random Markov chain generated on this machine (`distlab.data.dataset`): each token can
# be followed by only a few others, with fixed probabilities. So the best achievable loss
# is known exactly: the entropy of the chain, drawn as the dashed *loss floor*. An
# untrained model guesses uniformly and starts near ln(vocabulary size).

# %%
losses = single.losses()
floor, start = single.info("loss_floor"), single.info("loss_at_start")
print(f"loss at step 0: {losses[0]:.3f}   (uniform guess, ln V = {start:.3f})")
print(f"loss at step {len(losses) - 1}: {losses[-1]:.3f}")
print(f"loss floor:     {floor:.3f}   (entropy of the chain: no model can do better)")
print(f"gap to the floor closed: {(losses[0] - losses[-1]) / (losses[0] - floor):.0%}")
assert len(losses) == STEPS
# It learned: more than half of the way from where it started to the floor.
assert losses[-1] - floor < 0.5 * (losses[0] - floor)

# %% [markdown]
# **Memory** (middle): what one rank holds, by category, measured from the tensors
# themselves at the latest step: parameters, gradients, optimizer state, activations (the
# tensors autograd saved for the backward pass) and scratch buffers of the collectives.
# In fp32 each parameter takes 4 bytes; a gradient is a tensor of the same shape; AdamW
# keeps two more (its first and second moment) plus a step counter per tensor.
#
# The dashboard's bytes are numel × element_size of each tensor, so "4 bytes per parameter"
# set against them would be an identity. `allocated_bytes` reads them where they are
# allocated instead: it builds the run's model from its config and seed in this kernel under
# `distlab.memory.PeakMemoryTracker` (every storage aten ops make, with its size, until it is
# freed), then runs one backward and frees the loss (what is left is the gradients), then one
# AdamW step (what it adds is its state).

# %%
n_params = single.info("n_params")
mem = single.history("step")[-1]["memory"]
for key, name in lab.MEMORY_CATEGORIES:
    print(f"{name:>16}: {mem[key] / lab.MiB:7.3f} MiB  ({mem[key]:,} bytes)")
alloc = allocated_bytes(cfg)
print(f"allocated for the model's {alloc['n_params']:,} parameters: {alloc['params']:,} bytes "
      f"({alloc['params'] / alloc['n_params']:g} per parameter); left by one backward: "
      f"{alloc['grads']:,} bytes")
assert alloc["n_params"] == n_params  # the same model as the run's
print(f"allocated by AdamW's first step: {alloc['optim']:,} bytes = 2 × parameters + "
      f"{alloc['optim'] - 2 * alloc['params']} bytes of step counters")
# the run counted what this kernel allocated
assert (mem["params"], mem["grads"], mem["optim"]) == (alloc["params"], alloc["grads"],
                                                       alloc["optim"])
adam_counters = mem["optim"] - 2 * mem["params"]  # AdamW's step counters, 4 bytes a tensor

# %% [markdown]
# **Bytes** (bottom): how many bytes each rank sent during one step, summed over
# the collectives it called (hover over a bar for the breakdown). A single process talks
# to no one, so this run sent nothing.

# %%
sent_single = [lab.bytes_sent(e) for e in single.history("step")]
print(f"bytes sent by the single run, all steps: {sum(sent_single)}")
assert sum(sent_single) == 0

# %% [markdown]
# ## Ranks and world size
#
# A distributed run is `world_size` processes, the *ranks*, each running the same
# training loop. Strategy `ddp` is data parallelism as PyTorch's DistributedDataParallel
# does it (written out in `distlab`; `02_data_parallel` takes it apart): every rank holds
# the whole model, takes its own quarter (with four ranks) of the same global batch, and
# the ranks average their gradients with *all-reduces*, started during the backward pass
# as soon as a bucket of gradients is ready. The average of the four quarters' gradients is
# the gradient of the whole batch, so the four-rank run should retrace the single run step
# by step. Same global batch, same seed; only the strategy and the world size change. The
# dashboard below draws the single run (finished) and the four ranks' run live, on one
# loss plot.

# %%
four = launch(cfg.replace(strategy="ddp", world_size=4))
dash4 = lab.watch(single, four)
four.wait()

# %% [markdown]
# The two loss curves lie on top of each other. How close is close enough? In fp32 the
# only difference between the runs is the order of additions (quarter-batch means averaged
# across ranks, instead of one mean over the whole batch). Each such rounding is about
# 1e-7 relative; repeated over the steps of training we measured per-step loss differences
# of a few 1e-7 (quick mode's small model) up to 2e-5 (RunConfig's GPT, whose loss starts
# near 4). We allow `1e-4`: well above rounding, and still far below
# (the cell checks: at least ten times below) the typical change of the loss from one step
# to the next, which a rank training on the wrong rows or missing a gradient would show.

# %%
TOL = 1e-4
a, b = single.losses(), four.losses()
diff = max(abs(x - y) for x, y in zip(a, b))
step_change = median_step_change(a)
print(f"largest per-step loss difference, single vs ddp×4: {diff:.1e}")
print(f"median change of the loss from one step to the next:     {step_change:.1e}")
assert len(a) == len(b) == STEPS
assert diff < TOL
assert 10 * TOL < step_change  # the tolerance could not hide a real divergence

# %% [markdown]
# Now the bytes. Gradients are fp32, so one step's gradients are `4 × n_params` bytes.
# An all-reduce of S bytes done the bandwidth-optimal way (a ring) sends 2(N−1)/N · S
# bytes from each of the N ranks: 1.5 S with four ranks. DDP packs the gradient tensors
# into *buckets* of at most `bucket_mb` (0.25 MiB here) and all-reduces each bucket as one
# flat buffer: a few large messages instead of one small one per tensor. `distlab.comm`
# *books* the backend's all-reduce with the formula, one call per bucket. What went on the
# wire is measured separately: Linux counts the bytes each process writes to its sockets
# (`distlab.wire`), and the dashboard draws both bars, booked and on the wire. The small
# excess on the wire is the backend's framing: gloo puts a 48-byte header on every message
# (`01_collectives` measures it); the cell prints it per call.

# %%
grad_bytes = 4 * four.info("n_params")
expected = ring_allreduce_bytes(grad_bytes, 4)
events = four.history("step")
sent = {lab.bytes_sent(e) for e in events}
calls = {e["comm"]["all_reduce"]["calls"] for e in events}
n_tensors = alloc["n_tensors"]  # the model's parameter tensors
print(f"gradient bytes per step: {grad_bytes:,}, in {n_tensors} tensors")
print(f"2(N-1)/N × gradient bytes, N = 4: {expected:,.0f}")
print(f"booked bytes per rank per step: {sorted(sent)}, in {sorted(calls)} calls (buckets)")
on_wire = [lab.wire_sent(e) for e in events]
# gloo's framing: a few KiB per bucket of hundreds of KiB (measured +0.5% here, 48 bytes a
# message in 01_collectives); 10% would mean traffic the formula misses (an all-gather of the
# gradients alone would add +50%)
WIRE_TOL = 0.10
if on_wire[0] is None:
    print(f"on the wire: not measured here ({events[0]['wire']['why']})")
else:
    overhead = max(on_wire) / expected - 1
    print(f"on the wire per rank per step: {min(on_wire):,} to {max(on_wire):,} bytes, "
          f"{overhead:+.1%} over the formula, {(max(on_wire) - expected) / max(calls):,.0f} "
          "bytes per call")
    assert 0 <= min(on_wire) / expected - 1 and overhead < WIRE_TOL, on_wire
assert len(events) == 4 * STEPS
assert sent == {expected}
(n_buckets,) = calls  # every step all-reduces every bucket once...
assert n_buckets < n_tensors  # ... and a bucket holds several gradient tensors

# %%
mem4 = {e["rank"]: e["memory"] for e in four.history("step") if e["step"] == STEPS - 1}
for r, m in mem4.items():
    print(f"rank {r}: " + ", ".join(f"{name} {m[key] / lab.MiB:.3f}"
                                    for key, name in lab.MEMORY_CATEGORIES) + " (MiB)")
for m in mem4.values():
    # Data parallelism copies the model: each rank holds all of it.
    assert (m["params"], m["grads"], m["optim"]) == (mem["params"], mem["grads"], mem["optim"])
    # DDP's buckets: one flat buffer per bucket, together as large as the gradients.
    assert m["comm_buffers"] == m["grads"]
    # Activations follow the rows a rank holds: a quarter of the batch, a quarter of the
    # activations, up to a few KiB saved whatever the batch size (position indices and the
    # like), which each of the four ranks holds in full.
    assert abs(4 * m["activations"] - mem["activations"]) < 0.01 * mem["activations"]

# %% [markdown]
# ## Where runs are stored
#
# Each run gets a folder under `$DISTLAB_RUNS` (or `./runs`): `config.json` (the
# RunConfig), one event log per rank (`rank<r>.jsonl`, one JSON object per line, flushed
# as it happens, so a crash loses nothing already written), each rank's stderr
# (`rank<r>.stderr`: warnings, a backend's last words before an abort) and `status.json`
# (how it ended). `Run.load(folder)` reopens a run without starting anything.

# %%
import json

print(four.dir)
for name in sorted(os.listdir(four.dir)):
    print(f"  {name:12} {os.path.getsize(os.path.join(four.dir, name)):8,} bytes")
with open(os.path.join(four.dir, "rank1.jsonl")) as f:
    print(json.dumps(json.loads(f.readlines()[1]), indent=1)[:800])  # rank 1's first step

# %%
again = Run.load(four.dir)
print(again)
assert again.status == "done" and again.cfg == four.cfg
assert again.losses() == four.losses()
assert in_rank_step_order(again.history("step")) == in_rank_step_order(four.history("step"))

# %% [markdown]
# ## The control panel
#
# The panel builds a `RunConfig` from its knobs and launches it when you press **Run**;
# the button returns at once, so the kernel stays free and **Stop** can end the run. Its
# dashboard keeps every run you start, so you can compare them: try world size 2 or 4
# (the strategy switches to `allreduce`, since `single` is one process), the `ring` or
# `naive` all-reduce, `bf16`, or a larger learning rate. A failing rank's traceback is
# shown under the status line.

# %%
panel = lab.ControlPanel(steps=STEPS, **MODEL)
panel

# %% [markdown]
# ## What the textbook says, what the runs measured

# %%
wire_ok = on_wire[0] is None or all(0 <= w / expected - 1 < WIRE_TOL for w in on_wire)
rows = [
    claim("no model beats the entropy of the data; training closes the gap to it",
          "Shannon 1948 (the chain's entropy rate)",
          f"floor {floor:.3f}; loss {losses[0]:.3f} at step 0, {losses[-1]:.3f} at step "
          f"{len(losses) - 1} ({(losses[0] - losses[-1]) / (losses[0] - floor):.0%} of the gap)",
          floor - 0.05 < losses[-1] < losses[0]),
    *memory_rows(alloc),
    claim("data parallelism computes what one process computes",
          "the gradient of a mean is the mean of the gradients",
          f"ddp×4 vs single, largest per-step loss difference {diff:.1e} "
          f"(tolerance {TOL:g})", diff < TOL),
    claim("a ring all-reduce sends 2(N−1)/N × the gradient bytes per rank",
          "Patarasuk & Yuan 2009",
          f"formula {expected:,.0f}; booked {', '.join(f'{s:,}' for s in sorted(sent))}; on the "
          "wire " + ("not measured here" if on_wire[0] is None else
                     f"{min(on_wire):,} to {max(on_wire):,} (the excess: gloo's headers)"),
          sent == {expected} and wire_ok),
]
claims_table(rows)
assert all(r["holds"] for r in rows), [r["claim"] for r in rows if not r["holds"]]
