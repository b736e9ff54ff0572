"""Top-k gradient sparsification with error feedback.

Each step a rank sends only the k entries of its gradient with the largest magnitude
(k = ratio·n), and keeps what it did not send in a memory that is added to the next step's
gradient, so nothing is lost, only delayed:

    g_t                 this step's gradient (one DDP bucket, flat, n entries)
    a_t = g_t + e_t     add the error memory: what earlier steps computed but did not send
    s_t = top_k(a_t)    keep the k entries of largest |a_t|, zero the rest
    e_t+1 = a_t - s_t   remember the rest ("error feedback")
    ĝ_t = (1/N) Σ_r s_t^(r)    every rank gathers every rank's (values, indices) and averages

Stich, Cordonnier & Jaggi 2018, "Sparsified SGD with Memory"; Lin et al. 2018, "Deep Gradient
Compression" (DGC adds momentum correction, local gradient clipping and a warm-up of the
sparsity; with plain SGD, error feedback is the part that makes top-k converge).

On the wire, a rank's k values (float32) and k indices (int32) travel packed in one float32
tensor of 2k entries (the indices' bits reinterpreted, not converted), so one all-gather per
bucket carries both. A ring all-gather sends (N-1)·8k bytes per rank, against 2(N-1)/N·4n for
the dense all-reduce: 1/(N·ratio) times fewer bytes. The sum of N sparse vectors is not sparse,
so the all-gather grows with N where the all-reduce does not: top-k pays off at small N·ratio.
"""

from __future__ import annotations

import math

import torch

VALUE_BYTES = 4  # float32 value
INDEX_BYTES = 4  # int32 index


def topk_count(numel: int, ratio: float) -> int:
    """k for a bucket of `numel` entries: ratio·numel rounded, at least 1."""
    return max(1, round(ratio * numel))


def topk_bytes_per_rank(bucket_numels, ratio: float, world: int) -> int:
    """Bytes one rank sends per step (and receives): a ring all-gather of every rank's k values
    and k indices per bucket, Σ_b (N-1)·k_b·(4 + 4)."""
    return sum((world - 1) * topk_count(n, ratio) * (VALUE_BYTES + INDEX_BYTES)
               for n in bucket_numels)


class TopK:
    """The compressor of one rank: per bucket, its error memory e."""

    def __init__(self, ratio: float):
        self.ratio = ratio
        self.memory: dict[int, torch.Tensor] = {}

    def compress(self, key: int, grad: torch.Tensor) -> torch.Tensor:
        """The packed payload [values | indices] of top_k(grad + e); e becomes what was left."""
        a = grad.float() + self.memory[key] if key in self.memory else grad.float().clone()
        k = topk_count(a.numel(), self.ratio)
        idx = a.abs().topk(k, sorted=False).indices
        values = a[idx]
        a[idx] = 0.0  # a is now e_t+1 = a_t - s_t
        self.memory[key] = a
        return torch.cat([values, idx.to(torch.int32).view(torch.float32)])

    @staticmethod
    def decompress(gathered: torch.Tensor, out: torch.Tensor, world: int) -> torch.Tensor:
        """out = (1/N) Σ_r s^(r), from the all-gathered payloads of N ranks (rank order)."""
        rows = gathered.view(world, -1)
        k = rows.shape[1] // 2
        values = rows[:, :k].reshape(-1)
        idx = rows[:, k:].contiguous().view(torch.int32).reshape(-1).long()
        out.zero_().index_add_(0, idx, values.to(out.dtype))  # scatter-add, rank order
        return out.div_(world)


def powersgd_numel(shapes, rank: int, min_compression_rate: float = 2.0) -> int:
    """Entries PyTorch's PowerSGD hook all-reduces per step (torch's powerSGD_hook, after its
    plain first steps): each gradient seen as an n×m matrix (n = its first dimension) travels as
    P (n×r') and Q (m×r'), r' = min(n, m, rank), when that shrinks it by min_compression_rate;
    vectors and the matrices it would not shrink enough travel whole."""
    total = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = math.prod(shape) // n
        r = min(n, m, rank)
        compress = len(shape) > 1 and (n + m) * r * min_compression_rate < n * m
        total += (n + m) * r if compress else n * m
    return total


def powersgd_bytes_per_rank(shapes, rank: int, world: int) -> float:
    """Bytes one rank sends per step: ring all-reduces of those float32 entries,
    2(N-1)/N x 4 x powersgd_numel (Patarasuk & Yuan 2009 for the ring's factor)."""
    return 2 * (world - 1) / world * VALUE_BYTES * powersgd_numel(shapes, rank)
