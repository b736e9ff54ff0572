"""Expert parallelism (dispatch.py: a MoE layer's experts spread over the ranks, tokens sent to
them and back by all-to-all; strategy.py: `ep` in the training loop). The MoE layer itself, in
one process, is distlab.models.moe (router, top-1/top-2 gating, capacity, the load-balancing
loss), re-exported here.

May import: the foundation (comm), models/ and parallel/agree."""

from distlab.parallel.expert.dispatch import (
    KINDS,
    expert_parallel,
    expert_parallel_state_dict,
    reduce_expert_parallel_grads,
)
from distlab.models.moe import MoE, Routing

__all__ = ["KINDS", "MoE", "Routing", "expert_parallel", "expert_parallel_state_dict",
           "reduce_expert_parallel_grads"]
