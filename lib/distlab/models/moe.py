"""A mixture-of-experts layer in one process: a router picks k of E expert MLPs per token.

    router     logits = x W_r (nn.Linear d -> E, no bias); p = softmax(logits)
    gating     top-1 (Switch Transformer, Fedus et al. 2021): the best expert, gate p_i
               top-k, k >= 2 (GShard, Lepikhin et al. 2020, k = 2; DeepSeekMoE, Dai et al.
               2024, k up to 8 of many small experts): the k best, gates renormalised to sum 1
    experts    E small MLPs (Linear d -> h, GELU, Linear h -> d), `moe.experts`
    shared     n_shared more MLPs every token passes through, gate 1 (DeepSeekMoE's shared
               experts), `moe.shared`; with E fine-grained experts of a smaller h
    output     sum over the token's kept choices of gate x expert(x), plus the shared experts'

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

Dropless. capacity_factor = 0 sets no capacity: every choice reaches its expert (Megatron-Core
and torchtitan train this way), so an expert's batch is as uneven as the routing. The experts
then run as one grouped product over the uneven batches (`grouped="grouped_mm"`, torch's
F.grouped_mm, where this torch has it) or one after another (`grouped="loop"`); the two compute
the same rows (benchmarks/experts.py times them).

Balance without an auxiliary loss (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing
Strategy for Mixture-of-Experts"; DeepSeek-V3, 2024, §2.1.2). A bias b_i per expert is added
to the scores that choose the experts, not to the gates:

    chosen  top-k of p_i + b_i          gate  p_i of each chosen expert (renormalised, k >= 2)

and after every optimizer step each bias moves against its expert's load over the step:

    b_i += u x sign(mean_j load_j - load_i)        u = bias_rate (DeepSeek-V3: 1e-3)

load_i the choices routed to expert i over the whole global batch (every micro-batch, every
data-parallel rank: `update_expert_bias` sums them over a group). The bias is a buffer
(`moe.expert_bias`): checkpoints keep it; no gradient reaches it, so the loss is the language
model's alone.
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


GROUPED = ("loop", "grouped_mm")


def _check(d_model, d_hidden, n_experts, top_k, capacity_factor, groups, n_shared, bias_rate,
           grouped):
    for name, v in (("d_model", d_model), ("d_hidden", d_hidden), ("n_experts", n_experts),
                    ("groups", groups), ("top_k", top_k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"MoE: {name}={v!r} must be a positive integer")
    if top_k > n_experts:
        raise ValueError(f"MoE: top_k={top_k} needs at least {top_k} experts, not {n_experts}")
    if not capacity_factor >= 0:  # written so that NaN is refused too
        raise ValueError(f"MoE: capacity_factor={capacity_factor!r} must be > 0 (each expert "
                         "takes ceil(capacity_factor x tokens x top_k / n_experts) tokens) "
                         "or 0 (dropless: no capacity)")
    if not isinstance(n_shared, int) or n_shared < 0:
        raise ValueError(f"MoE: n_shared={n_shared!r} must be an integer >= 0")
    if not bias_rate >= 0 or math.isinf(bias_rate):
        raise ValueError(f"MoE: bias_rate={bias_rate!r} must be a finite number >= 0 "
                         "(0: no balancing bias)")
    if grouped not in GROUPED:
        raise ValueError(f"MoE: grouped={grouped!r} is not one of {GROUPED}")
    if (why := grouped_unavailable(grouped)) is not None:
        raise ValueError(f"MoE: {why}")


def grouped_unavailable(grouped: str) -> str | None:
    """Why the experts cannot run as `grouped` on this torch (None: they can)."""
    if grouped == "grouped_mm" and not hasattr(F, "grouped_mm"):
        return (f"grouped='grouped_mm' needs torch.nn.functional.grouped_mm, which torch "
                f"{torch.__version__} lacks; use 'loop'")
    return None


class MoE(nn.Module):
    """Top-k mixture of experts on (B, T, d) or (N, d) inputs; returns the same shape.

    After each forward: `aux_loss` (a tensor in the graph) and `last_stats`:
    tokens_per_expert (choices routed to each expert, before capacity; they sum to tokens x
    top_k), kept_per_expert (after capacity), dropped (choices over capacity: tokens for
    top-1), capacity (per expert and group; with capacity_factor 0 the group's tokens, which no
    expert can exceed), tokens (in this forward)."""

    def __init__(self, d_model: int, d_hidden: int, n_experts: int, top_k: int = 1,
                 capacity_factor: float = 1.25, aux_loss_coef: float = 0.01, groups: int = 1,
                 *, n_shared: int = 0, bias_rate: float = 0.0, grouped: str = "loop"):
        super().__init__()
        _check(d_model, d_hidden, n_experts, top_k, capacity_factor, groups, n_shared,
               bias_rate, grouped)
        self.n_experts, self.top_k, self.groups = n_experts, top_k, groups
        self.capacity_factor, self.aux_loss_coef = float(capacity_factor), aux_loss_coef
        self.bias_rate, self.grouped = float(bias_rate), grouped
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_hidden) for _ in range(n_experts))
        self.shared = nn.ModuleList(Expert(d_model, d_hidden) for _ in range(n_shared))
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        self.load: torch.Tensor | None = None  # choices per expert since the last bias update
        self.aux_loss: torch.Tensor | None = None
        self.last_stats: dict | None = None

    @property
    def dropless(self) -> bool:
        return self.capacity_factor == 0

    def capacity(self, tokens_per_group: int) -> int:
        if self.dropless:  # a token's k choices are k different experts: at most one each
            return tokens_per_group
        return math.ceil(self.capacity_factor * tokens_per_group * self.top_k / self.n_experts)

    def choose(self, probs: torch.Tensor):
        """(gate, expert), each (n, k), best first: the experts by probability plus the
        balancing bias, the gates by probability alone."""
        scores = probs + self.expert_bias if self.bias_rate else probs
        expert = scores.topk(self.top_k, dim=-1).indices
        gate = probs.gather(1, expert)
        if self.top_k > 1:
            gate = gate / gate.sum(-1, keepdim=True)
        return gate, expert

    def route(self, x: torch.Tensor) -> Routing:
        """Route the tokens x (n, d): gates, capacity, aux_loss and last_stats."""
        n, E, k, G = len(x), self.n_experts, self.top_k, self.groups
        if n % G:
            raise ValueError(f"MoE: {n} tokens do not split into groups={G} equal groups")
        probs = F.softmax(self.router(x), dim=-1)  # (n, E)
        gate, expert = self.choose(probs)
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
        if self.bias_rate and self.training:  # every training forward of the step counts
            # (micro-batches, a pipeline's; a checkpointed block's recompute counts every
            # token twice, which leaves the signs alone)
            self.load = routed if self.load is None else self.load + routed
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
        return expert_rows(list(self.experts), xs, counts.tolist(), self.grouped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        r = self.route(x)
        ys = self.run_experts(x[r.token], r.counts)
        # a token's kept choices add up in expert order; a token with none stays zero
        out = x.new_zeros(x.shape).index_add(0, r.token, ys * r.gate.unsqueeze(1))
        for expert in self.shared:  # every token, gate 1
            out = out + expert(x)
        return out.view(shape)

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}"
                f"{' (dropless)' if self.dropless else ''}, groups={self.groups}"
                + (f", n_shared={len(self.shared)}" if len(self.shared) else "")
                + (f", bias_rate={self.bias_rate:g}" if self.bias_rate else ""))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: F.grouped_mm's backward on the
    CPU refuses an expanded one (measured, torch 2.13: a .sum()'s gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _grouped_linear(xs, layers, offsets):
    """One grouped product: rows of group e times layers[e] (nn.Linear), plus its bias."""
    w = torch.stack([layer.weight.t() for layer in layers])  # (E, d_in, d_out)
    b = torch.stack([layer.bias for layer in layers])
    y = _ContiguousGrad.apply(F.grouped_mm(xs, w, offs=offsets))
    group = torch.repeat_interleave(torch.arange(len(layers), device=xs.device),
                                    torch.diff(offsets, prepend=offsets.new_zeros(1)).long())
    return y + b[group]


def expert_rows(experts: list, xs: torch.Tensor, counts: list[int], grouped: str = "loop"):
    """Rows xs sorted by expert, counts[e] for experts[e] -> each row's output: the experts one
    after another (loop), or each of an Expert's two layers as one grouped product over the
    uneven batches (grouped_mm; every expert an Expert)."""
    if grouped == "loop" or not all(isinstance(e, Expert) for e in experts):
        return torch.cat([e(c) for e, c in zip(experts, xs.split(counts))])
    offsets = torch.tensor(counts, device=xs.device).cumsum(0).to(torch.int32)
    h = F.gelu(_grouped_linear(xs, [e.fc1 for e in experts], offsets))
    return _grouped_linear(h, [e.fc2 for e in experts], offsets)


@torch.no_grad()
def update_expert_bias(moes: list, comms=()) -> None:
    """After the optimizer's step: each MoE's bias moves against its load over the step,
    b_i += bias_rate x sign(mean load - load_i). `comms`: the groups whose ranks routed
    different tokens (the data-parallel ranks); their loads are summed over each in turn (an
    all-reduce, "moe.load"), so every rank moves its bias alike, and as one process on the
    global batch does."""
    moes = [m for m in moes if isinstance(m, MoE) and m.bias_rate and m.load is not None]
    if not moes:
        return
    loads = torch.stack([m.load for m in moes]).to(torch.float64)  # counts: exact sums
    for comm in comms:
        if comm is not None and comm.world > 1:
            comm.all_reduce_async(loads, kind="moe.load").wait()
    for m, load in zip(moes, loads):
        m.expert_bias += m.bias_rate * torch.sign(load.mean() - load).to(m.expert_bias.dtype)
        m.load = None


def max_violation(load) -> float:
    """MaxVio (Wang et al. 2024): the busiest expert's load over the mean, minus 1 (0: even)."""
    load = [float(v) for v in load]
    mean = sum(load) / len(load)
    return max(load) / mean - 1 if mean else 0.0
