"""ZeRO for the experts of an expert-parallel model: their own shards, over their own group.

Under expert parallelism the ranks of an ep group hold different experts, so one ZeRO over the
data-parallel ranks would flatten different tensors into one unit. The experts are instead
sharded over edp, the ranks that hold the same experts (torchtitan shards its experts with
FSDP over the data-parallel ranks left after ep, and its dense layers over all of them;
Megatron-Core's distributed optimizer keeps expert and dense parameters in separate buffers
for the same reason). The dense parameters keep their ZeRO over dp_shard x cp; the two
optimizers step as one (distlab.parallel.zero.chained).

    stage  units (this rank's local experts)        per step over edp (N ranks, P padded)
    1      one: all of them                          reduce-scatter + all-gather, (N-1)/N·4P each
    2      one per expert                            the same; the reduce-scatters in backward
    3      one per expert (distlab.fully_shard on    two all-gathers per forward-and-backward
           the expert, its two layers one unit)      (forward, and backward's prefetch) and one
                                                     reduce-scatter, (N-1)/N·4P each

An expert's gradient arrives summed over its ep group's losses (the combine's backward brings
every rank's output gradients to it), so after the reduce-scatter's average over edp each
shard is divided by ep: the global batch's mean, as the unsharded path's divide-then-average.
"""

from __future__ import annotations

import contextlib

import torch

from distlab.comm import Comm
from distlab.parallel.zero.fsdp import fully_shard
from distlab.parallel.zero.optimizer import ZeroOptimizer


class ExpertZeRO:
    """ZeRO stage `stage` of the local experts of `moes` (ExpertParallelMoE layers) over comm's
    group (edp), dividing the reduced gradients by `ep`. The mesh calls it beside its dense
    ZeRO: wrap, build_optimizer, then per step reduce_gradients."""

    def __init__(self, stage: int, comm: Comm, ep: int, policy=None, prefetch: int = 1):
        if stage not in (1, 2, 3):
            raise ValueError(f"stage={stage!r} is not one of 1, 2, 3")
        self.stage, self.comm, self.ep = stage, comm, ep
        self.policy, self.prefetch = policy, prefetch
        self.experts: list[tuple[str, torch.nn.Module]] = []
        self.optimizers: list[ZeroOptimizer] = []

    def params(self) -> list:
        return [p for _, e in self.experts for p in e.parameters() if p.requires_grad]

    def wrap(self, moes: dict) -> None:
        """moes: {qualified name: ExpertParallelMoE}. Stage 3 shards each expert now."""
        self.experts = [(f"{name}.experts.{key}", e) for name, moe in moes.items()
                        for key, e in moe.experts.items()]
        if self.stage == 3:
            for name, e in self.experts:  # its layers one unit, so backward gathers it again
                fully_shard(e, units=[[n for n, _ in e.named_children()]], comm=self.comm,
                            mp_policy=self.policy, prefetch=self.prefetch)
                for u in e._distlab_fsdp.units:
                    u.name = name  # the expert's name in the model, not "fc1+fc2"

    def build_optimizer(self, make) -> list[ZeroOptimizer]:
        """`make(groups)`'s optimizer over this rank's shards: one ZeroOptimizer (stages 1/2)
        or one per expert (stage 3: a ZeroOptimizer steps one fully_shard module's units)."""
        inner = lambda groups, **defaults: make(groups)  # noqa: E731 (RunConfig's settings)
        if self.stage == 3:
            self.optimizers = [ZeroOptimizer([{"params": list(e.parameters()), "name": n}],
                                             inner) for n, e in self.experts]
        else:
            groups = ([{"params": self.params(), "name": "experts"}] if self.stage == 1 else
                      [{"params": list(e.parameters()), "name": n} for n, e in self.experts])
            self.optimizers = [ZeroOptimizer(groups, inner, stage=self.stage, comm=self.comm)]
        return self.optimizers

    @property
    def units(self) -> list:
        return [u for o in self.optimizers for u in o.units]

    def no_sync(self):
        stack = contextlib.ExitStack()
        for o in self.optimizers:
            stack.enter_context(o.no_sync())
        return stack

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Each shard: the mean over edp of the ep-summed gradients, divided by ep. Call once
        per step (the division is not idempotent)."""
        for o in self.optimizers:
            o.reduce_gradients()
        for g in self.gradient_shards():
            g.div_(self.ep)

    def gradient_shards(self) -> list[torch.Tensor]:
        return [u.grad_shard for u in self.units]

    def state_bytes(self) -> dict:
        """Bytes of the experts' parameters, gradients and optimizer state on this rank."""
        from distlab.parallel.zero.stages import units_bytes
        state = {k: v for o in self.optimizers for k, v in o.state.items()}
        return units_bytes(self.units, self.stage, state)

    def step_info(self) -> dict:
        """What the step event records: the stage, the group's size and each unit's entries
        (name, numel, padded)."""
        return {"stage": self.stage, "ranks": self.comm.world,
                "units": [[u.name, u.numel, u.padded] for u in self.units]}
