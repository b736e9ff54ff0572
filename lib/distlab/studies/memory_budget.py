"""A device memory budget, held against each training step's measured peak, in this process.

This is a CPU: nothing here runs out of memory. We *model* a device of `budget` bytes: a step
whose measured peak (distlab.memory.PeakMemoryTracker: the bytes aten ops allocated and still
held, at their highest in the step; the CPU stand-in for torch.cuda.max_memory_allocated)
exceeds the budget is the step where a device of that size would have raised "CUDA out of
memory". With stop_at_oom the run dies there, as a real one would.

    run = train_under_budget(docs, batches, budget=3 * MiB, model_cfg=GPTConfig(...))
    run.steps                 # StepRecord per step: shape, tokens, peak, loss, elapsed time
    run.first_oom             # the first step over the budget (None if every step fit)
    run.tokens_trained        # real tokens of the steps that ran before it
    predicted_peak(model_cfg, rows, T)   # the same peak by formula (below)

**The peak by formula.** With activations outweighing the model (true here), a step's peak
comes at the start of backward, when every tensor saved for backward is alive and the first
two backward ops have written their V-wide gradients (of log_softmax's output and of the
logits, 4·R·T·V bytes each). So

    peak = 4Ψ (parameters; plain SGD keeps no optimizer state, and the gradients are freed at
           every step's end)
         + gpt_activation_bytes (distlab.theory.estimate: what the forward saves, the batch included)
         + 8·R·T·V  (the two gradients above)

for a batch of R rows padded to T tokens. The formula's batch term assumes the inputs and
targets are views of one (R, T+1) array (distlab.data.dataset's batches); here they are two (R, T)
arrays, 8·R bytes fewer: the measured peak is within tens of bytes of the formula.

Plain SGD, not AdamW, on purpose: AdamW allocates its state (8 bytes per parameter) lazily at
the end of its first step(), after that step's activations are freed, so step 0's peak
under-counts every later step by that much, and a reserve-at-start probe run at step 0 would
say "fits" for a shape that fails at step 1. A probe with Adam must run after the state
exists (or initialise it first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from distlab.config import RunConfig
from distlab.theory.estimate import gpt_activation_bytes, gpt_params
from distlab.studies.long_sequences import Batch, Documents
from distlab.memory import ActivationMeter, PeakMemoryTracker
from distlab.models.gpt import GPT, GPTConfig


@dataclass(frozen=True)
class StepRecord:
    step: int
    rows: int
    T: int  # padded length (the longest row)
    tokens: int  # real tokens trained
    padded_tokens: int  # rows × T: what the step computes on
    probe: bool  # reserve_first's probe step
    live_before: int  # bytes alive as the step begins: parameters and the batch
    peak: int  # PeakMemoryTracker's peak of the step
    activations: int  # ActivationMeter: bytes saved for backward
    loss: float  # mean over the real tokens
    elapsed_s: float  # since the run began, at this step's end
    oom: bool  # peak > budget


@dataclass
class BudgetRun:
    name: str
    budget: int
    steps: list[StepRecord] = field(default_factory=list)
    eval_before: float = float("nan")  # held-out loss before training and after
    eval_after: float = float("nan")
    wall_s: float = 0.0

    @property
    def first_oom(self) -> StepRecord | None:
        return next((s for s in self.steps if s.oom), None)

    @property
    def survived(self) -> list[StepRecord]:
        """The steps that ran before the first OOM: what a real run would have trained."""
        stop = self.first_oom
        return [s for s in self.steps if stop is None or s.step < stop.step]

    @property
    def tokens_trained(self) -> int:
        return sum(s.tokens for s in self.survived)

    @property
    def max_peak(self) -> int:
        return max(s.peak for s in self.steps)

    @property
    def padding_fraction(self) -> float:
        """Share of the computed (padded) tokens that were padding, over the steps run."""
        done = self.survived or self.steps
        padded = sum(s.padded_tokens for s in done)
        return 1.0 - sum(s.tokens for s in done) / padded if padded else 0.0


def predicted_peak(model_cfg: GPTConfig, rows: int, T: int) -> int:
    """A step's peak bytes by formula (module doc): 4Ψ + gpt_activation_bytes + 8·R·T·V."""
    c = model_cfg
    psi = gpt_params(c.n_layer, c.n_embd, c.vocab_size, c.block_size, c.mlp_ratio)
    run_cfg = RunConfig(n_layer=c.n_layer, n_embd=c.n_embd, n_head=c.n_head,
                        vocab_size=c.vocab_size, mlp_ratio=c.mlp_ratio, seq_len=T,
                        global_batch=rows)
    return 4 * psi + gpt_activation_bytes(run_cfg) + 8 * rows * T * c.vocab_size


def fit_length(model_cfg: GPTConfig, rows: int, budget: int) -> int:
    """The longest padded length T ≤ block_size whose predicted peak with `rows` rows fits
    the budget (0 if none does): the cap, and rows × it the token budget, that the budget
    allows."""
    lo, hi = 0, model_cfg.block_size  # the peak grows with T: bisect for the last that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if predicted_peak(model_cfg, rows, mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def held_out_loss(model, docs: Documents, rows: int = 4) -> float:
    """Loss on held-out full-length rows (MarkovData.eval_batch: no document uses them)."""
    x, y = docs.data.eval_batch(0, rows)
    with torch.no_grad():
        return float(model(x, y))


def train_under_budget(docs: Documents, batches: list[Batch], budget: int,
                       model_cfg: GPTConfig, lr: float = 0.3, seed: int = 0,
                       stop_at_oom: bool = True, name: str = "") -> BudgetRun:
    """Train distlab's GPT on `batches` (plain SGD, one process), measuring each step's peak
    against `budget` bytes. With stop_at_oom the run ends at the first step over the budget
    (that step is recorded; its tokens are not counted as trained); without, every step runs
    and each one over the budget is marked."""
    torch.manual_seed(seed)
    model = GPT(model_cfg)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    tracker = PeakMemoryTracker()
    tracker.adopt([*model.parameters(), *model.buffers()])
    meter = ActivationMeter(model)
    run = BudgetRun(name, budget, eval_before=held_out_loss(model, docs))
    t0 = time.perf_counter()
    for i, batch in enumerate(batches):
        x, y = docs.padded(batch)
        tracker.step_begin(x, y)
        live = tracker.current
        with meter.measure():
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peak = tracker.step_end()
        rec = StepRecord(i, batch.rows, batch.T, batch.tokens, batch.padded_tokens, batch.probe,
                         live, peak, meter.bytes, loss.item(), time.perf_counter() - t0,
                         peak > budget)
        run.steps.append(rec)
        del x, y, loss
        if rec.oom and stop_at_oom:
            break
    run.wall_s = time.perf_counter() - t0
    run.eval_after = held_out_loss(model, docs)
    return run
