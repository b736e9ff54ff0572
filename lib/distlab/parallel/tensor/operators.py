"""The communication tensor parallelism is made of: Megatron's conjugate operators f and g and
their sequence-parallel forms, as autograd functions on distlab.comm (every byte counted by
kind, KINDS), and sequence parallel's all-reduce of partial gradients (_PartialGrads).

A block needs two collectives forward and two backward, made by the paper's conjugate
operators:

    f : identity forward, all-reduce backward      (enters a tensor-parallel region)
    g : all-reduce forward, identity backward      (leaves it)

With sequence parallelism (sp=True) the LayerNorms run on 1/t of the sequence, and f/g become

    g_sp (gather):         all-gather along T forward, reduce-scatter backward   (enters)
    g_sp_bar (scatter):    reduce-scatter along T forward, all-gather backward   (leaves)

An all-reduce is a reduce-scatter followed by an all-gather, so SP moves the same bytes and
stores 1/t of the LayerNorm activations.

Replicated modules (embeddings, LayerNorms, head) see identical inputs on every rank without SP,
so their gradients are identical on every rank and need no communication. With SP a LayerNorm
(and the bias of a row-parallel layer, added after the reduce-scatter) sees only this rank's
part of the sequence: its gradient is a partial sum, all-reduced when backward finishes
(`_PartialGrads`, autograd's final callback).

Shapes that differ between the ranks at a collective (a model that drops rows inside forward, a
different number on each rank) are no error gloo can report: the rank that receives more bytes
than it expects aborts from gloo's own thread (SIGABRT, "Received data size doesn't match
expected size (20 vs 16)", no word of which tensor), and its peer reads "Connection reset by
peer". Nothing can be caught after the fact, so `same_shape` compares the shapes *before* the
collective: one small all-gather each (measured on the shared 2-core machine: 1.1 ms, beside
1.5 ms for the all-reduce of an (8, 64, 128) activation). So by default each layer checks at
its calls 1, 2, 4, 8, ... (`shapes_due`): a run of n forwards pays log2(n) + 1 checks per
layer, and a mismatch there from the start (the usual case: a per-rank drop) is named at the
first forward; one that appears later, between two checks, is gloo's abort, which the launcher
explains (distlab.caller.run). parallelize_module(..., check_shapes=True), or torch's
TORCH_DISTRIBUTED_DEBUG=DETAIL, checks every call; False never.
"""

from __future__ import annotations

import torch

from distlab.parallel.weak_hooks import on_gradient


KINDS = {"all_reduce": "tp.all_reduce", "all_gather": "sp.all_gather",
         "reduce_scatter": "sp.reduce_scatter", "grads": "sp.grad_all_reduce",
         "norm": "tp.grad_norm", "shapes": "tp.shape_check"}
MAX_DIMS = 8  # same_shape compares tensors of up to this many dims


def shapes_due(mode, calls: int) -> bool:
    """Whether a layer compares the ranks' shapes at its call number `calls` (from 1): every
    call (True), never (False), or at calls 1, 2, 4, 8, ... ("doubling", the default)."""
    if mode == "doubling":
        return calls & (calls - 1) == 0
    return bool(mode)


def same_shape(comm, x, what: str) -> None:
    """Raise ValueError naming `what` and each rank's shape of x, if the ranks' shapes differ:
    before the collective that would carry x (see the module's docstring)."""
    if x.dim() > MAX_DIMS:
        return
    mine = torch.full((MAX_DIMS + 1,), -1, dtype=torch.int64)
    mine[0] = x.dim()
    mine[1:1 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    out = torch.empty(comm.world * mine.numel(), dtype=torch.int64)
    comm.all_gather_async(out, mine.to(x.device), kind=KINDS["shapes"]).wait()
    rows = out.view(comm.world, -1).tolist()
    shapes = [tuple(row[1:1 + row[0]]) for row in rows]
    if len(set(shapes)) > 1:
        each = ", ".join(f"{s} on rank {r}" for r, s in enumerate(shapes))
        raise ValueError(
            f"tensor parallelism: {what} has a different shape on each rank: {each}. Every rank "
            "of a tensor-parallel group must hold the same shapes (each holds a block of the "
            "same tensor): a model that drops rows inside forward must drop the same rows on "
            "every rank (a mask from the input, not from a per-rank random draw or the rank)")


# -- collectives along the sequence dimension (dim 1 of (B, T, d)) -----------------------------


def _all_reduce(comm, x):
    x = x.contiguous().clone()
    return comm.all_reduce_async(x, kind=KINDS["all_reduce"]).wait()


def _gather_seq(comm, x):
    """(B, T/t, d) on each rank -> (B, T, d), rank r's block at rows r·T/t."""
    x = x.contiguous()
    out = torch.empty(comm.world * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather_async(out, x.view(-1), kind=KINDS["all_gather"]).wait()
    B, Tl, d = x.shape
    return out.view(comm.world, B, Tl, d).transpose(0, 1).reshape(B, comm.world * Tl, d)


def _check_seq(comm, T):
    if T % comm.world:
        raise ValueError(f"sequence parallel cuts dim 1 into {comm.world} equal blocks; its "
                         f"length {T} is not divisible by {comm.world}: pad the sequence")


def _reduce_scatter_seq(comm, x):
    """(B, T, d) partial sums on each rank -> this rank's (B, T/t, d) block of their sum."""
    B, T, d = x.shape
    t = comm.world
    _check_seq(comm, T)
    blocks = x.reshape(B, t, T // t, d).transpose(0, 1).contiguous().view(-1)
    out = torch.empty(B * (T // t) * d, dtype=x.dtype, device=x.device)
    comm.reduce_scatter_async(out, blocks, kind=KINDS["reduce_scatter"]).wait()
    return out.view(B, T // t, d)


def _slice_seq(comm, x):
    _check_seq(comm, x.shape[1])
    Tl = x.shape[1] // comm.world
    return x[:, comm.rank * Tl:(comm.rank + 1) * Tl].contiguous()


# -- the paper's operators as autograd functions ----------------------------------------------


class F_Copy(torch.autograd.Function):
    """f: identity forward, all-reduce backward (each rank's input gradient is partial)."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(ctx.comm, dy), None


class G_Reduce(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs), identity backward."""
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class GatherSeq(torch.autograd.Function):
    """g_sp: all-gather along the sequence forward, reduce-scatter backward."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_seq(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter_seq(ctx.comm, dy), None


class ReduceScatterSeq(torch.autograd.Function):
    """g_sp_bar: reduce-scatter along the sequence forward, all-gather backward."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_seq(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return _gather_seq(ctx.comm, dy), None


class SplitSeq(torch.autograd.Function):
    """Enter the SP region from a replicated tensor (the embeddings' output): keep this rank's
    block forward; backward all-gathers, so every rank's embedding gradient is the full one."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _slice_seq(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return _gather_seq(ctx.comm, dy), None


class GatherSeqToReplicated(torch.autograd.Function):
    """Leave the SP region for a replicated consumer (the head): all-gather forward; the
    gradient arriving is identical on every rank, so backward keeps this rank's block."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_seq(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return _slice_seq(ctx.comm, dy), None


class _PartialGrads:
    """Sequence parallel: each rank's gradient of these replicated parameters covers only its
    block of the sequence. A hook on each takes the gradient as it arrives (letting zeros
    accumulate), and autograd's final callback all-reduces them all in one flat buffer and
    adds the sums to .grad: complete when backward returns, and correct under accumulation
    (only this backward's part is summed, never what .grad already held)."""

    def __init__(self, comm, params):
        self.comm, self.params = comm, list(params)
        self.arrived: dict[int, torch.Tensor] | None = None
        for p in self.params:  # keyed by id: a pipeline stage may later drop some (params)
            on_gradient(p, self._arrive, id(p))  # weak: a hook holding p would never be freed

    def _arrive(self, key, g):
        if self.arrived is None:
            self.arrived = {}
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self.arrived[key] = g
        return torch.zeros_like(g)

    def _finish(self):
        arrived, self.arrived = self.arrived, None
        # every parameter, in the same order on every rank (zeros where none arrived)
        parts = [arrived.get(id(p), torch.zeros_like(p)).reshape(-1) for p in self.params]
        flat = torch.cat(parts)
        self.comm.all_reduce_async(flat, kind=KINDS["grads"]).wait()
        with torch.no_grad():
            for p, g in zip(self.params, flat.split([p.numel() for p in self.params])):
                g = g.view_as(p)
                p.grad = g.clone() if p.grad is None else p.grad.add_(g)
