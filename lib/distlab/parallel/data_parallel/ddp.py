"""DDP written out: gradients travel in buckets while backward is still running.

`allreduce` waits for backward to end, then all-reduces the gradients: during backward the wire
is idle, and during communication the cores are. DDP (Li et al. 2020, "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training") overlaps the two:

1. wrap: rank 0 broadcasts its parameters and buffers, so every replica starts equal. The
   gradients are cut into buckets of at most `bucket_mb` MiB, in reverse registration order,
   which is about the order backward produces them (the head's first, the embeddings' last).
2. backward: a hook on each parameter (register_post_accumulate_grad_hook) marks its gradient
   ready. When every gradient of a bucket is ready, the bucket is flattened into one buffer and
   its all-reduce is started asynchronously, while backward goes on to earlier layers. Buckets
   start in index order on every rank (collectives must match across ranks), so a bucket that
   is ready early waits for the ones before it.
3. reduce_gradients: wait for every bucket, divide by N, copy back into each .grad.

    backward  |■■ head, last block ■■■■■■■■■■ first block ■■■■■■■■■■ embeddings ■|
    ready              b0 ▲                      b1 ▲                        b2 ▲
    wire                  [=== b0 ===]              [==== b1 ====]              [= b2 =]
                          |<------ hidden under backward ------->|  exposed |<------>|

no_sync (gradient accumulation): the hooks do nothing, gradients add up in .grad, and the last
micro-batch's backward launches the buckets: one all-reduce per bucket per optimizer step.

compress="topk": each bucket sends its top-k entries with error feedback instead, as an
all-gather of values and indices (distlab.parallel.data_parallel.compression); every rank then averages the
same sparse sum.

The timeline, `step_info()["ddp"]`, in seconds from the start of the (last micro-batch's)
backward on this rank:

    backward   [0, end]
    buckets    per bucket: params, bytes, ready (its last gradient arrived), start (its
               collective was issued), done (it finished; see comm.Pending), waited (when
               reduce_gradients's wait returned)
    overlap    the fraction of communication time hidden under backward:
                   C = ∪_b [start_b, done_b]     the time some bucket was on the wire
                   overlap = |C ∩ [0, end]| / |C|
               1: all communication happened while backward was still computing; 0: all of it
               after backward, as in `allreduce`. The last bucket (the embeddings) is ready
               only as backward ends, so its all-reduce is exposed and overlap stays < 1.
    comm_s, hidden_s   |C| and |C ∩ [0, end]|
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from distlab.comm import Pending
from distlab.estimate import MiB
from distlab.parallel.data_parallel.allreduce import ReplicatedDP, broadcast_buffers, read_batch
from distlab.parallel.data_parallel.syncbn import attach_comm
from distlab.parallel.data_parallel.compression import TopK



def assign_buckets(sizes: list[int], cap_bytes: float) -> list[list[int]]:
    """Cut a list of gradient sizes (bytes, in launch order) into consecutive buckets of at most
    `cap_bytes`: a bucket closes before a gradient that would take it past the cap; a gradient
    larger than the cap is a bucket of its own. Returns the indices in each bucket."""
    buckets, current, filled = [], [], 0
    for i, size in enumerate(sizes):
        if current and filled + size > cap_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        buckets.append(current)
    return buckets


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
    params: list[torch.nn.Parameter]
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


class DDP(ReplicatedDP):
    name = "ddp"
    supports = ReplicatedDP.supports | {"no_buffer_broadcast"}

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        self.buckets: list[Bucket] = []
        self.compressor = TopK(cfg.topk_ratio) if cfg.compress == "topk" else None
        self._sync = True  # False inside no_sync
        self._open = False  # a syncing backward has started and not been reduced yet
        self._next = 0  # next bucket to launch (buckets launch in index order)
        self._t0 = self._t_end = 0.0
        self._timeline: dict = {}

    # -- setup -----------------------------------------------------------------------------
    def wrap(self, model):
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                self.comm.broadcast(t.data, src=0)
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        sizes = [p.numel() * p.element_size() for p in params]
        for i, idx in enumerate(assign_buckets(sizes, self.cfg.bucket_mb * MiB)):
            self.buckets.append(self._make_bucket(i, [params[j] for j in idx]))
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(lambda p, b=b: self._grad_ready(b))
        model.register_forward_hook(self._after_forward)
        attach_comm(model, self.comm)  # SyncBatchNorm shares statistics over these ranks
        self.model = model
        return model

    def batch(self, data, step):
        # like torch DDP's broadcast_buffers=True: rank 0's buffers (BatchNorm's running
        # statistics) at each step's start, so every rank evaluates with the same ones
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        if buffers and self.cfg.broadcast_buffers:
            broadcast_buffers(self.comm, self.model, 0)
        # what this rank's floating buffers sum to as the step starts: equal on every rank
        # when they were broadcast (logged with the step, see step_info)
        self._buffer_sum = float(sum(b.double().sum() for b in buffers)) if buffers else None
        return read_batch(self, data, step)

    def _make_bucket(self, index, params) -> Bucket:
        p0 = params[0]
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=p0.dtype, device=p0.device)
        views = [v.view_as(p) for v, p in zip(buffer.split([p.numel() for p in params]), params)]
        return Bucket(index, params, buffer, views)

    def no_sync(self, model):
        return self._hooks_paused()

    # -- during backward -------------------------------------------------------------------
    def _after_forward(self, module, inputs, output):
        # A hook on the output (the loss) fires first in backward: the timeline's zero.
        if self._sync and torch.is_tensor(output) and output.requires_grad:
            output.register_hook(self._backward_start)

    def _backward_start(self, grad):
        self._begin()

    def _begin(self, in_backward: bool = True):
        """First event of a syncing backward: reset the step's state, and ask autograd to call
        _backward_end when this backward finishes."""
        if self._open:
            return
        self._open, self._next, self._t0 = True, 0, time.perf_counter()
        for b in self.buckets:
            b.pending, b.handle, b.ready, b.start = len(b.params), None, None, None
        if in_backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _grad_ready(self, bucket: Bucket):
        if not self._sync:
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

    def _backward_end(self):
        self._t_end = time.perf_counter()
        self._launch_ready(force=True)  # buckets whose gradients never came (unused params)

    # -- after backward --------------------------------------------------------------------
    def reduce_gradients(self, model):
        if not self._open:  # no syncing backward ran: reduce what .grad holds
            self._begin(in_backward=False)
            self._backward_end()
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
        self._timeline = self._make_timeline()
        self._open = False

    def _make_timeline(self) -> dict:
        t0 = self._t0
        rows = [{"index": b.index, "params": len(b.params), "bytes": b.nbytes,
                 "ready": b.ready - t0, "start": b.start - t0, "done": b.handle.done - t0,
                 "waited": b.handle.waited - t0} for b in self.buckets]
        end = self._t_end - t0
        hidden, total = overlap_fraction([(r["start"], r["done"]) for r in rows], (0.0, end))
        return {"buckets": rows, "backward": [0.0, end], "comm_s": total, "hidden_s": hidden,
                "overlap": hidden / total if total > 0 else 0.0}

    def step_info(self) -> dict:
        info = {"ddp": self._timeline}
        if getattr(self, "_buffer_sum", None) is not None:
            info["buffer_sum_at_start"] = self._buffer_sum
        return info
