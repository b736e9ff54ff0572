"""Which tokens of a sequence each rank of a context-parallel group holds.

The sequence of T tokens is cut into chunks; a rank holds whole chunks (its "positions", in
the order it stores them):

    contiguous  N chunks of T/N; rank r holds chunk r. Under a causal mask rank r's queries see
                the keys of chunks 0..r: the last rank does N blocks of work, the first one,
                so the slowest rank does 2N/(N+1) times the mean (1.33x at N=2, 1.6x at 4,
                toward 2x): the others wait for it.
    zigzag      2N chunks of T/(2N); rank r holds chunks r and 2N-1-r (one early, one late),
                so every rank's queries see 2N+1 chunk pairs: balanced work. The
                load-balanced split of Megatron-Core's context parallelism (the Ultra-Scale
                Playbook calls it zig-zag).

Chunk pairs are the unit of work (chunk_pairs): a query chunk a and key chunk b are computed
whole when b < a, on the diagonal with the causal mask when b == a, and skipped when b > a.
"""

from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "zigzag")


def n_chunks(world: int, layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    return world if layout == "contiguous" else 2 * world


def chunks_of(rank: int, world: int, layout: str) -> list[int]:
    """The chunk indices rank holds, in the order it stores them."""
    if n_chunks(world, layout) == world:
        return [rank]
    return [rank, 2 * world - 1 - rank]


def check_length(T: int, world: int, layout: str) -> int:
    """The chunk length; T must cut into equal chunks."""
    c = n_chunks(world, layout)
    if T % c:
        raise ValueError(f"a sequence of {T} tokens does not cut into {c} equal chunks "
                         f"({layout} layout over {world} ranks): use a length divisible by {c}")
    return T // c


def positions(T: int, rank: int, world: int, layout: str) -> torch.Tensor:
    """The global positions of the tokens rank holds, in its storage order."""
    size = check_length(T, world, layout)
    return torch.cat([torch.arange(c * size, (c + 1) * size)
                      for c in chunks_of(rank, world, layout)])


def shard(x: torch.Tensor, rank: int, world: int, layout: str, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of x along dim (a copy)."""
    idx = positions(x.shape[dim], rank, world, layout).to(x.device)
    return x.index_select(dim, idx)


def unshard(pieces: list[torch.Tensor], world: int, layout: str, dim: int = 1) -> torch.Tensor:
    """Every rank's tokens (pieces in rank order) back in sequence order."""
    T = sum(p.shape[dim] for p in pieces)
    order = torch.cat([positions(T, r, world, layout) for r in range(world)])
    whole = torch.cat(pieces, dim=dim)
    return whole.index_select(dim, torch.argsort(order).to(whole.device))


def chunk_pairs(rank: int, src: int, world: int, layout: str) -> list[tuple[int, int, str]]:
    """The (query chunk slot, key chunk slot, kind) pairs rank computes against src's keys:
    slots index the chunks as each rank stores them; kind "full" or "diagonal" (causal)."""
    pairs = []
    for i, a in enumerate(chunks_of(rank, world, layout)):
        for j, b in enumerate(chunks_of(src, world, layout)):
            if b < a:
                pairs.append((i, j, "full"))
            elif b == a:
                pairs.append((i, j, "diagonal"))
    return pairs


def causal_work(world: int, layout: str) -> list[int]:
    """Chunk pairs each rank computes over a whole ring pass (diagonal ones counted whole,
    as the kernel computes them): the formula behind the measured idle time."""
    return [sum(len(chunk_pairs(r, s, world, layout)) for s in range(world))
            for r in range(world)]
