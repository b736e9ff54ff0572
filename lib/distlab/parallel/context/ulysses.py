"""Ulysses: trade the sequence split for a head split, attend, trade back.

Jacobs et al. 2023 ("DeepSpeed Ulysses"). Each rank holds T/N tokens of all H heads. One
all-to-all gives each rank all T tokens of H/N heads; attention then runs whole and local
(any kernel, any mask); a second all-to-all returns the output to the sequence split. Per rank
each all-to-all moves (N-1)/N of its q, k, v (or output) tensor: 4 of them forward and 4
backward, a volume that does not grow with the ring's N-1 hops but needs H divisible by N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distlab.comm import Comm
from distlab.parallel.all_to_all import AllToAll
from distlab.parallel.context import layout as L

KIND = "cp.a2a"  # Comm's byte kind for both ways (equal blocks: the backward is the same)


def seq_to_heads(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(B, H, T/N, D), this rank's tokens -> (B, H/N, T, D), this rank's heads (the
    sequence in rank order: rank 0's tokens, then rank 1's, ...)."""
    B, H, Tl, D = x.shape
    N = comm.world
    blocks = x.view(B, N, H // N, Tl, D).transpose(0, 1)  # block i: head group i
    got = AllToAll.apply(blocks, comm, None, None, KIND, KIND)  # block i: rank i's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // N, N * Tl, D)


def heads_to_seq(y: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The inverse of seq_to_heads."""
    B, Hl, T, D = y.shape
    N = comm.world
    blocks = y.view(B, Hl, N, T // N, D).permute(2, 0, 1, 3, 4)  # block i: rank i's tokens
    got = AllToAll.apply(blocks, comm, None, None, KIND, KIND)  # block i: head group i
    return got.transpose(0, 1).reshape(B, N * Hl, T // N, D)


def ulysses_attention(q, k, v, comm: Comm, layout: str = "contiguous") -> torch.Tensor:
    """Causal attention of this rank's tokens (q, k, v: (B, H, T/N, D) in `layout`'s order)
    over the whole sequence, through a head split; H must be divisible by the ranks."""
    H, N = q.shape[1], comm.world
    if H % N:
        raise ValueError(f"Ulysses splits the {H} heads over {N} ranks: use a head count "
                         f"divisible by {N} (or ring attention, which does not split heads)")
    qh, kh, vh = (seq_to_heads(t, comm) for t in (q, k, v))
    T = qh.shape[-2]
    order = torch.cat([L.positions(T, r, N, layout) for r in range(N)]).to(q.device)
    if torch.equal(order, torch.arange(T, device=q.device)):
        y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:  # zigzag: put the tokens in sequence order for the causal kernel, then back
        back = torch.argsort(order)
        y = F.scaled_dot_product_attention(qh[..., back, :], kh[..., back, :],
                                           vh[..., back, :], is_causal=True)[..., order, :]
    return heads_to_seq(y, comm)
