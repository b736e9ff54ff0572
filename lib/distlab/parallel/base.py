"""The plug points a strategy may override. The defaults are a plain single-process step."""

from __future__ import annotations

import contextlib


class Strategy:
    # Data-parallel strategies give each rank global_batch / world rows; model-parallel ones
    # give every rank the whole batch.
    shards_batch = True

    def __init__(self, cfg, comm):
        self.cfg, self.comm = cfg, comm

    def wrap(self, model):
        """Prepare the model (for example, make every rank start from rank 0's weights)."""
        return model

    def no_sync(self, model):
        """Context for the micro-batches before the last one of an optimizer step: gradients
        only accumulate locally; communication waits for the last micro-batch."""
        return contextlib.nullcontext()

    def reduce_gradients(self, model):
        """After backward: make the gradients the ones of the global batch."""

    def optimizer_step(self, optimizer):
        optimizer.step()
