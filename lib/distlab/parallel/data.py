"""Data parallelism: every rank holds the whole model and a slice of the global batch.

`allreduce` is the simplest correct form: after backward, every gradient is averaged across
ranks, one tensor at a time, by the all-reduce algorithm in RunConfig.allreduce (the backend's,
or the ring or gather-to-root versions written in distlab.comm). Because each rank's loss is
the mean over its equal slice, the average of the ranks' gradients is exactly the gradient of
the global batch's mean loss, so the run follows `single` step for step.
"""

from __future__ import annotations

import torch

from .base import Strategy


class Single(Strategy):
    """One process, the whole global batch: the baseline every strategy is checked against."""


class AllReduceDP(Strategy):
    def wrap(self, model):
        # Same seed gives the same init on every rank, but a broadcast makes it true by
        # construction (a rank that drew random numbers differently would otherwise diverge).
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                self.comm.broadcast(t.data, src=0)
        return model

    def reduce_gradients(self, model):
        for p in model.parameters():
            if p.grad is not None:
                self.comm.all_reduce(p.grad, op="avg", algorithm=self.cfg.allreduce)
