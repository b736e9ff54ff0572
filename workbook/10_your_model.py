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
# # 10 · Your own model: distlab's strategies on a model this notebook defines
#
# Every notebook so far trained distlab's own tiny GPT. This one writes a model of its own
# (not a GPT: a token counter) into a file, and hands it to the same training loop by
# import path:
#
#     RunConfig(strategy="zero2", world_size=2,
#               model="runs/your_model.py:make_model", data="runs/your_model.py:make_data")
#
# The contract (`distlab.models.factory`): `make_model(cfg)` returns an `nn.Module` whose
# `forward(x, y)` returns the mean loss; `make_data(cfg)` returns an object whose
# `global_batch(step, batch)` returns the step's `(x, y)`, the same in every process. Both are
# imported and run once (one forward) in this kernel before any rank starts, so a typo is an
# error here, not four tracebacks from the ranks.
#
# The same model then runs under DDP, ZeRO-2, ZeRO-3 (fp32, and with a bf16
# mixed-precision policy as FSDP2's) and Megatron tensor parallelism (by the plan the model
# carries), and each is set beside one process training the same global batch. At the end:
# the same run from a terminal under `python -m distlab` (and torchrun), and the control panel
# with this model in it. The four library calls behind these strategies, for a training loop
# of your own, are in docs/your_model.md ("Use it on your model").

# %% tags=["parameters"]
import os

# CI sets WORKBOOK_QUICK=1: fewer steps (the model is small either way).
QUICK = os.environ.get("WORKBOOK_QUICK", "0") == "1"
STEPS = 20 if QUICK else 80       # SGD steps of every comparison run
WORLD = 2                         # ranks of every parallel run
os.makedirs("runs", exist_ok=True)  # where this notebook writes its model (git ignores runs/)

# %% [markdown]
# ## 1. The model, written by this notebook
#
# A spawned rank cannot import a notebook's cells, so the model lives in a file the ranks can
# import: the cell below writes it. It reads 16 tokens and says which of the tokens 0–3 occurs
# most often (ties go to the larger one). Blocks of LayerNorm and an MLP act on every token,
# the mean over the tokens feeds the head. `tp_plan` is read only by `strategy="tp"`: the
# MLP's widening Linear split by columns, its narrowing one by rows (Megatron's MLP, Shoeybi
# et al. 2019), so each block needs one all-reduce forward and one backward.

# %%
# %%writefile runs/your_model.py
"""A model of our own, not distlab's GPT: which of the tokens 0-3 occurs most often."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from distlab import ColwiseParallel, RowwiseParallel

VOCAB, TOKENS, CLASSES, WIDTH = 32, 16, 4, 64


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


class TokenCounter(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(layers))
        self.head = nn.Linear(WIDTH, CLASSES)
        self.tp_plan = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}

    def forward(self, x, y):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h.mean(1)), y)


def make_model(cfg):
    torch.manual_seed(cfg.seed)  # every rank builds the same model
    return TokenCounter()


class Counting:
    loss_at_start = math.log(CLASSES)  # a uniform guess over the classes

    def global_batch(self, step, batch):
        g = torch.Generator().manual_seed(step)  # the step's rows, the same in every process
        x = torch.randint(VOCAB, (batch, TOKENS), generator=g)
        counts = torch.stack([(x == c).sum(1) for c in range(CLASSES)], 1)
        return x, (counts * CLASSES + torch.arange(CLASSES)).argmax(1)


def make_data(cfg):
    return Counting()

# %%
from IPython.display import Markdown, display

from distlab import RunConfig
from distlab.lab import ControlPanel
from distlab.lab.common import claim, claims_table, table
from distlab.lab.runs import max_step_loss_diff
from distlab.lab.your_model import all_gather_bytes, compare, loss_figure, rows, worst_diffs

MODEL, DATA = "runs/your_model.py:make_model", "runs/your_model.py:make_data"
# SGD in fp32: the update is linear in the gradient, so the parallel runs can be compared
# with one process to float32 rounding (see the tolerance below)
BASE = RunConfig(model=MODEL, data=DATA, steps=STEPS, optimizer="sgd", lr=0.3,
                 global_batch=32, timeout_s=60, threads_per_rank=1)
VARIANTS = {
    "ddp": dict(strategy="ddp", world_size=WORLD),
    "zero2": dict(strategy="zero2", world_size=WORLD),
    "zero3": dict(strategy="zero3", world_size=WORLD),
    "zero3, bf16 policy": dict(strategy="zero3", world_size=WORLD, param_dtype="bf16",
                               reduce_dtype="fp32"),
    "tp": dict(strategy="tp", world_size=WORLD, tp=WORLD),
}

# %% [markdown]
# ## 2. Every strategy against one process
#
# `compare` trains `single` (one process) and then every variant on 2 ranks, each on the same
# global batch of 32 rows per step. DDP, ZeRO-2 and ZeRO-3 give each rank 16 of the rows and
# average the gradients; tensor parallelism gives every rank all 32 rows and half of each MLP.
# The bf16 policy casts the fp32 master shards to bf16 before each all-gather, computes in
# bf16 and reduce-scatters the gradients in fp32 (`param_dtype="bf16"`,
# `reduce_dtype="fp32"`: `distlab.MixedPrecisionPolicy`, as FSDP2's).

# %%
single, runs = compare(BASE, VARIANTS)
loss_figure(single, runs).show()
table(["run", "strategy", "max |Δ loss| per step vs single", "max |Δ parameter| vs single",
       "rank 0's bytes per step (booked)"], rows(single, runs))

# %% [markdown]
# **Tolerances.** In fp32 the parallel runs differ from one process only in the order of
# summation: the mean of two 16-row means instead of one 32-row mean (tp: each rank sums half
# of the MLP's hidden units, then the all-reduce adds the halves). That is a few float32 ulps
# (2^-23 ≈ 1.2e-7 relative) per step, and SGD adds it up without amplifying it; the check
# allows 1e-5, far below the ~1e-2 a wrong gradient (one rank's rows missing, a sum that
# should have been a mean) moves a parameter. bf16 keeps 8 significant bits (2^-9 ≈ 2e-3
# relative) in every cast, so its run differs from fp32 for real; it is asked to stay within
# 5e-2 of single on every loss, 25 times bf16's relative precision on a loss near 1 (the
# measured figure is in the table), and to differ from it by more than fp32's rounding, which
# shows that the cast took place.

# %%
worst = worst_diffs(single, runs)
fp32_labels = [label for label in runs if "bf16" not in label]
bf16_loss_gap = max_step_loss_diff(runs["zero3, bf16 policy"].losses(), single.losses())
gather_fp32 = all_gather_bytes(runs["zero3"])
gather_bf16 = all_gather_bytes(runs["zero3, bf16 policy"])
display(Markdown(
    f"Largest fp32 parameter difference: **{max(worst[k] for k in fp32_labels):.1e}** "
    f"({', '.join(f'{k} {worst[k]:.1e}' for k in fp32_labels)}). bf16 policy: loss within "
    f"**{bf16_loss_gap:.3f}** of single per step; its all-gathers moved "
    f"**{gather_bf16:,} B** per step against fp32's **{gather_fp32:,} B**."))

# %% [markdown]
# ## 3. From a terminal: `python -m distlab`, and torchrun
#
# The command line takes the same two fields. It launches the ranks itself, or, under
# `torchrun --nproc_per_node=2 -m distlab ...`, runs as one of torchrun's workers; either way
# one rank prints a line every `--log-every` steps (loss, tokens per second, memory, bytes on
# the wire) and a summary at the end.

# %%
import subprocess
import sys

cmd = [sys.executable, "-m", "distlab", "--strategy", "zero2", "--world-size", "2",
       "--model", MODEL, "--data", DATA, "--optimizer", "sgd", "--lr", "0.3",
       "--global-batch", "32", "--steps", str(STEPS), "--log-every", str(max(1, STEPS // 4))]
terminal = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
print(" ".join(["python"] + cmd[1:]) + "\n")
print(terminal.stdout)
assert terminal.returncode == 0, terminal.stderr[-2000:]
printed_done = [line for line in terminal.stdout.splitlines() if line.startswith("done: ")]

# %% [markdown]
# ## 4. The control panel with your model
#
# `ControlPanel(model=..., data=...)` imports the model once when it is built and offers only
# the strategies that can run it: those that would reach into the GPT's layers by name
# (pipeline stages, 3D, the DTensor variant, `dp`'s logits) are not in the list. Pick one and
# press Run.

# %%
panel = ControlPanel(model=MODEL, data=DATA, strategy="zero3", world_size=2, steps=STEPS,
                     optimizer="sgd", lr=0.3, global_batch=32, threads_per_rank=1)
panel

# %%
panel.run().wait(timeout=300)  # the same as pressing Run, then waiting for it
print(panel.status_text)
offered = panel.knobs["strategy"].options

# %% [markdown]
# ## What the textbook says, what this run measured
#
# Every verdict is computed from this notebook's runs and can come out **no**.

# %%
rows_ = [
    claim("DDP trains your model exactly as one process does", "Li et al. 2020 (PyTorch DDP)",
          f"max |Δ parameter| {worst['ddp']:.1e} after {STEPS} steps", worst["ddp"] <= 1e-5),
    claim("ZeRO-2 and ZeRO-3 change where state lives, not the training",
          "Rajbhandari et al. 2020 (ZeRO)",
          f"zero2 {worst['zero2']:.1e}, zero3 {worst['zero3']:.1e}",
          max(worst["zero2"], worst["zero3"]) <= 1e-5),
    claim("tensor parallelism (Megatron's MLP split) computes the same model",
          "Shoeybi et al. 2019 (Megatron-LM)", f"max |Δ parameter| {worst['tp']:.1e}",
          worst["tp"] <= 1e-5),
    claim("a bf16 policy with fp32 master weights tracks fp32 training",
          "Micikevicius et al. 2018 (mixed precision); FSDP2's MixedPrecisionPolicy",
          f"loss within {bf16_loss_gap:.3f} per step; parameters {worst['zero3, bf16 policy']:.1e}"
          " from fp32", 1e-5 < worst["zero3, bf16 policy"] and bf16_loss_gap <= 5e-2),
    claim("casting before the all-gather halves its bytes", "FSDP2 docs (param_dtype)",
          f"{gather_bf16:,} B vs {gather_fp32:,} B per step", 2 * gather_bf16 == gather_fp32),
    claim("the model learns", "this notebook's data: counts are linear in the mean embedding",
          f"single: loss {single.losses()[0]:.3f} → {single.losses()[-1]:.3f}",
          single.losses()[-1] < 0.8 * single.losses()[0]),
    claim("the command line runs your model and reports progress", "distlab.caller.progress",
          printed_done[0] if printed_done else "no summary line",
          terminal.returncode == 0 and len(printed_done) == 1),
    claim("the panel offers only strategies that can run your model", "Strategy.any_model",
          f"offered: {', '.join(offered)}; panel run {panel.last_run.status}",
          "pp" not in offered and "3d" not in offered and panel.last_run.status == "done"),
]
claims_table(rows_)
assert all(r["holds"] for r in rows_), [r["claim"] for r in rows_ if not r["holds"]]
