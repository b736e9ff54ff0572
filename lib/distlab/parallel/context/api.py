"""`distlab.ContextParallel`: context parallelism for a user's own attention module.

    cp = distlab.ContextParallel(layout="zigzag", attention="ring")   # over the whole world
    x = cp.shard(tokens, dim=1)              # this rank's tokens of every sequence
    pos = cp.positions(T)                    # their positions (for position embeddings)
    ...
    y = cp.attention(q, k, v)                # in the module: instead of
                                             # F.scaled_dot_product_attention(q, k, v,
                                             #                                is_causal=True)

q, k, v are (B, H, T/N, D) over this rank's tokens; everything outside attention (norms, MLPs,
embeddings, the loss) works token by token and needs nothing. The loss on this rank's tokens,
averaged over the ranks' equal token counts, is the whole sequence's mean; average the
gradients over the ranks as data parallelism does (distlab.DistributedDataParallel does).

attention: "ring" (distlab.parallel.context.ring_attention: K/V blocks around the ring, any
head count) or "ulysses" (distlab.parallel.context.ulysses: all-to-all to a head split; heads
divisible by the ranks). layout: "zigzag" (balanced causal work) or "contiguous"
(distlab.parallel.context.layout). PyTorch's own context_parallel() runs only with its CUDA
attention kernels, so on CPU the check is against one process (tests/test_context_parallel.py).
"""

from __future__ import annotations

import torch

from distlab.comm import Comm
from distlab.parallel.context import layout as L
from distlab.parallel.context.ring_attention import RingStats, ring_attention
from distlab.parallel.context.ulysses import ulysses_attention

ATTENTIONS = ("ring", "ulysses")


class ContextParallel:
    def __init__(self, layout: str = "zigzag", attention: str = "ring", group=None,
                 comm: Comm | None = None):
        L.n_chunks(1, layout)  # checks the name
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r} is not one of {ATTENTIONS}")
        self.layout, self.kind = layout, attention
        self.comm = comm if comm is not None else Comm(group)
        self.rank, self.world = self.comm.rank, self.comm.world
        self.stats = RingStats()  # ring passes since take_stats(): chunk pairs, seconds

    def positions(self, T: int, device=None) -> torch.Tensor:
        """The global positions of this rank's tokens of a T-token sequence, in its order."""
        return L.positions(T, self.rank, self.world, self.layout).to(device)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return L.shard(x, self.rank, self.world, self.layout, dim)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's tokens of x, in sequence order (a collective; no gradient)."""
        x = x.detach().movedim(dim, 0).contiguous()
        whole = torch.empty((self.world * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                            device=x.device)
        self.comm.all_gather(whole, x)
        pieces = list(whole.movedim(0, dim).chunk(self.world, dim))
        return L.unshard(pieces, self.world, self.layout, dim)

    def attention(self, q, k, v) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence."""
        if self.kind == "ulysses":
            return ulysses_attention(q, k, v, self.comm, self.layout)
        return ring_attention(q, k, v, self.comm, self.layout, self.stats)

    def take_stats(self) -> RingStats:
        """The ring's work and seconds since the last call (a step's, called once a step)."""
        stats, self.stats = self.stats, RingStats()
        return stats
