"""The plug points a strategy may override. The defaults are a plain single-process step.

The loop in distlab.train calls, in order:

    model = strategy.wrap(model)                       once
    optimizer = strategy.build_optimizer(model, make)  once
    if strategy.is_server(): strategy.serve(...)        instead of training (parameter server)
    per step:  x, y = strategy.batch(data, step)        this rank's rows (None: out of data)
               with strategy.no_sync(model): backward   every micro-batch but the last
               strategy.reduce_gradients(model)
               strategy.step_gradients(model)           what loss scaling unscales and checks
               strategy.clip_gradients(model, max_norm) cfg.grad_clip > 0 (after unscaling)
               strategy.optimizer_step(optimizer)       skipped when loss scaling overflowed
               strategy.step_info()                     extra fields for the step event
"""

from __future__ import annotations

import contextlib

import torch


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

    @contextlib.contextmanager
    def _hooks_paused(self):
        """no_sync for strategies that communicate from gradient hooks (ddp, zero*): the hooks
        read self._sync and only let gradients accumulate while it is False."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def forward_backward(self, model, x, y, scale_loss):
        """Own the step's forward and backward over all its micro-batches (a pipeline
        schedule). Return the loss to log (None on a rank that has none, e.g. a pipeline's
        non-last stage), or NotImplemented (the default) to let the loop run its own
        micro-batch loop. `scale_loss(loss)` applies loss scaling before backward."""
        return NotImplemented

    def reduce_gradients(self, model):
        """After backward: make the gradients the ones of the global batch."""

    def step_gradients(self, model) -> list:
        """After reduce_gradients: the gradient tensors this rank's optimizer step will read.
        The loss scaler unscales these in place and checks them for inf/NaN (distlab.precision);
        a strategy that holds gradients elsewhere (ZeRO's shards) returns those."""
        return [p.grad for p in model.parameters() if p.grad is not None]

    def clip_gradients(self, model, max_norm: float) -> float:
        """Scale the gradients so their global L2 norm is at most max_norm; return the norm
        before clipping. A strategy with sharded gradients must sum the squares across ranks."""
        params = [p for p in model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def optimizer_step(self, optimizer):
        optimizer.step()

    def state_bytes(self, model, optimizer) -> dict:
        """Bytes of parameters, gradients and optimizer state this rank holds, measured after
        optimizer_step. Sharding strategies (ZeRO, FSDP) count their local shards instead."""
        from distlab.memory import model_state_bytes
        return model_state_bytes(model, optimizer)

    def full_state_dict(self, model) -> dict:
        """The whole model's weights under the names `single` uses (what equivalence tests
        compare). Strategies that shard parameters gather them; a collective for those. A
        wrapper's prefix (torch DDP's "module.") is dropped."""
        return {k.removeprefix("module."): v for k, v in model.state_dict().items()}

    def step_info(self) -> dict:
        """Extra fields for this step's event (bucket timeline, staleness, ...)."""
        return {}
