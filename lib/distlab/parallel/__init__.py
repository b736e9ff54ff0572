"""Strategies: each changes how the one training loop's model is wrapped, how gradients are
reduced and how the optimizer steps. None owns a copy of the loop (see distlab.train)."""

from .base import Strategy
from .data import AllReduceDP, Single

_REGISTRY = {"single": Single, "allreduce": AllReduceDP}


def make_strategy(cfg, comm) -> Strategy:
    return _REGISTRY[cfg.strategy](cfg, comm)


__all__ = ["Strategy", "make_strategy"]
