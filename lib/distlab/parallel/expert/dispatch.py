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
from distlab.parallel.agree import agree, parameter_layout
from distlab.parallel.all_to_all import AllToAll
from distlab.parallel.all_to_all import all_to_all as _all_to_all
from distlab.models.moe import MoE

KINDS = {"counts": "ep.counts", "dispatch": "ep.dispatch", "combine": "ep.combine",
         "dispatch_grad": "ep.dispatch.grad", "combine_grad": "ep.combine.grad",
         "grads": "ep.grad_all_reduce", "state": "ep.all_gather"}


class ExpertParallelMoE(MoE):
    """A MoE after expert_parallel (the class is swapped in place, as torch's fully_shard does):
    `experts` holds this rank's experts only, keyed by their index among all E, so its
    state_dict keys are one process's; run_experts sends the rows to the experts' ranks."""

    def run_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        comm, n_local = self.ep_comm, len(self.experts)
        N = comm.world
        with torch.no_grad():  # received[j, e]: rows rank j sends for my local expert e
            received = _all_to_all(comm, counts, [n_local] * N, [n_local] * N,
                                   KINDS["counts"]).view(N, n_local)
        send = counts.view(N, n_local).sum(1).tolist()
        recv = received.sum(1).tolist()
        xr = AllToAll.apply(xs, comm, recv, send, KINDS["dispatch"], KINDS["dispatch_grad"])
        comm.note_buffer(max(xs.numel(), xr.numel()) * xs.element_size())
        # the rows arrive by source rank, then expert; order them by expert, so each expert
        # runs once on all its rows (stable: source rank 0's first, as one process has them)
        local = torch.repeat_interleave(torch.arange(n_local).repeat(N), received.view(-1))
        order = torch.argsort(local, stable=True)
        chunks = xr[order].split(received.sum(0).tolist())
        ye = torch.cat([e(c) for e, c in zip(self.experts.values(), chunks)])
        yr = ye[torch.argsort(order)]  # back to arrival order
        return AllToAll.apply(yr, comm, send, recv, KINDS["combine"], KINDS["combine_grad"])

    def extra_repr(self) -> str:
        n_local = len(self.experts)
        return (super().extra_repr() + f", expert_parallel: experts {self.ep_first}.."
                f"{self.ep_first + n_local - 1} of {self.n_experts} on rank {self.ep_comm.rank} "
                f"of {self.ep_comm.world}")


def expert_parallel(moe: MoE, comm: Comm | None = None) -> MoE:
    """Spread a MoE layer's experts over comm's group (default: the world), in place.

    Every rank takes rank 0's router and experts (broadcast), then keeps experts
    r·E/N ... (r+1)·E/N - 1 and drops the others' parameters. Each rank feeds its own tokens;
    capacity and the auxiliary loss are per rank (GShard's groups). The rest of the model is
    the caller's to keep alike (same seed, or a broadcast). After backward, call
    reduce_expert_parallel_grads(model) before the optimizer's step."""
    if not isinstance(moe, MoE):
        raise TypeError(f"expert_parallel applies to distlab's MoE, not {type(moe).__name__}")
    if isinstance(moe, ExpertParallelMoE):
        raise ValueError("this MoE is already expert-parallel: call expert_parallel once")
    comm = comm if comm is not None else Comm()
    E, N = moe.n_experts, comm.world
    if E % N:
        raise ValueError(f"expert_parallel: n_experts={E} is not divisible by the group's {N} "
                         f"ranks: each rank holds n_experts / {N} experts")
    agree(comm, "distlab.expert_parallel",
          {"parameters": parameter_layout(moe), "top_k": moe.top_k, "groups": moe.groups,
           "capacity_factor": moe.capacity_factor})
    if N > 1:
        with torch.no_grad():
            comm.broadcast_tensors([p.data for p in moe.parameters()], src=0)
    first = comm.rank * (E // N)
    moe.experts = nn.ModuleDict({str(i): moe.experts[i] for i in range(first, first + E // N)})
    moe.ep_comm, moe.ep_first = comm, first
    moe.__class__ = ExpertParallelMoE
    return moe


def _ep_layers(model: nn.Module) -> dict[str, ExpertParallelMoE]:
    layers = {name: m for name, m in model.named_modules() if isinstance(m, ExpertParallelMoE)}
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


def _gather_experts(moe: ExpertParallelMoE, prefix: str) -> dict:
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
