"""Reading one rank's step event: the bytes it booked and the memory it held, under any strategy.

Where a step event (distlab.rank.train, `run.history("step")`) keeps them:

    comm        {kind: stats} booked on the world's Comm: every strategy's collectives, but ...
    mesh.comm   ... `3d`'s, booked per group on the group's own Comm (distlab.parallel.mesh):
                {group kind: {kind: stats}}; its world Comm books nothing
    memory      {category: bytes}; "activations" is what the loop's forward saved for backward
    pipeline    where a pipeline schedule owns the forward (pp, 3d), the loop saw none: the
                activations are the schedule's peak of stashed micro-batches, "peak_stash_bytes"

Read them through these functions, not by hand, so every reader (the live dashboard, the
notebooks' companions) counts 3d's bytes and a pipeline's activations alike.
"""

from __future__ import annotations


def comm(event: dict) -> dict[str, dict]:
    """Every collective kind the rank booked in the step, {kind: stats}: the world Comm's kinds
    as they are, a mesh group's prefixed by the group ("tp.tp.all_reduce", "dp.reduce_scatter")."""
    out = dict(event.get("comm") or {})
    for group, kinds in ((event.get("mesh") or {}).get("comm") or {}).items():
        out.update({f"{group}.{kind}": stats for kind, stats in kinds.items()})
    return out


def bytes_sent(event: dict) -> int:
    """Bytes the rank's collectives booked in the step (distlab.comm's formulas and counts),
    summed over every kind, the mesh groups' included."""
    return sum(stats["bytes_sent"] for stats in comm(event).values())


def memory(event: dict) -> dict[str, int]:
    """The rank's memory by category at the step's end, "activations" being the activations the
    step saved for backward: the loop's measure, or the pipeline schedule's peak stash where the
    schedule ran the forward."""
    out = dict(event.get("memory") or {})
    stash = (event.get("pipeline") or {}).get("peak_stash_bytes")
    if stash is not None:
        out["activations"] = stash
    return out
