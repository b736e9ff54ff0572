"""Training bugs, injected on purpose (RunConfig.bug), for the debugging drills.

Each is a mistake real training code makes, put into the one real loop (distlab.rank.train) by a
small hook, so that its symptom shows in the run's step events and distlab.debug.diagnose can find
it. The learning-rate drills need no bug: they are plain `lr` values.

    shuffled_labels   the targets are shuffled apart from the inputs: every row of the batch
                      gets another row's targets (a roll by one row, so no row keeps its own).
                      Nothing in x predicts y, and the best a model can do is the marginal
                      of the next token: the loss stalls at MarkovData.unigram_entropy.
    zero_init         every nn.Linear's weight and bias set to 0 before training. Each unit
                      of a layer computes the same output and gets the same gradient, so no
                      step can make them differ (symmetry); here both Linears of every branch
                      are 0, so the gradient of each is 0 too, and the blocks never start.
    no_zero_grad      optimizer.zero_grad() forgotten: .grad keeps every earlier step's
                      gradient, so each step applies the sum of all gradients so far.
    loss_not_divided  with grad_accum = k micro-batches, each micro-batch's mean loss is not
                      divided by k: the accumulated gradient is k times the batch's (an SGD
                      step k times too long), and the logged loss k times the mean.
    same_rows         a sampler that ignores the rank: every rank reads rank 0's rows, so
                      the world trains on 1/N of the global batch, N times over.

The loop calls (one line each): `bugs.initialise(model)` after building the model,
`batch = bugs.rows(batch, data, step)` after the strategy read its rows,
`model(x, y) / bugs.loss_divisor` per micro-batch, and `if bugs.zero_grad:` around the
optimizer's zero_grad.
"""

from __future__ import annotations

import torch

class Bugs:
    """The hooks of RunConfig.bug on one rank; with bug="none" each is what correct code does."""

    def __init__(self, cfg, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.bug = cfg.bug
        # correct code divides each micro-batch's mean loss by the micro-batch count
        self.loss_divisor = 1 if self.bug == "loss_not_divided" else cfg.grad_accum
        self.zero_grad = self.bug != "no_zero_grad"
        self._reader = None  # same_rows on a finite dataset: rank 0's sampler

    def initialise(self, model: torch.nn.Module) -> None:
        if self.bug != "zero_init":
            return
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.zero_()
                    if m.bias is not None:
                        m.bias.zero_()

    def rows(self, batch, data, step: int):
        """This rank's (x, y) for the step as the bug reads them (None stays None)."""
        if batch is None or self.bug not in ("shuffled_labels", "same_rows"):
            return batch
        x, y = batch
        if self.bug == "shuffled_labels":
            return x, y.roll(1, dims=0)  # row i trains on row i-1's targets
        return self._rank0_rows(data, step)

    def _rank0_rows(self, data, step: int):
        """What rank 0 reads at this step: its block of the global batch, or its next batch
        from the distributed sampler (a sampler built with rank=0 on every rank)."""
        cfg = self.cfg
        if not cfg.dataset_size:
            return data.rank_batch(step, cfg.global_batch, 0, self.world)
        if self._reader is None:
            from distlab.data.sampler import shard_reader
            self._reader = shard_reader(cfg, data, 0, self.world)
        return self._reader.batch(step)
