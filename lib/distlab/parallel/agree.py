"""Ranks agree, or say where they differ.

A wrapper whose ranks were built differently (another width, bucket size, stage, unit or plan)
fails later, inside a collective whose sizes do not match: gloo aborts with "Received data size
doesn't match", naming neither the setting nor the rank, and under tensor parallelism a
broadcast of the wrong size trains on silently with shards that do not fit together. torch's
DDP compares parameter shapes across ranks when it is built; every distlab wrapper does the
same for what it needs equal, before its first collective on the model:

    agree(comm, "distlab.DistributedDataParallel",
          {"parameters": parameter_layout(module), "bucket_mb": bucket_mb})

Each rank sends its settings to every other (one all_gather_object, a few KiB, under the
group's timeout), so every rank raises the same RanksDisagree naming the first setting that
differs, each value, and the ranks that hold it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn


class RanksDisagree(ValueError):
    """The ranks of one group built a wrapper differently."""


def parameter_layout(module: nn.Module, trainable_only: bool = False) -> list[tuple]:
    """(name, shape, dtype, requires_grad) of each parameter in registration order: what a
    wrapper's flat buffers, buckets and shards are laid out from."""
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad)
            for name, p in module.named_parameters() if p.requires_grad or not trainable_only]


def buffer_layout(module: nn.Module) -> list[tuple]:
    """(name, shape, dtype) of each buffer: what a buffer broadcast sends."""
    return [(name, tuple(b.shape), str(b.dtype).removeprefix("torch."))
            for name, b in module.named_buffers()]


def agree(comm, owner: str, settings: dict) -> None:
    """Raise RanksDisagree on every rank of comm's group unless all of them passed equal
    `settings` (name -> a picklable value; lists are compared item by item)."""
    if comm.world == 1:
        return
    every: list = [None] * comm.world
    dist.all_gather_object(every, settings, group=comm.group)
    ranks = _global_ranks(comm)
    for key in settings:
        values = [s.get(key) for s in every]
        if any(v != values[0] for v in values):
            raise RanksDisagree(f"{owner}: the ranks disagree on {key}"
                                f"{_difference(values, ranks)}. Every rank must build it "
                                "with the same model and settings")


def _global_ranks(comm) -> list[int]:
    """The group's ranks as the world numbers them (what a traceback and a log show)."""
    if comm.group is None:
        return list(range(comm.world))
    return dist.get_process_group_ranks(comm.group)


def _difference(values: list, ranks: list[int]) -> str:
    """Where the ranks' values differ (the first differing item of a list) and who holds
    which: ", item 3: (...) on ranks 0, 1, 3; (...) on rank 2"."""
    where, show = "", (lambda v: v if isinstance(v, str) else repr(v))
    if all(isinstance(v, (list, tuple)) for v in values):
        i = next(i for i in range(max(map(len, values)))
                 if len({repr(v[i]) if i < len(v) else "" for v in values}) > 1)
        where, show = f", item {i}", repr
        values = [v[i] if i < len(v) else "(absent: this rank has fewer)" for v in values]
    groups: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        groups.setdefault(show(v), []).append(r)
    return where + ": " + "; ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} "
                                     f"{', '.join(map(str, rs))}" for v, rs in groups.items())
