"""Expert parallelism (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021):
the E experts of a MoE layer spread over the N ranks of a group, E/N on each; every rank routes
its own tokens and sends each token's row to the rank that holds its expert.

    rank r holds experts r·E/N ... (r+1)·E/N - 1; the router is replicated

    on each rank, for its own tokens (one GShard group, or moe.groups of them):
      route      top-k gates, capacity computed on this rank's tokens       (models/moe.py)
      sort       kept rows by expert: the rows bound for rank j form block j
      counts     all_to_all of the (E,) row counts: what each rank receives  "ep.counts"
      dispatch   all_to_all of the rows, uneven splits                       "ep.dispatch"
      experts    each local expert once, on its rows from every rank
      combine    all_to_all of the outputs back, the splits swapped          "ep.combine"
      scatter    outputs x gates, added back in token order

    backward: each all_to_all's gradient is the reverse all_to_all ("ep.combine.grad" carries
    the outputs' gradients to the experts' ranks, "ep.dispatch.grad" the inputs' gradients
    home), so the router and the inputs learn on the rank that sent the rows, the experts on
    the rank that holds them

Bytes: a rank sends the rows whose experts live elsewhere, |rows| x d x element size; with a
balanced routing that is (N-1)/N of its dispatch buffer, each of the four times.

Gradients. Each rank computes the loss on its own rows (data parallel over the group), and one
process on the whole batch computes the mean of the ranks' losses (with groups = N: see
distlab.models.moe).
So the replicated parameters (router, everything outside the MoE layers) need their gradients
averaged over the ranks, as DDP does; an expert's gradient already arrives summed over every
rank's loss (the combine's backward brings each rank's output gradients to it), so it needs
dividing by N. `reduce_expert_parallel_grads(model)` does both after backward, before the
optimizer's step. `expert_parallel_state_dict(model)` gathers the experts back under one
process's names and shapes.
"""

from __future__ import annotations

import torch
from torch import nn

from distlab.comm import Comm
from distlab.models.moe import MoE
from distlab.parallel.agree import agree, parameter_layout
from distlab.parallel.expert.exchange import KINDS, ExpertParallelLayer, send_to_experts
from distlab.parallel.expert.user import user_expert_parallel


class ExpertParallelMoE(ExpertParallelLayer, MoE):
    """distlab's MoE after expert_parallel: run_experts sends the rows to the experts' ranks."""

    def run_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return send_to_experts(self.ep_comm, list(self.experts.values()), xs, counts,
                               self.grouped)


def _spread(layer: nn.Module, comm: Comm, n_experts: int, settings: dict) -> None:
    """Rank 0's parameters everywhere, then each rank keeps its E/N experts."""
    N = comm.world
    if n_experts % N:
        raise ValueError(f"expert_parallel: n_experts={n_experts} is not divisible by the "
                         f"group's {N} ranks: each rank holds n_experts / {N} experts")
    agree(comm, "distlab.expert_parallel", {"parameters": parameter_layout(layer), **settings})
    if N > 1:
        with torch.no_grad():
            comm.broadcast_tensors([p.data for p in layer.parameters()], src=0)
    first = comm.rank * (n_experts // N)
    layer.experts = nn.ModuleDict({str(i): layer.experts[i]
                                   for i in range(first, first + n_experts // N)})
    layer.ep_comm, layer.ep_first = comm, first


def expert_parallel(moe: nn.Module, comm: Comm | None = None) -> nn.Module:
    """Spread a MoE layer's experts over comm's group (default: the world), in place.

    `moe` is distlab's MoE, or your own module that keeps the contract of `distlab.parallel.
    expert.user` (a `router` returning each token's weights and expert ids, a ModuleList
    `experts`). Every rank takes rank 0's router and experts (broadcast), then keeps experts
    r·E/N ... (r+1)·E/N - 1 and drops the others' parameters. Each rank feeds its own tokens;
    capacity and the auxiliary loss are per rank (GShard's groups). The rest of the model is
    the caller's to keep alike (same seed, or a broadcast). After backward, call
    reduce_expert_parallel_grads(model) before the optimizer's step."""
    if isinstance(moe, ExpertParallelLayer):
        raise ValueError("this MoE is already expert-parallel: call expert_parallel once")
    comm = comm if comm is not None else Comm()
    if not isinstance(moe, MoE):
        return user_expert_parallel(moe, comm, _spread)
    _spread(moe, comm, moe.n_experts,
            {"top_k": moe.top_k, "groups": moe.groups, "capacity_factor": moe.capacity_factor,
             "bias_rate": moe.bias_rate, "grouped": moe.grouped})
    moe.__class__ = ExpertParallelMoE
    return moe


def _ep_layers(model: nn.Module) -> dict[str, ExpertParallelLayer]:
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, ExpertParallelLayer)}
    if not layers:
        raise ValueError("the model has no expert-parallel MoE layer: call expert_parallel on "
                         "its MoE layers first")
    return layers


def reduce_expert_parallel_grads(model: nn.Module, comm: Comm | None = None) -> None:
    """After backward: average the replicated parameters' gradients over the group (one flat
    all-reduce, "ep.grad_all_reduce") and divide the local experts' gradients by N, which
    arrived summed over the ranks' losses. Then every gradient is that of the mean of the
    ranks' losses: one process's on the whole batch. A parameter with no gradient on this rank
    counts as zero (another rank may have used it)."""
    layers = _ep_layers(model)
    comm = comm if comm is not None else next(iter(layers.values())).ep_comm
    experts = [p for m in layers.values() for p in m.experts.parameters()]
    expert_ids = {id(p) for p in experts}
    shared = [p for p in model.parameters() if p.requires_grad and id(p) not in expert_ids]
    if shared and comm.world > 1:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in shared])
        comm.all_reduce_async(flat, kind=KINDS["grads"]).wait()
        flat /= comm.world
        for p, g in zip(shared, flat.split([p.numel() for p in shared])):
            if p.grad is None:
                p.grad = g.view_as(p).clone()
            else:
                p.grad.copy_(g.view_as(p))
    for p in experts:
        if p.grad is not None:
            p.grad.div_(comm.world)


def _gather_experts(moe: ExpertParallelLayer, prefix: str) -> dict:
    """Every expert's state from every rank (a collective), under one process's keys."""
    comm, n_local = moe.ep_comm, len(moe.experts)
    by_expert: dict[int, dict] = {}
    for i, expert in enumerate(moe.experts.values()):
        for name, t in expert.state_dict().items():
            out = t.new_empty(comm.world * t.numel())
            comm.all_gather_async(out, t.contiguous().view(-1), kind=KINDS["state"]).wait()
            for j, block in enumerate(out.view(comm.world, *t.shape)):
                by_expert.setdefault(j * n_local + i, {})[name] = block.clone()
    return {f"{prefix}experts.{g}.{name}": t
            for g in sorted(by_expert) for name, t in by_expert[g].items()}


def expert_parallel_state_dict(model: nn.Module) -> dict:
    """The model's state_dict under one process's keys and shapes: each expert-parallel MoE's
    experts all-gathered from the group, in expert order (a collective: every rank calls it)."""
    layers = {(name + "." if name else ""): m for name, m in _ep_layers(model).items()}
    out, done = {}, set()
    for key, value in model.state_dict().items():
        prefix = next((p for p in layers if key.startswith(p + "experts.")), None)
        if prefix is None:
            out[key] = value
        elif prefix not in done:  # the layer's first expert key: all its experts, in order
            out.update(_gather_experts(layers[prefix], prefix))
            done.add(prefix)
    return out
