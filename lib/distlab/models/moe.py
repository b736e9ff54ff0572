"""A mixture-of-experts layer in one process: a router picks k of E expert MLPs per token.

    router     logits = x W_r (nn.Linear d -> E, no bias); p = softmax(logits)
    gating     top-1 (Switch Transformer, Fedus et al. 2021): the best expert, gate p_i
               top-2 (GShard, Lepikhin et al. 2020): the two best, gates renormalised to sum 1
    experts    E small MLPs (Linear d -> h, GELU, Linear h -> d), `moe.experts`
    output     sum over the token's kept choices of gate x expert(x)

Capacity. An expert takes at most C tokens of a group:

    C = ceil(capacity_factor x tokens_per_group x k / E)

the Switch Transformer's "tokens per batch / number of experts x capacity factor", with each
token counted k times as GShard's top-2 does (every token takes k slots). Slots are handed out
first come, first served in a fixed order: within a group, every token's first choice in token
order, then every second choice (GShard: a token's second expert never displaces another
token's first). A choice over capacity is DROPPED: the expert's output for it is zero, so a
residual connection around the layer carries the token unchanged. `last_stats` counts them.

Groups. `groups` splits the (flattened) tokens into equal consecutive groups, each routed with
its own capacity and its own auxiliary loss, as GShard's groups are. Expert parallelism
(distlab.parallel.expert.dispatch) routes each rank's tokens as its groups, so N ranks of
`groups=g` compute exactly what one process computes on their concatenated batch with
`groups=N*g`.

Auxiliary loss (Switch's load balancing), per group, averaged over the groups:

    aux = E x sum_i f_i x P_i

f_i the fraction of tokens whose first choice is expert i (before capacity: what the router
asked for), P_i the mean router probability of expert i. f carries no gradient; P does, and
pushes probability away from busy experts. A uniform router (P_i = 1/E) gives aux = 1 whatever f
is; a router that sends most tokens to a few experts and gives those most of its probability
gives more, up to E (every token to one expert with probability 1). `moe.aux_loss` is the
tensor after each forward (in the graph): add `moe.aux_loss_coef * moe.aux_loss` to the loss.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Routing(NamedTuple):
    """The kept (token, expert) choices of a batch, sorted by expert (stable: within an expert,
    group by group, first choices before second, tokens in order)."""
    token: torch.Tensor   # (A,) the token each kept choice carries
    expert: torch.Tensor  # (A,) its expert, ascending
    gate: torch.Tensor    # (A,) its gate weight (in the graph: the router learns through it)
    counts: torch.Tensor  # (E,) kept choices per expert: A rows split by expert


class Expert(nn.Module):
    """One feed-forward expert: Linear d -> h, GELU, Linear h -> d."""

    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_hidden), nn.Linear(d_hidden, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _check(d_model, d_hidden, n_experts, top_k, capacity_factor, groups):
    for name, v in (("d_model", d_model), ("d_hidden", d_hidden), ("n_experts", n_experts),
                    ("groups", groups)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"MoE: {name}={v!r} must be a positive integer")
    if top_k not in (1, 2):
        raise ValueError(f"MoE: top_k={top_k!r} is not 1 (Switch) or 2 (GShard)")
    if top_k > n_experts:
        raise ValueError(f"MoE: top_k={top_k} needs at least {top_k} experts, not {n_experts}")
    if not capacity_factor > 0:  # written so that NaN is refused too
        raise ValueError(f"MoE: capacity_factor={capacity_factor!r} must be > 0 (each expert "
                         "takes ceil(capacity_factor x tokens x top_k / n_experts) tokens)")


class MoE(nn.Module):
    """Top-k mixture of experts on (B, T, d) or (N, d) inputs; returns the same shape.

    After each forward: `aux_loss` (a tensor in the graph) and `last_stats`:
    tokens_per_expert (choices routed to each expert, before capacity; they sum to tokens x
    top_k), kept_per_expert (after capacity), dropped (choices over capacity: tokens for
    top-1), capacity (per expert and group), tokens (in this forward)."""

    def __init__(self, d_model: int, d_hidden: int, n_experts: int, top_k: int = 1,
                 capacity_factor: float = 1.25, aux_loss_coef: float = 0.01, groups: int = 1):
        super().__init__()
        _check(d_model, d_hidden, n_experts, top_k, capacity_factor, groups)
        self.n_experts, self.top_k, self.groups = n_experts, top_k, groups
        self.capacity_factor, self.aux_loss_coef = float(capacity_factor), aux_loss_coef
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_hidden) for _ in range(n_experts))
        self.aux_loss: torch.Tensor | None = None
        self.last_stats: dict | None = None

    def capacity(self, tokens_per_group: int) -> int:
        return math.ceil(self.capacity_factor * tokens_per_group * self.top_k / self.n_experts)

    def route(self, x: torch.Tensor) -> Routing:
        """Route the tokens x (n, d): gates, capacity, aux_loss and last_stats."""
        n, E, k, G = len(x), self.n_experts, self.top_k, self.groups
        if n % G:
            raise ValueError(f"MoE: {n} tokens do not split into groups={G} equal groups")
        probs = F.softmax(self.router(x), dim=-1)  # (n, E)
        gate, expert = probs.topk(k, dim=-1)       # (n, k), best first
        if k == 2:
            gate = gate / gate.sum(-1, keepdim=True)
        self.aux_loss = self._aux(probs.view(G, n // G, E), expert[:, 0].view(G, n // G))

        # every choice as one row, ordered group, then choice (first before second), then token
        def by_slot(t):
            return t.reshape(G, n // G, k).transpose(1, 2).reshape(G, k * n // G)
        choice, gate = by_slot(expert), by_slot(gate)
        token = by_slot(torch.arange(n, device=x.device).unsqueeze(1).expand(n, k))
        onehot = F.one_hot(choice, E)
        position = (onehot.cumsum(1) * onehot).sum(-1) - 1  # place in its expert's queue
        C = self.capacity(n // G)
        keep = (position < C).view(-1)
        kept = choice.reshape(-1)[keep]
        order = torch.argsort(kept, stable=True)
        counts = torch.bincount(kept, minlength=E)
        routed = torch.bincount(choice.reshape(-1), minlength=E)
        self.last_stats = {"tokens_per_expert": routed.tolist(),
                           "kept_per_expert": counts.tolist(),
                           "dropped": int((~keep).sum()), "capacity": C, "tokens": n}
        return Routing(token.reshape(-1)[keep][order], kept[order],
                       gate.reshape(-1)[keep][order], counts)

    def _aux(self, probs, first):
        """Switch's load-balancing loss per group (probs (G, n, E), first choices (G, n)),
        averaged over the groups."""
        E = self.n_experts
        f = F.one_hot(first, E).to(probs.dtype).mean(1)  # (G, E), no gradient
        P = probs.mean(1)                                 # (G, E)
        return (E * (f * P).sum(-1)).mean()

    def run_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows xs sorted by expert, counts[e] of them for expert e -> each row's output.
        (Expert parallelism replaces this: the rows travel to the experts' ranks.)"""
        chunks = xs.split(counts.tolist())
        return torch.cat([e(c) for e, c in zip(self.experts, chunks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        r = self.route(x)
        ys = self.run_experts(x[r.token], r.counts)
        # a token's kept choices add up in expert order; a token with none stays zero
        out = x.new_zeros(x.shape).index_add(0, r.token, ys * r.gate.unsqueeze(1))
        return out.view(shape)

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, groups={self.groups}")
