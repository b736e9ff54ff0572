"""Your own MoE under expert parallelism: the contract a module keeps for `expert_parallel`.

A module fits when it has

    router    a module or function: router(x) with x (n, d), the tokens as rows, returns
              (weights, ids), both (n, k): each token's k expert ids (integers in 0..E-1) and
              the weight its expert's output is scaled by
    experts   an nn.ModuleList of E experts, each mapping rows (m, d) to (m, d), all alike
              (the same parameter names and shapes: they are gathered back by index)

and its forward is, in one process, what this contract says it is:

    forward(x) = sum over a token's k choices of weights[t, j] x experts[ids[t, j]](x[t])

on x of any shape (..., d). Top-k choice, renormalisation, a softmax or a sigmoid: all of it is
the router's. No capacity: every choice reaches its expert (dropless). A Mixtral-shaped block
(a linear gate, softmax, top-2 renormalised, SwiGLU experts) keeps it as written in
tests/test_expert_parallel.py and the README.

After expert_parallel(module) the module's forward is replaced by the same sum with the rows
sent to the experts' ranks (distlab.parallel.expert.exchange): each rank routes
its own tokens, keeps E/N experts, and reduce_expert_parallel_grads gives every gradient the
one of the mean of the ranks' losses, as for distlab's MoE. A module that does not keep the
contract is refused, naming what is missing; a router whose output does not fit is refused at
the first forward, naming the shapes it returned.
"""

from __future__ import annotations

import torch
from torch import nn

from distlab.comm import Comm
from distlab.parallel.expert.exchange import ExpertParallelLayer, send_to_experts


def check_contract(module: nn.Module) -> None:
    """Refuse a module that does not keep the contract, naming what it lacks."""
    name = type(module).__name__
    missing = []
    if not callable(getattr(module, "router", None)):
        missing.append("a `router` (router(x) -> (weights, ids), each (tokens, k))")
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.ModuleList) or len(experts) == 0:
        missing.append("`experts`, an nn.ModuleList of the E experts")
    if missing:
        raise TypeError(f"expert_parallel: {name} does not keep the MoE contract "
                        f"(distlab.parallel.expert.user): it lacks {' and '.join(missing)}")
    shapes = [[(k, tuple(p.shape)) for k, p in e.named_parameters()] for e in experts]
    if any(s != shapes[0] for s in shapes):
        raise TypeError(f"expert_parallel: {name}'s experts differ in their parameters' names "
                        "or shapes; the contract asks for E alike experts")


def check_routing(weights, ids, n: int, n_experts: int) -> None:
    """The router's output against the contract, at every forward (a cheap check on shapes)."""
    if not (isinstance(weights, torch.Tensor) and isinstance(ids, torch.Tensor)):
        raise TypeError("the MoE's router must return (weights, ids), two tensors, not "
                        f"({type(weights).__name__}, {type(ids).__name__})")
    if ids.dim() != 2 or ids.shape != weights.shape or len(ids) != n:
        raise ValueError(f"the MoE's router returned weights {tuple(weights.shape)} and ids "
                         f"{tuple(ids.shape)} for {n} tokens; the contract: both (tokens, k)")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"the MoE's router returned ids of dtype {ids.dtype}: expert indices "
                        "are integers")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n_experts):
        raise ValueError(f"the MoE's router returned expert ids from {int(ids.min())} to "
                         f"{int(ids.max())}; there are {n_experts} experts")


class UserExpertParallel:
    """Mixed in before your module's class by expert_parallel: the contract's forward, with
    the rows sent to the experts' ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x)
        check_routing(weights, ids, len(x), self.n_experts)
        choice = ids.reshape(-1)
        order = torch.argsort(choice, stable=True)  # by expert; within one, token order
        token = torch.arange(len(x), device=x.device).repeat_interleave(ids.shape[1])[order]
        counts = torch.bincount(choice, minlength=self.n_experts)
        ys = send_to_experts(self.ep_comm, list(self.experts.values()), x[token], counts)
        gate = weights.reshape(-1)[order].unsqueeze(1).to(ys.dtype)
        return x.new_zeros(x.shape).index_add(0, token, ys * gate).view(shape)


def user_expert_parallel(module: nn.Module, comm: Comm, spread) -> nn.Module:
    """expert_parallel for a module of your own (see the module's docstring); `spread` places
    the experts (dispatch.py's, as for distlab's MoE)."""
    check_contract(module)
    module.n_experts = len(module.experts)
    spread(module, comm, module.n_experts, {"class": type(module).__name__})
    cls = type(module)
    module.__class__ = type(f"ExpertParallel{cls.__name__}",
                            (UserExpertParallel, ExpertParallelLayer, cls), {})
    return module
