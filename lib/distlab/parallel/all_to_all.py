"""All-to-all in autograd: rows to other ranks forward, their gradients back the same way.

Block j of x (dim 0; in_splits[j] rows, or equal blocks) goes to rank j, and rank j's block
for this rank lands at block j of the output (out_splits[j] rows). The backward is the same
exchange with the splits swapped: each row's gradient goes back to the rank the row came from.
Used by expert parallelism (tokens to their experts' ranks and back, uneven splits) and by
Ulysses (a sequence split traded for a head split, equal blocks).
"""

from __future__ import annotations

import torch

from distlab.comm import Comm


def all_to_all(comm: Comm, x: torch.Tensor, out_splits, in_splits, kind: str) -> torch.Tensor:
    """No autograd: the exchange itself, into a new contiguous buffer."""
    rows = sum(out_splits) if out_splits is not None else len(x)
    out = x.new_empty((rows, *x.shape[1:]))  # contiguous, whatever x's strides
    return comm.all_to_all(out, x.contiguous(), out_splits, in_splits, kind=kind)


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, out_splits, in_splits, kind: str, grad_kind: str):
        ctx.comm, ctx.splits, ctx.grad_kind = comm, (out_splits, in_splits), grad_kind
        return all_to_all(comm, x, out_splits, in_splits, kind)

    @staticmethod
    def backward(ctx, dy):
        out_splits, in_splits = ctx.splits
        return (all_to_all(ctx.comm, dy, in_splits, out_splits, ctx.grad_kind),
                None, None, None, None, None)
