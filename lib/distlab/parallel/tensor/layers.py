"""The tensor-parallel layers: ColumnParallelLinear and RowParallelLinear (Megatron's names),
each holding its rank's block of an nn.Linear, and _RegionEntry, where a tensor-parallel region
starts (f or g_sp, shared by the layers that read one input). Their docstrings draw the split.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlab.parallel.tensor.operators import (F_Copy, G_Reduce, GatherSeq, ReduceScatterSeq,
                                               same_shape, shapes_due)


class _RegionEntry:
    """Where a tensor-parallel region starts: f (replicated input) or g_sp (sequence-sharded
    input) before a column-parallel layer. Layers that read the same input tensor (q, k and v
    read ln1's output) share one application, as in Megatron's attention: their input
    gradients add up locally, then one all-reduce (or reduce-scatter) completes the sum,
    instead of one per layer. Sums are linear, so sharing changes no value, only the count.
    A tensor PrepareModuleInput already passed through g_sp (`prepared`) needs no entry."""

    def __init__(self, comm):
        self.comm = comm
        self._last = None  # (weak ref to the input, operator, output) of the latest entry
        self._prepared: dict[int, weakref.ref] = {}

    def prepare(self, y):
        """y went through g_sp already (PrepareModuleInput): layers reading it take it as is."""
        self._prepared = {k: r for k, r in self._prepared.items() if r() is not None}
        self._prepared[id(y)] = weakref.ref(y)

    def __call__(self, x, op):
        ref = self._prepared.get(id(x))
        if ref is not None and ref() is x:
            return x
        if self._last is not None:
            src, last_op, y = self._last
            if src() is x and last_op is op:
                return y
        y = op.apply(x, self.comm)
        # the input weakly (a new batch is a new tensor); the output strongly, so q, k and v
        # get the same one even when nothing saves it for backward (under no_grad)
        self._last = (weakref.ref(x), op, y)
        return y


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns (output features) across t ranks:

        X (B,T,in)  @  [ A_0 | A_1 | ... | A_t-1 ]  =  [ Y_0 | Y_1 | ... | Y_t-1 ]
                         in x out/t each                 rank r keeps Y_r (B,T,out/t)

    Each rank needs the whole X: the region's entry operator (f, or g_sp when the input is
    sequence-sharded) provides it, shared by the layers reading the same input. Rank r owns
    b_r. Stored like nn.Linear: weight is (out/t, in), rows r·out/t ... (r+1)·out/t.
    For q, k, v the column blocks are whole heads: out/t = (n_head/t)·head_dim.

    A fused projection (parts: the widths of q, k and v side by side in one Linear, as
    Megatron's and GPT-2's) is split part by part: rank r keeps block r of each part, side by
    side ([q_r | k_r | v_r]), so its output splits into its heads of each."""

    def __init__(self, linear: nn.Linear, comm, entry: _RegionEntry, input_layout="replicate",
                 parts: tuple[int, ...] | None = None):
        super().__init__()
        rows = fused_rows(parts or (linear.out_features,), comm.rank, comm.world)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = (nn.Parameter(linear.bias.detach()[rows].clone())
                     if linear.bias is not None else None)
        self.entry, self.input_layout = entry, input_layout

    def forward(self, x):
        op = GatherSeq if self.input_layout == "sequence" else F_Copy
        return F.linear(self.entry(x, op), self.weight, self.bias)


def fused_rows(parts: tuple[int, ...], rank: int, world: int) -> torch.Tensor:
    """The output features rank `rank` keeps of parts side by side: block `rank` of each."""
    rows, start = [], 0
    for width in parts:
        n = width // world
        rows.append(torch.arange(start + rank * n, start + (rank + 1) * n))
        start += width
    return torch.cat(rows)


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows (input features) across t ranks:

                                 [ A_0   ]   in/t x out
        [ X_0 | X_1 | ... ]  @   [ A_1   ]              =  X_0 A_0 + X_1 A_1 + ...  (partial sums)
          rank r has X_r         [ ...   ]
                                 [ A_t-1 ]

    Rank r computes X_r A_r (B,T,out), a partial sum; the region's exit (g: all-reduce, or
    g_sp_bar: reduce-scatter along T when the output is sequence-sharded) sums them; then the
    replicated bias is added once. Stored like nn.Linear: weight is (out, in/t), columns
    r·in/t ... (r+1)·in/t."""

    def __init__(self, linear: nn.Linear, comm, output_layout="replicate", name=""):
        super().__init__()
        n = linear.in_features // comm.world
        cols = slice(comm.rank * n, (comm.rank + 1) * n)
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.comm, self.output_layout, self.name = comm, output_layout, name
        self.check_shapes = False  # parallelize_module's: when same_shape runs first
        self.calls = 0  # forwards so far (every rank of the group counts the same)

    def forward(self, x):
        if x.shape[-1] != self.weight.shape[1]:
            raise RuntimeError(
                f"RowwiseParallel '{self.name}' takes this rank's block of its input features "
                f"({self.weight.shape[1]} of them) and got {x.shape[-1]}: put ColwiseParallel "
                f"on the linear layer that feeds it, whose output is that block")
        exit_op = ReduceScatterSeq if self.output_layout == "sequence" else G_Reduce
        partial = F.linear(x, self.weight)
        self.calls += 1
        if shapes_due(self.check_shapes, self.calls):
            how = "reduce-scattered" if self.output_layout == "sequence" else "all-reduced"
            same_shape(self.comm, partial, f"the partial output of RowwiseParallel "
                                           f"'{self.name}' (its sum is {how})")
        y = exit_op.apply(partial, self.comm)
        return y if self.bias is None else y + self.bias
