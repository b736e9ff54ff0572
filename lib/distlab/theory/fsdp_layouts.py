"""fully_shard's two layouts by formula: the padding each adds, and so the bytes each moves.

    flat       a unit's Ψ_u entries side by side, padded to a multiple of N
               (the ZeRO paper's partitions; distlab.parallel.zero.optimizer.padded_size):
               P_u = ceil(Ψ_u / N) · N
    per_param  each parameter of shape (d0, ...) cut on dim 0 into N chunks of c = ceil(d0 / N)
               rows, the short ones padded (FSDP2's; distlab.parallel.zero.per_param):
               P_u = Σ_i N · ceil(d0_i / N) · (entries per row of i)

Flat pads at most N − 1 entries per unit; per-parameter up to (N − 1) rows per parameter, so
its padding grows with the number of parameters and the width of their rows: a (1, h) gain
vector gathered over N ranks moves N·h entries. Either way every rank's all-gather slice and
reduce-scatter block is P_u / N entries, and per step and rank (the ring's convention,
distlab.comm) ZeRO-3 moves

    all-gather       g · (N − 1)/N · b · Σ_u P_u     g: gathers per unit and step (2: forward
                                                     and again for backward)
    reduce-scatter       (N − 1)/N · b · Σ_u P_u     b: bytes per entry (4 for fp32)

The number of collectives is the same in both layouts (one per unit per gather): only the
bytes and the copying differ.
"""

from __future__ import annotations

import math

LAYOUTS = ("flat", "per_param")


def unit_padded(shapes: list[tuple], world: int, layout: str) -> int:
    """Entries one all-gather of a unit whose parameters have these shapes delivers (P_u)."""
    if layout == "flat":
        numel = sum(math.prod(s) for s in shapes)
        return -(-numel // world) * world
    if layout == "per_param":
        return sum(world * -(-s[0] // world) * math.prod(s[1:]) for s in shapes)
    raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")


def padded(units: list[list[tuple]], world: int, layout: str) -> int:
    """Σ_u P_u: every unit's gathered entries, padding included."""
    return sum(unit_padded(shapes, world, layout) for shapes in units)


def padding(units: list[list[tuple]], world: int, layout: str) -> int:
    """The entries of Σ_u P_u that are padding (zeros on the wire)."""
    return padded(units, world, layout) - sum(math.prod(s) for u in units for s in u)


def step_bytes(units: list[list[tuple]], world: int, layout: str, element_bytes: int = 4,
               gathers: int = 2) -> dict:
    """Bytes one rank sends per step: {"all_gather", "reduce_scatter"} (see the docstring)."""
    share = (world - 1) / world * element_bytes * padded(units, world, layout)
    return {"all_gather": gathers * share, "reduce_scatter": share}
