"""The plug points a strategy may override. The defaults are a plain single-process step.

The loop in distlab.train calls, in order:

    model = strategy.wrap(model)                       once
    optimizer = strategy.build_optimizer(model, make)  once
    if strategy.is_server(): strategy.serve(...)        instead of training (parameter server)
    per step:  x, y = strategy.batch(data, step)        this rank's rows (None: out of data)
               with strategy.no_sync(model): backward   every micro-batch but the last
               strategy.reduce_gradients(model)
               strategy.optimizer_step(optimizer)
               strategy.step_info()                     extra fields for the step event
"""

from __future__ import annotations

import contextlib


class Strategy:
    def __init__(self, cfg, comm):
        self.cfg, self.comm = cfg, comm
        self.rank, self.world = comm.rank, comm.world
        self.log = None  # the rank's EventLog, set by the loop

    def wrap(self, model):
        """Prepare the model (for example, make every rank start from rank 0's weights)."""
        return model

    def build_optimizer(self, model, make):
        """The optimizer over what this rank updates; `make(params)` builds RunConfig's
        optimizer. ZeRO overrides this to own only its shard of the optimizer state."""
        return make([p for p in model.parameters() if p.requires_grad])

    def is_server(self) -> bool:
        """True on a rank that serves (a parameter server) instead of training."""
        return False

    def serve(self, model, optimizer):
        raise NotImplementedError

    def batch(self, data, step: int):
        """This rank's rows of the step's global batch; None when this rank is out of data.
        Data-parallel default: rank r of N takes the r-th of N equal blocks."""
        return data.rank_batch(step, self.cfg.global_batch, self.rank, self.world)

    def out_of_data(self, model, step: int) -> bool:
        """Called when `batch` returned None. Return True to keep stepping without data (a
        join-style protocol shadowing the others' collectives), False to stop this rank."""
        return False

    def no_sync(self, model):
        """Context for the micro-batches before the last one of an optimizer step: gradients
        only accumulate locally; communication waits for the last micro-batch."""
        return contextlib.nullcontext()

    def reduce_gradients(self, model):
        """After backward: make the gradients the ones of the global batch."""

    def optimizer_step(self, optimizer):
        optimizer.step()

    def step_info(self) -> dict:
        """Extra fields for this step's event (bucket timeline, staleness, ...)."""
        return {}
