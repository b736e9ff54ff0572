"""Several optimizers stepped as one: what the loop holds when one run shards its parameters
over more than one group (the mesh's dense ZeRO over dp_shard x cp beside its experts' over
edp; Megatron-Core calls its own a ChainedOptimizer). The loop reads param_groups (the
learning-rate schedule writes lr there), steps and zeroes; each optimizer keeps its own state.
"""

from __future__ import annotations

import collections


class ChainedOptimizer:
    """`optimizers` stepped, zeroed and read as one optimizer, in order."""

    def __init__(self, optimizers: list):
        if not optimizers:
            raise ValueError("ChainedOptimizer needs at least one optimizer")
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        """Every optimizer's groups (the same dicts: a new lr reaches the optimizer)."""
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> collections.ChainMap:
        """Every optimizer's state (keys are tensors: no two optimizers share one)."""
        return collections.ChainMap(*(o.state for o in self.optimizers))

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"chained": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        parts = state_dict.get("chained")
        if parts is None or len(parts) != len(self.optimizers):
            raise ValueError(f"the state dict holds {len(parts or [])} optimizers' states, "
                             f"this chain {len(self.optimizers)}")
        for o, sd in zip(self.optimizers, parts):
            o.load_state_dict(sd)
