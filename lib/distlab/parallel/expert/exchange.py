"""The rows of a MoE layer to their experts' ranks and back: three all-to-alls with uneven
splits (distlab.parallel.all_to_all), used by distlab's MoE (dispatch.py) and by a MoE of your
own (user.py). `ExpertParallelLayer` is what both become after expert_parallel."""

from __future__ import annotations

import torch
from torch import nn

from distlab.comm import Comm
from distlab.models.moe import expert_rows
from distlab.parallel.all_to_all import AllToAll
from distlab.parallel.all_to_all import all_to_all as _all_to_all

KINDS = {"counts": "ep.counts", "dispatch": "ep.dispatch", "combine": "ep.combine",
         "dispatch_grad": "ep.dispatch.grad", "combine_grad": "ep.combine.grad",
         "grads": "ep.grad_all_reduce", "state": "ep.all_gather"}


def send_to_experts(comm: Comm, experts: list, xs: torch.Tensor, counts: torch.Tensor,
                    grouped: str = "loop") -> torch.Tensor:
    """Rows xs sorted by expert (all E of the group's), counts[e] for expert e -> each row's
    output, computed on the rank that holds its expert (`experts`: this rank's E/N, in order).
    Counts, dispatch and combine are three all-to-alls with uneven splits."""
    n_local, N = len(experts), comm.world
    with torch.no_grad():  # received[j, e]: rows rank j sends for my local expert e
        received = _all_to_all(comm, counts, [n_local] * N, [n_local] * N,
                               KINDS["counts"]).view(N, n_local)
    send = counts.view(N, n_local).sum(1).tolist()
    recv = received.sum(1).tolist()
    xr = AllToAll.apply(xs, comm, recv, send, KINDS["dispatch"], KINDS["dispatch_grad"])
    comm.note_buffer(max(xs.numel(), xr.numel()) * xs.element_size())
    # the rows arrive by source rank, then expert; order them by expert, so each expert runs
    # once on all its rows (stable: source rank 0's first, as one process has them)
    local = torch.repeat_interleave(torch.arange(n_local).repeat(N), received.view(-1))
    order = torch.argsort(local, stable=True)
    ye = expert_rows(experts, xr[order], received.sum(0).tolist(), grouped)
    yr = ye[torch.argsort(order)]  # back to arrival order
    return AllToAll.apply(yr, comm, send, recv, KINDS["combine"], KINDS["combine_grad"])


class ExpertParallelLayer(nn.Module):
    """What expert_parallel makes of a layer (the class is swapped in place, as torch's
    fully_shard does): `experts` holds this rank's experts only, keyed by their index among
    all E, so its state_dict keys are one process's; `ep_comm` the group, `ep_first` the
    first local expert's index."""

    def extra_repr(self) -> str:
        n_local = len(self.experts)
        return (super().extra_repr() + f", expert_parallel: experts {self.ep_first}.."
                f"{self.ep_first + n_local - 1} of {self.n_experts} on rank {self.ep_comm.rank} "
                f"of {self.ep_comm.world}").lstrip(", ")
