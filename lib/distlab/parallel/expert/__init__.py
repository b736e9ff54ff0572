"""Mixture of experts in one process (moe.py: router, top-1/top-2 gating, capacity, the
load-balancing loss) and expert parallelism (dispatch.py: the experts spread over the ranks,
tokens sent to them and back by all-to-all).

May import: the foundation (comm) and parallel/agree."""

from distlab.parallel.expert.dispatch import (
    KINDS,
    expert_parallel,
    expert_parallel_state_dict,
    reduce_expert_parallel_grads,
)
from distlab.parallel.expert.moe import MoE, Routing

__all__ = ["KINDS", "MoE", "Routing", "expert_parallel", "expert_parallel_state_dict",
           "reduce_expert_parallel_grads"]
