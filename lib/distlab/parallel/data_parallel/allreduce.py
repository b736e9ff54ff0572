"""Data parallelism: every rank holds the whole model and a slice of the global batch.

`allreduce` is the simplest correct form: after backward, every gradient is averaged across
ranks, one tensor at a time, by the all-reduce algorithm in RunConfig.allreduce (the backend's,
or the ring or gather-to-root versions written in distlab.comm). Because each rank's loss is
the mean over its equal slice, the average of the ranks' gradients is exactly the gradient of
the global batch's mean loss, so the run follows `single` step for step.

Buffers (BatchNorm's running statistics), as torch DDP with broadcast_buffers=True: rank 0's
parameters and buffers are broadcast at wrap, and rank 0's buffers again at the start of every
step (in `batch`, before the forward), so every rank evaluates with the same running stats.
torch DDP does it at every forward, i.e. per micro-batch; here it is once per optimizer step.
With plain BatchNorm this makes every rank's running stats rank 0's (statistics of rank 0's
rows only); with SyncBatchNorm they are already equal on every rank and equal `single`'s.

Finite datasets (cfg.dataset_size > 0): `batch` reads this rank's rows through the distributed
sampler (distlab.data.sampler) and returns None when this rank has no rows left. Without join, that
rank stops; if the others still have batches (drop_last=False, uneven shards), they wait in the
next collective for a peer that never comes: torch DDP "hangs"; here the wait ends after
cfg.timeout_s with an error that says which ranks ran out of data. (A rank that stops meets the
others at a barrier first, as a script's end-of-training barrier would; with equal batches
everyone arrives there together.)

join=True is a join protocol, like torch's `Join([ddp_model])` context manager
(torch.distributed.algorithms.join): each step every rank all-reduces a "have data" flag
(`ranks_with_data`); a rank that is out of data shadows the others' collectives instead of
stopping: it takes part in the buffer broadcast, contributes zero gradients to the all-reduce
(`zero_gradients`), and the sum is divided by the number of ranks that had data (torch's
divide_by_initial_world_size=False; torch's default divides by the initial world size, so a
joined rank's zeros shrink the step). All stop when no rank has data. Differences from torch:
torch's joined rank does not step its optimizer and gets the last joiner's parameters at the
end (`_sync_final_model`); here the joined rank applies the same averaged gradient each step, so
parameters and optimizer state stay identical at every step, and the final broadcast from a
rank that trained last is done too, which covers a rank that never had a batch. torch's Join
shadows only DDP's gradient all-reduce and buffer broadcast, not collectives in the forward such
as SyncBatchNorm's; neither does this one (RunConfig refuses join with sync_bn). torch broadcasts
buffers under Join from the highest rank still training; we use the lowest.
"""

from __future__ import annotations

import contextlib

import torch

from distlab.data.sampler import shard_reader, uneven_inputs_report
from distlab import wire
from distlab.parallel.base import Strategy
from distlab.parallel.data_parallel.syncbn import attach_comm
from distlab.step_ledger import TIMED_OUT


def read_batch(strategy, data, step: int):
    """This rank's rows for `step`: a block of the step's global batch (endless data), or its
    next batch from the distributed sampler (cfg.dataset_size > 0; None when out of rows)."""
    cfg = strategy.cfg
    if not cfg.dataset_size:
        return data.rank_batch(step, cfg.global_batch, strategy.rank, strategy.world)
    if getattr(strategy, "reader", None) is None:
        strategy.reader = shard_reader(cfg, data, strategy.rank, strategy.world)
    return strategy.reader.batch(step)


def broadcast_buffers(comm, model, src: int = 0):
    """Every rank's buffers become rank `src`'s (torch DDP's broadcast_buffers=True)."""
    with torch.no_grad():
        for b in model.buffers():
            comm.broadcast(b, src=src)


def ranks_with_data(comm, has_data: bool, device=None) -> list[int]:
    """Join, each step: all-reduce a one-hot "I have data" vector. Every rank learns the same
    list of ranks that still have a batch (empty: everyone is done). `device`: the model's
    (NCCL all-reduces GPU tensors only)."""
    flags = torch.zeros(comm.world, device=device)
    flags[comm.rank] = float(has_data)
    comm.all_reduce(flags)
    return [r for r in range(comm.world) if flags[r] > 0]


def zero_gradients(model):
    """Join: a rank out of data contributes zeros to the gradient sum."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


@contextlib.contextmanager
def explain_uneven_inputs(strategy, where: str = "in a step's collectives"):
    """Re-raise a collective's timeout with the reason when it is uneven inputs: every rank
    can compute every rank's batch count from the sampler, so the message names who stopped."""
    try:
        yield
    except RuntimeError as e:
        cfg = strategy.cfg
        if cfg.dataset_size and not cfg.join and TIMED_OUT.search(str(e)):
            report = uneven_inputs_report(cfg, strategy.world)
            if report.startswith("uneven"):
                raise RuntimeError(f"rank {strategy.rank} timed out {where}: {report}.\n{e}") from e
        raise


class ReplicatedDP(Strategy):
    """What every data-parallel strategy that keeps the whole model, its gradients and its
    optimizer state on every rank declares: one layout, so their checkpoints are interchangeable,
    and the features written for whole gradients on every rank."""
    replicated = True
    supports = Strategy.supports | {"finite_data", "lora", "ewc", "eval", "fp8"}
    checkpoint_layout = "replicated"  # the whole model and optimizer on every rank
    loads_canonical = True  # a ZeRO or FSDP2 checkpoint too (distlab.checkpoint.reshard)


class NotesBuffersAtStart:
    """A DDP strategy that logs what this rank's floating buffers (BatchNorm's running
    statistics) sum to as each step's first forward starts, after the wrapper broadcast them:
    equal on every rank when rank 0's were copied to all (02 compares ours with torch's)."""
    _buffer_sum: float | None = None

    def note_buffers(self, module) -> None:
        """Call on the wrapped module: its forward pre-hook runs inside the wrapper's forward,
        after the broadcast."""
        module.register_forward_pre_hook(self._note_buffer_sum)

    def _note_buffer_sum(self, module, args):
        buffers = [b for b in module.buffers() if b.is_floating_point()]
        if buffers and self._buffer_sum is None:
            self._buffer_sum = float(sum(b.double().sum() for b in buffers))

    def buffer_info(self) -> dict:
        """The step's note for step_info, and a fresh one for the next step."""
        info = {} if self._buffer_sum is None else {"buffer_sum_at_start": self._buffer_sum}
        self._buffer_sum = None
        return info


class Single(ReplicatedDP):
    """One process, the whole global batch: the baseline every strategy is checked against.
    A finite dataset is read through the same sampler, at world size 1."""
    name = "single"
    supports = ReplicatedDP.supports | {"bugs", "diagnostics", "moe"}

    @classmethod
    def check_config(cls, cfg):
        if cfg.world_size != 1:
            from distlab.parallel import strategies
            raise ValueError(f"world_size={cfg.world_size}: strategy 'single' runs one process; "
                             "set world_size=1 or pick a parallel strategy "
                             f"({', '.join(s for s in strategies() if s != 'single')})")

    def wrap(self, model):
        attach_comm(model, self.comm)  # SyncBatchNorm at world 1: plain BatchNorm's statistics
        return model

    def batch(self, data, step):
        return read_batch(self, data, step)


class AllReduceDP(ReplicatedDP):
    name = "allreduce"
    knobs = frozenset({"allreduce"})
    supports = ReplicatedDP.supports | {"join", "bugs", "diagnostics", "moe"}

    @classmethod
    def mesh_preset(cls, cfg):  # every rank a data-parallel replica, one flat all-reduce
        return {"dp_shard": cfg.world_size, "zero_stage": 0}

    active: list[int] | None = None  # join: ranks with data this step
    optimizer = None  # remembered at the first step, for a joined rank's shadow steps

    def wrap(self, model):
        # Same seed gives the same init on every rank, but a broadcast makes it true by
        # construction (a rank that drew random numbers differently would otherwise diverge).
        with torch.no_grad():
            self.comm.broadcast_tensors(
                [t.data for t in list(model.parameters()) + list(model.buffers())], src=0)
        attach_comm(model, self.comm)  # SyncBatchNorm shares statistics over these ranks
        self.model = model
        return model

    def batch(self, data, step):
        rows = read_batch(self, data, step)
        with explain_uneven_inputs(self):
            if self.cfg.join:
                dev = next(self.model.parameters()).device
                has_data = rows is not None
                before, self.active = self.active, ranks_with_data(self.comm, has_data, dev)
                if not self.active:  # no rank has data: the run ends
                    self._final_sync(before)
                    return None
            src = self.active[0] if self.cfg.join else 0
            broadcast_buffers(self.comm, self.model, src)  # at each step's start, like DDP
        return rows

    def out_of_data(self, model, step):
        if not self.cfg.join:
            # Stop, but first meet the others at a barrier, as a script's end-of-training
            # barrier, checkpoint or evaluation would: with equal batches everyone arrives
            # together; with uneven inputs the others are in a gradient all-reduce instead,
            # and both sides wait until timeout_s (the error names who ran out).
            with explain_uneven_inputs(self, "at its end-of-data barrier"):
                self.comm.barrier()
            return False
        if not self.active:
            return False  # join: every rank is out of data
        zero_gradients(model)  # shadow the step: zeros into the same all-reduces ...
        self.reduce_gradients(model)
        if self.optimizer is not None:  # ... and the same update as the ranks with data
            self.optimizer.step()
        model.zero_grad(set_to_none=True)
        comm_stats, _ = self.comm.take_step_stats()
        self.log.write("step", step=step, loss=None, tokens=0, joined=True,
                       ranks_with_data=self.active, lr=self.cfg.lr_at(step), comm=comm_stats,
                       wire=wire.LEDGER.end())
        return True

    def _final_sync(self, last_active):
        """Join's end: parameters and buffers from a rank that trained last (torch:
        _sync_final_model), for a rank that never had a batch and so never stepped."""
        if last_active:
            with torch.no_grad():
                for t in list(self.model.parameters()) + list(self.model.buffers()):
                    self.comm.broadcast(t.data, src=last_active[0])

    def reduce_gradients(self, model):
        with explain_uneven_inputs(self):
            if self.cfg.join:  # sum over the ranks with data, divided by their number
                for p in model.parameters():
                    if p.requires_grad:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        self.comm.all_reduce(p.grad, algorithm=self.cfg.allreduce)
                        p.grad.div_(len(self.active))
                return
            for p in model.parameters():
                if p.grad is not None:
                    self.comm.all_reduce(p.grad, op="avg", algorithm=self.cfg.allreduce)

    def optimizer_step(self, optimizer):
        self.optimizer = optimizer
        optimizer.step()
