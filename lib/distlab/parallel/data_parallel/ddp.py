"""DDP written out: gradients travel in buckets while backward is still running.

`allreduce` waits for backward to end, then all-reduces the gradients: during backward the wire
is idle, and during communication the cores are. DDP (Li et al. 2020, "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training") overlaps the two. It is written here once,
as `DistributedDataParallel`, a wrapper for any module on any process group (exported as
`distlab.DistributedDataParallel`); the `ddp` strategy of the training loop is built on it.

1. construction: rank 0 broadcasts its parameters and buffers, so every replica starts equal.
   The gradients are cut into buckets of about `bucket_mb` MiB (torch's rule: a bucket closes
   once it reaches the cap), in reverse registration order, which is about the order backward produces them (the head's first, the embeddings'
   last). A bucket is one flat buffer, so it holds one dtype: parameters of another dtype
   (fp64 next to fp32) are bucketed on their own.
2. forward: rank 0's buffers (BatchNorm's running statistics) are broadcast first, as torch's
   broadcast_buffers=True does: before a forward that follows a synchronising one (with grad
   enabled, outside no_sync), i.e. once per optimizer step, at its first micro-batch.
3. backward: a hook on each parameter (register_post_accumulate_grad_hook) marks its gradient
   ready. When every gradient of a bucket is ready, the bucket is flattened into one buffer and
   its all-reduce is started asynchronously, while backward goes on to earlier layers. Buckets
   start in index order on every rank (collectives must match across ranks), so a bucket that
   is ready early waits for the ones before it.
4. end of backward: the first hook asked autograd for a callback when this backward finishes
   (`queue_callback`, what torch's own Reducer uses); it launches the buckets whose gradients
   never came (unused parameters send zeros), waits for every bucket, divides by N and copies
   back into each .grad. So the gradients are the global batch's when `loss.backward()`
   returns, as with torch's DDP: no call to remember.

    backward  |■■ head, last block ■■■■■■■■■■ first block ■■■■■■■■■■ embeddings ■|
    ready              b0 ▲                      b1 ▲                        b2 ▲
    wire                  [=== b0 ===]              [==== b1 ====]              [= b2 =]
                          |<------ hidden under backward ------->|  exposed |<------>|

no_sync (gradient accumulation): a forward inside `no_sync()` makes its backward's hooks do
nothing (decided at forward, as torch does), gradients add up in .grad, and the next
synchronising backward launches the buckets: one all-reduce per bucket per optimizer step.

compression="topk": each bucket sends its top-k entries with error feedback instead, as an
all-gather of values and indices (distlab.parallel.data_parallel.compression); every rank then
averages the same sparse sum.

The timeline (`DistributedDataParallel.timeline`, logged by the `ddp` strategy as
`step_info()["ddp"]`), in seconds from the start of the last synchronising backward:

    backward   [0, end]
    buckets    per bucket: params, bytes, ready (its last gradient arrived), start (its
               collective was issued), done (it finished; see comm.Pending), waited (when the
               end-of-backward callback's wait returned)
    overlap    the fraction of communication time hidden under backward:
                   C = ∪_b [start_b, done_b]     the time some bucket was on the wire
                   overlap = |C ∩ [0, end]| / |C|
               1: all communication happened while backward was still computing; 0: all of it
               after backward, as in `allreduce`. The last bucket (the embeddings) is ready
               only as backward ends, so its all-reduce is exposed and overlap stays < 1.
    comm_s, hidden_s   |C| and |C ∩ [0, end]|
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from distlab.comm import Comm, Pending
from distlab.non_finite import detect_nan as nan_detector
from distlab.parallel.agree import agree, buffer_layout, parameter_layout
from distlab.parallel.data_parallel.allreduce import (NotesBuffersAtStart, ReplicatedDP,
                                                      broadcast_buffers, read_batch)
from distlab.parallel.data_parallel.compression import TopK
from distlab.parallel.data_parallel.kept_rows import KeptRows
from distlab.parallel.data_parallel.syncbn import attach_comm
from distlab.parallel.weak_hooks import on_gradient_accumulated
from distlab.step_ledger import StepCounter
from distlab.units import MiB


def assign_buckets(sizes: list[int], cap_bytes: float) -> list[list[int]]:
    """Cut a list of gradient sizes (bytes, in launch order) into consecutive buckets, by torch's
    Reducer's rule (compute_bucket_assignment_by_size): a gradient joins the open bucket, and
    the bucket closes once it holds `cap_bytes` or more. So a bucket passes the cap by at most
    its last gradient, and fewer, larger buckets mean fewer collectives, each with its own
    latency. Returns the indices in each bucket."""
    buckets, current, filled = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        filled += size
        if filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def plan_buckets(params: list[torch.Tensor], cap_bytes: float) -> list[list[int]]:
    """assign_buckets within each (dtype, device) of `params` (in launch order), since a bucket
    is one flat buffer; the buckets ordered by their first parameter. With one dtype this is
    assign_buckets over all of them."""
    kinds: dict = {}
    for i, p in enumerate(params):
        kinds.setdefault((p.dtype, p.device), []).append(i)
    buckets = []
    for idx in kinds.values():
        sizes = [params[i].numel() * params[i].element_size() for i in idx]
        buckets += [[idx[j] for j in b] for b in assign_buckets(sizes, cap_bytes)]
    return sorted(buckets, key=lambda b: b[0])


def overlap_fraction(intervals: list[tuple[float, float]], window: tuple[float, float]):
    """(hidden, total): total = |∪ intervals|, hidden = the part of it inside `window`."""
    total = hidden = 0.0
    end = float("-inf")
    for a, b in sorted(intervals):
        a = max(a, end)  # the part already counted in the union is skipped
        if b > a:
            total += b - a
            hidden += max(0.0, min(b, window[1]) - max(a, window[0]))
            end = b
    return hidden, total


@dataclass(eq=False)
class Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # flat, the bucket's gradients side by side
    views: list[torch.Tensor]  # views of buffer shaped like each parameter
    gathered: torch.Tensor | None = None  # topk: every rank's payload
    pending: int = 0  # gradients not yet ready this step
    handle: Pending | None = None
    ready: float | None = None
    start: float | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def _make_bucket(index: int, params: list[nn.Parameter]) -> Bucket:
    p0 = params[0]
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=p0.dtype, device=p0.device)
    views = [v.view_as(p) for v, p in zip(buffer.split([p.numel() for p in params]), params)]
    return Bucket(index, params, buffer, views)


class DistributedDataParallel(nn.Module):
    """Data parallel for any module on any process group: gradients are averaged over the
    group's ranks, in buckets, while backward runs, and are complete when backward returns.

        model = distlab.DistributedDataParallel(module)      # group=None: the default group
        loss_fn(model(x), y).backward()                      # .grad: the global batch's mean
        optimizer.step()

    module             any nn.Module; its trainable parameters get one hook each
    group              a torch.distributed process group (default: the whole world)
    bucket_mb          bucket cap in MiB (torch's bucket_cap_mb; a larger gradient is a bucket
                       of its own)
    compression        None, or "topk": each bucket sends its top `topk_ratio` entries with
                       error feedback (distlab.parallel.data_parallel.compression)
    broadcast_buffers  rank 0's buffers to every rank before the first forward of each step
    comm               a distlab.comm.Comm to communicate (and book bytes) through, instead of
                       one made over `group`
    detect_nan         raise at the first inf/NaN, naming this rank, the step (this wrapper's)
                       and the module (distlab.non_finite); off by default, as torch's DDP has
                       no such check: one rank's NaN batch then reaches every rank's weights
                       through the all-reduce, silently

    `no_sync()` skips the all-reduce for the backward of forwards run inside it (gradient
    accumulation). `module` is the wrapped model; state_dict keys start with "module.", as
    torch's. Differences from torch's: gradients of parameters that no rank used are zeros,
    not None; buckets stay in reverse registration order (torch rebuilds them after the first
    step in the order gradients arrived).
    """

    def __init__(self, module: nn.Module, group=None, bucket_mb: float = 25.0,
                 compression: str | None = None, topk_ratio: float = 0.01,
                 broadcast_buffers: bool = True, comm: Comm | None = None,
                 detect_nan: bool = False):
        super().__init__()
        if compression not in (None, "topk"):
            raise ValueError(f"compression={compression!r} is not one of None, 'topk'")
        if getattr(module, "_distlab_ddp", False):
            raise ValueError("this module is already wrapped by a DistributedDataParallel: its "
                             "gradient hooks would all-reduce every gradient twice; wrap a "
                             "fresh module (or keep using the first wrapper)")
        self.comm = comm if comm is not None else Comm(group)
        agree(self.comm, "distlab.DistributedDataParallel",  # before the first broadcast
              {"parameters": parameter_layout(module), "buffers": buffer_layout(module),
               "bucket_mb": bucket_mb, "compression": (compression, topk_ratio),
               "broadcast_buffers": broadcast_buffers})
        module._distlab_ddp = True
        self.module = module
        self.world = self.comm.world
        self.broadcast_buffers = broadcast_buffers
        self.compressor = TopK(topk_ratio) if compression == "topk" else None
        self._sync = True  # False inside no_sync()
        self._backward_syncs = True  # set by each forward: does its backward all-reduce?
        self._buffers_due = True  # broadcast buffers before the next forward
        self._open = False  # a synchronising backward has started and not finished
        self._next = 0  # next bucket to launch (buckets launch in index order)
        self._t0 = self._t_end = 0.0
        self.timeline: dict = {}  # the last synchronising backward's (see the module's doc)
        self._steps = StepCounter("DistributedDataParallel")  # a failing collective says so
        self._rows: int | None = 0  # rows this step's forwards took (None: not a batch)
        self._rows_said = False  # uneven rows are said once
        self._kept = KeptRows()  # rows the forwards kept (dropped inside forward), said once
        with torch.no_grad():  # every replica starts from rank 0's state
            self.comm.broadcast_tensors(
                [t.data for t in list(module.parameters()) + list(module.buffers())], src=0)
        params = self._trainable()[::-1]  # about the order backward produces gradients
        self.buckets = [_make_bucket(i, [params[j] for j in idx])
                        for i, idx in enumerate(plan_buckets(params, bucket_mb * MiB))]
        for b in self.buckets:
            for p in b.params:
                on_gradient_accumulated(p, self._bucket_ready, b.index)  # weak: weak_hooks
        self._layout = self._param_layout()
        attach_comm(module, self.comm)  # distlab's SyncBatchNorm shares statistics over these
        # the step whose forward runs: begin() counts it when its backward starts
        self._nan = (nan_detector(module, step_of=lambda: self._steps.step + 1)
                     if detect_nan else None)

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _param_layout(self) -> list[tuple]:
        return [(id(p), p.dtype, p.shape, p.device) for p in self._trainable()]

    # -- forward -----------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._param_layout() != self._layout:
            raise RuntimeError(
                "the wrapped module's trainable parameters changed after it was wrapped (added, "
                "frozen, or moved to another dtype/device): its gradient buckets no longer match "
                "them. Change the module first, then wrap it in DistributedDataParallel")
        if self._buffers_due and self.broadcast_buffers and any(True for _ in self.buffers()):
            broadcast_buffers(self.comm, self.module, 0)
        self._open = False  # a backward that raised midway never finished; start afresh
        output = self.module(*args, **kwargs)
        grad = torch.is_grad_enabled()
        if grad:
            self._count_rows(args, kwargs)
            self._kept.count(output)
        # torch's rule: the next forward broadcasts buffers if this one will synchronise
        self._buffers_due = grad and self._sync
        if grad:
            self._backward_syncs = self._sync
        if grad and self._sync and torch.is_tensor(output) and output.requires_grad:
            output.register_hook(self._backward_start)  # fires first in backward: time zero
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Forwards inside: their backward only accumulates into .grad; the next synchronising
        backward all-reduces the sum."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # -- during backward ---------------------------------------------------------------------
    def _backward_start(self, grad):
        self._begin()

    def _begin(self):
        """First event of a synchronising backward: reset the step's state, and ask autograd
        to call _finish_backward when this backward finishes."""
        if self._open:
            return
        self._open, self._next, self._t0 = True, 0, time.perf_counter()
        self._steps.begin()
        if self._rows is not None and not self._rows_said:
            self._steps.note_rows(self._rows)
            self._kept.note(self._steps, self._rows)
        for b in self.buckets:
            b.pending, b.handle, b.ready, b.start = len(b.params), None, None, None
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _bucket_ready(self, index: int, p: nn.Parameter):
        self._grad_ready(self.buckets[index])

    def _grad_ready(self, bucket: Bucket):
        if not self._backward_syncs:
            return  # no_sync: the gradient just accumulates in .grad
        self._begin()
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready = time.perf_counter()
            self._launch_ready()

    def _launch_ready(self, force: bool = False):
        """Launch buckets in index order while the next one is ready (or all, with force)."""
        while self._next < len(self.buckets) and (force or self.buckets[self._next].pending == 0):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket):
        for p, v in zip(b.params, b.views):  # flatten; a parameter without a gradient sends 0
            if p.grad is None:
                v.zero_()
            else:
                v.copy_(p.grad)
        b.ready = b.ready if b.ready is not None else time.perf_counter()
        if self.compressor is None:
            b.handle = self.comm.all_reduce_async(b.buffer)
        else:
            payload = self.compressor.compress(b.index, b.buffer)
            if b.gathered is None or b.gathered.numel() != self.world * payload.numel():
                b.gathered = payload.new_empty(self.world * payload.numel())
            b.handle = self.comm.all_gather_async(b.gathered, payload)
        b.start = b.handle.issued

    # -- end of backward (autograd's final callback) -----------------------------------------
    def _finish_backward(self):
        """Launch what is left (unused parameters), wait for every bucket, average, and copy
        into .grad: the gradients are complete when backward returns."""
        self._t_end = time.perf_counter()
        if self._nan is not None:  # this rank's own gradients, before the average mixes them
            self._nan.check_gradients(self.module)
        self._launch_ready(force=True)
        for b in self.buckets:
            b.handle.wait()
            if self.compressor is None:
                b.buffer.div_(self.world)
            else:
                self.compressor.decompress(b.gathered, b.buffer, self.world)
            for p, v in zip(b.params, b.views):
                if p.grad is None:
                    p.grad = v.clone()  # every rank ends with the same gradients
                else:
                    p.grad.copy_(v)
        self.comm.note_buffer(sum(b.nbytes + (b.gathered.numel() * 4 if b.gathered is not None
                                              else 0) for b in self.buckets))
        self.timeline = self._make_timeline()
        self._open = False
        self._say_uneven_rows()

    def _count_rows(self, args, kwargs):
        """The batch's rows: dim 0 of the first tensor input (summed over no_sync forwards)."""
        first = next((t for t in list(args) + list(kwargs.values())
                      if torch.is_tensor(t) and t.dim() > 0), None)
        if first is None or self._rows is None:
            self._rows = None
        else:
            self._rows += first.shape[0]

    def _say_uneven_rows(self):
        """Once per run: peers that fed another number of rows this step (distlab.step_ledger;
        before, silent: the average of unequal means is not the global mean gradient); and
        once, peers whose forwards kept another number of the rows fed (kept_rows)."""
        if self._rows is not None and not self._rows_said:
            said = self._steps.uneven_rows(self.comm.group, self._rows)
            if said is not None:
                self._rows_said = True
                warnings.warn(said, stacklevel=2)
            kept = self._kept.uneven(self._steps, self.comm.group, self._rows)
            if kept is not None:
                warnings.warn(kept, stacklevel=2)
        self._rows = 0 if self._rows is not None else None

    def _make_timeline(self) -> dict:
        t0 = self._t0
        rows = [{"index": b.index, "params": len(b.params), "bytes": b.nbytes,
                 "ready": b.ready - t0, "start": b.start - t0, "done": b.handle.done - t0,
                 "waited": b.handle.waited - t0} for b in self.buckets]
        end = self._t_end - t0
        hidden, total = overlap_fraction([(r["start"], r["done"]) for r in rows], (0.0, end))
        return {"buckets": rows, "backward": [0.0, end], "comm_s": total, "hidden_s": hidden,
                "overlap": hidden / total if total > 0 else 0.0}


class DDP(NotesBuffersAtStart, ReplicatedDP):
    """The training loop's `ddp`: the loop's model wrapped in DistributedDataParallel, with
    RunConfig's bucket_mb, compress and broadcast_buffers. Gradients are complete when the last
    micro-batch's backward returns, so reduce_gradients has nothing left to do."""
    name = "ddp"
    knobs = frozenset({"bucket_mb", "compress", "topk_ratio"})

    @classmethod
    def mesh_preset(cls, cfg):  # the same averages, in buckets (none with compression)
        return None if cfg.compress != "none" else {"dp_shard": cfg.world_size, "zero_stage": 0}
    supports = ReplicatedDP.supports | {"no_buffer_broadcast", "moe"}

    @classmethod
    def check_config(cls, cfg):
        if cfg.compress not in ("none", "topk"):
            raise ValueError(f"compress={cfg.compress!r}: ddp compresses with top-k ('topk'); "
                             "PowerSGD is PyTorch's hook, under ddp-torch ('powersgd')")

    def wrap(self, model):
        cfg = self.cfg
        self.model = DistributedDataParallel(
            model, bucket_mb=cfg.bucket_mb, broadcast_buffers=cfg.broadcast_buffers,
            compression=None if cfg.compress == "none" else cfg.compress,
            topk_ratio=cfg.topk_ratio, comm=self.comm)
        self.note_buffers(model)
        return self.model

    def batch(self, data, step):
        return read_batch(self, data, step)

    def no_sync(self, model):
        return self.model.no_sync()

    def reduce_gradients(self, model):
        """Nothing: DistributedDataParallel averaged the gradients as backward ended."""

    def step_info(self) -> dict:
        return {"ddp": self.model.timeline, **self.buffer_info()}
