"""`ep`: expert parallelism composed with data parallelism, on the loop's GPT with MoE blocks
(RunConfig.n_experts > 0).

Every rank is a data-parallel rank: it takes its block of the global batch's rows and holds
the whole dense part of the model (embeddings, attention, norms, the routers). The E experts
of every block are spread over the same ranks, E/N on each (distlab.parallel.expert.dispatch):
each rank routes its own tokens (one GShard group per rank, RunConfig.moe_groups = 0) and
sends them to their experts' ranks and back by all-to-all. After backward, the dense
gradients are averaged over the ranks (one flat all-reduce) and each local expert's gradient,
which arrived summed over every rank's loss, is divided by N: the gradient of the global
batch's mean loss, so the run follows `single` with moe_groups = N step for step.

Each step's event carries, per MoE block, the tokens routed to each expert and the choices
dropped over capacity on this rank (`step_info`), what the experts notebook plots live.
"""

from __future__ import annotations

import torch

from distlab.models.moe import MoE
from distlab.parallel.base import Strategy
from distlab.parallel.expert.dispatch import (
    expert_parallel,
    expert_parallel_state_dict,
    reduce_expert_parallel_grads,
)


class ExpertParallelDP(Strategy):
    name = "ep"
    any_model = False  # distlab's GPT with MoE blocks (n_experts)
    supports = Strategy.supports | {"moe"}

    @classmethod
    def mesh_preset(cls, cfg):  # every rank a replica of the dense part, ep over all of them
        return {"dp_shard": cfg.world_size, "ep": cfg.world_size, "zero_stage": 0}

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.n_experts % cfg.world_size:
            raise ValueError(f"n_experts={cfg.n_experts} must be divisible by world_size="
                             f"{cfg.world_size}: each rank holds n_experts / world_size experts")
        if cfg.moe_groups not in (0, cfg.world_size):
            raise ValueError(f"moe_groups={cfg.moe_groups}: under ep each rank routes its own "
                             "tokens as one group; leave moe_groups at 0")

    def wrap(self, model):
        with torch.no_grad():  # the dense part: rank 0's weights everywhere
            self.comm.broadcast_tensors(
                [t.data for name, t in list(model.named_parameters())
                 + list(model.named_buffers()) if ".experts." not in name], src=0)
        for block in model.blocks:  # the experts: broadcast inside, then each keeps its own
            expert_parallel(block.mlp, self.comm)
        self.moes = [b.mlp for b in model.blocks]
        return model

    def reduce_gradients(self, model):
        reduce_expert_parallel_grads(model, self.comm)

    def full_state_dict(self, model) -> dict:
        return expert_parallel_state_dict(model)

    def state_bytes(self, model, optimizer) -> dict:
        from distlab.memory import model_state_bytes
        return model_state_bytes(model, optimizer)  # this rank's experts only: what it holds

    def step_info(self) -> dict:
        return {"moe": routing_info(self.moes)}


def routing_info(moes: list) -> list[dict]:
    """Per MoE block that routed this step: its tokens per expert, the choices dropped over
    capacity, the capacity, its tokens and its balance loss (the step event's "moe")."""
    return [{"tokens_per_expert": m.last_stats["tokens_per_expert"],
             "dropped": m.last_stats["dropped"], "capacity": m.last_stats["capacity"],
             "tokens": m.last_stats["tokens"], "aux_loss": float(m.aux_loss.detach())}
            for m in moes if isinstance(m, MoE) and m.last_stats]
