"""LoRA written out: fine-tune a frozen model through low-rank updates of chosen Linear layers.

Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models". A pre-trained weight
W (d_out x d_in) stays frozen; the layer learns an update of rank r instead, as two small
matrices, and adds it to the frozen layer's output:

    h = W x + b  +  (α / r) · B A x          A: r x d_in,  B: d_out x r

    A ~ Kaiming-uniform (the paper says "random Gaussian"; its reference code, loralib, draws
        A as nn.Linear draws its weight: kaiming_uniform_(a=√5); we do the same)
    B = 0, so B A = 0 and the adapted model starts *exactly* equal to the pre-trained one
    α / r scales the update; α stays fixed while r varies (the paper sets α to the first r it
        tries and does not tune it), so a sweep over r needs no new learning rate

Trainable values per adapted layer: r·(d_in + d_out) instead of d_in·d_out. At d_in = d_out =
4096 and r = 8: 8 · 8192 = 65,536 against 16,777,216 (256x fewer). Gradients and optimizer
state exist only for the adapters, so they shrink by the same factor; the frozen weights are
still held (and read in forward and backward).

Everything but the adapters is frozen: the Linear weights and biases, the embeddings, every
LayerNorm and the output head (requires_grad=False). Which Linears get adapters is picked by
module name (`inject_lora(model, targets, rank, alpha)`, targets a preset or a regex):

    qv         blocks.i.attn.q, blocks.i.attn.v            the paper's default (its Table 5)
    attn       blocks.i.attn.{q,k,v,o}
    attn_mlp   blocks.i.attn.{q,k,v,o}, blocks.i.mlp.{fc,proj}

distlab's GPT keeps q, k and v as separate Linears (distlab.models.gpt), so "q and v only" is
simply those two modules: no slicing of a fused qkv output is needed.

A LoRALinear takes over the Linear's own weight and bias Parameters under the same names, so a
model's state-dict keys stay `...attn.q.weight`, `...attn.q.bias` and gain `...attn.q.lora_A`
and `...attn.q.lora_B`: pre-trained weights load before or after injection alike.

**Merge for inference.** W' = W + (α/r) B A is an ordinary weight: `merge_lora` folds every
adapter in, after which a forward costs exactly the base model's (no extra matmul, no extra
latency); `unmerge_lora` subtracts it again (to keep training, or swap in another adapter).
Merging and unmerging change W by rounding only: (W + Δ) - Δ equals W to within one ulp of |W|.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlab.config import LORA_TARGETS

# Module-name patterns (re.search on the full name) of the target presets.


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus the trainable low-rank update (α/r)·B·A (module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank={rank} must be >= 1")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        # the base layer's own Parameters, frozen, under the names a Linear gives them
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, dtype=w.dtype,
                                               device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=w.dtype,
                                               device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as loralib / nn.Linear
        # off by default: the paper's GPT-2 runs use 0.1, but dropout makes a forward random,
        # and distlab's equivalence checks compare runs step by step
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    def delta_weight(self) -> torch.Tensor:
        """(α/r)·B·A: the update a merge adds to W (d_out x d_in)."""
        return (self.lora_B @ self.lora_A) * self.scale

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        if self.merged:  # W already holds W + (α/r) B A
            return out
        # x A^T B^T: two thin matmuls (r columns); never the d_out x d_in product B A
        return out + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scale

    @torch.no_grad()
    def merge(self):
        if not self.merged:
            self.weight.add_(self.delta_weight())
            self.merged = True

    @torch.no_grad()
    def unmerge(self):
        if self.merged:
            self.weight.sub_(self.delta_weight())
            self.merged = False

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, alpha={self.alpha}, merged={self.merged}")


# -- injection ---------------------------------------------------------------------------------
def target_pattern(targets: str) -> str:
    """A preset's regex (LORA_TARGETS), or `targets` itself taken as a regex on module names."""
    return LORA_TARGETS.get(targets, targets)


def find_targets(model: nn.Module, targets: str) -> list[tuple[str, nn.Linear]]:
    """The Linear modules whose names match `targets`, in model order. Raises if none does."""
    pattern = re.compile(target_pattern(targets))
    found = [(n, m) for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and pattern.search(n)]
    if not found:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise ValueError(f"lora targets {targets!r} (pattern {pattern.pattern!r}) match no "
                         f"nn.Linear; the model's Linears are: {', '.join(linears)}")
    return found


def inject_lora(model: nn.Module, targets: str, rank: int, alpha: float,
                dropout: float = 0.0) -> list[str]:
    """Freeze every parameter of `model`, then replace each Linear that `targets` selects by a
    LoRALinear of rank `rank` (in place). Returns the adapted module names."""
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for name, linear in find_targets(model, targets):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(linear, rank, alpha, dropout))
        names.append(name)
    return names


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its weight (W += (α/r) B A); returns how many were merged."""
    mods = lora_modules(model)
    for _, m in mods:
        m.merge()
    return len(mods)


def unmerge_lora(model: nn.Module) -> int:
    """Take every merged adapter out of its weight again (W -= (α/r) B A)."""
    mods = lora_modules(model)
    for _, m in mods:
        m.unmerge()
    return len(mods)


def merged_state_dict(model: nn.Module, state: dict | None = None) -> dict:
    """A plain model state dict with every adapter folded into its weight and the lora_A /
    lora_B entries dropped: what init_from loads into a model without adapters, and what one
    deploys. `state` (default: model.state_dict()) may be a gathered full state dict of a
    sharded run; the adapters' scales come from the modules of `model`."""
    state = dict(model.state_dict() if state is None else state)
    for name, m in lora_modules(model):
        A, B = state.pop(f"{name}.lora_A"), state.pop(f"{name}.lora_B")
        w = state[f"{name}.weight"]
        state[f"{name}.weight"] = w if m.merged else w + (B @ A) * m.scale
    return {k: v.detach().clone() for k, v in state.items()}


# -- counting ----------------------------------------------------------------------------------
def lora_layer_count(d_in: int, d_out: int, rank: int) -> int:
    """Trainable values of one adapter: A (r x d_in) + B (d_out x r) = r·(d_in + d_out)."""
    return rank * (d_in + d_out)


def lora_parameter_count(shapes, rank: int) -> int:
    """Σ r·(d_in + d_out) over the adapted layers; `shapes` is [(d_in, d_out), ...]."""
    return sum(lora_layer_count(d_in, d_out, rank) for d_in, d_out in shapes)


def target_shapes(model: nn.Module, targets: str) -> list[tuple[int, int]]:
    """(d_in, d_out) of each Linear `targets` selects in a model (with or without adapters)."""
    pattern = re.compile(target_pattern(targets))
    return [(m.in_features, m.out_features) for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, LoRALinear)) and pattern.search(n)]


def trainable_parameters(model: nn.Module) -> int:
    """Measured: values of the parameters with requires_grad=True."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

