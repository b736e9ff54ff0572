"""A tiny GPT in the style of nanoGPT, small enough to train on two CPU cores.

Every block is addressable by name (`blocks.0.attn.q`, `blocks.3.mlp.fc`, ...), so later
strategies can shard, split or wrap modules by name from outside: the model knows nothing about
parallelism. Attention keeps q, k and v as separate projections (not one fused qkv) because
tensor parallelism splits each of them by heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlab.models.moe import MoE


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 64
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    mlp_ratio: int = 4
    # a mixture of experts instead of each block's MLP (distlab.models.moe); 0: dense
    n_experts: int = 0
    top_k: int = 1
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    moe_groups: int = 1  # GShard's groups in one forward's tokens (capacity, balance loss)
    n_shared_experts: int = 0  # DeepSeekMoE's shared experts, every token through them
    expert_hidden: int = 0  # each expert's hidden width (0: mlp_ratio x n_embd)
    expert_bias_rate: float = 0.0  # auxiliary-loss-free balance's bias step (0: off)
    expert_grouped: str = "loop"  # the experts as a loop or one grouped product

    @property
    def expert_width(self) -> int:
        return self.expert_hidden or self.mlp_ratio * self.n_embd

    @classmethod
    def from_run(cls, cfg, moe_groups: int = 1) -> "GPTConfig":
        """moe_groups: the groups in one rank's forward (the run's, over its data-parallel
        ranks)."""
        return cls(vocab_size=cfg.vocab_size, block_size=cfg.seq_len, n_layer=cfg.n_layer,
                   n_embd=cfg.n_embd, n_head=cfg.n_head, mlp_ratio=cfg.mlp_ratio,
                   n_experts=cfg.n_experts, top_k=cfg.top_k,
                   capacity_factor=cfg.capacity_factor, aux_loss_coef=cfg.aux_loss_coef,
                   moe_groups=moe_groups, n_shared_experts=cfg.n_shared_experts,
                   expert_hidden=cfg.expert_hidden, expert_bias_rate=cfg.expert_bias_rate,
                   expert_grouped=cfg.expert_grouped)


class CausalSelfAttention(nn.Module):
    """`attend(q, k, v)`, causal attention over (B, heads, T, head_dim): PyTorch's kernel, or
    what a strategy puts there (context parallelism: attention across the ranks' tokens)."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        self.attend = _causal_attention
        self.q = nn.Linear(c.n_embd, c.n_embd)
        self.k = nn.Linear(c.n_embd, c.n_embd)
        self.v = nn.Linear(c.n_embd, c.n_embd)
        self.o = nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x):
        B, T, _ = x.shape
        # view(B, T, heads, head_dim): a rank holding a slice of the columns holds whole heads
        q, k, v = (p(x).view(B, T, -1, x.shape[-1] // self.n_head).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = self.attend(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


def _causal_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def unfused_causal_attention(q, k, v):
    """Causal attention written out, as kernels without flash attention run it: the s×s scores
    are made, and backward keeps softmax's output (4·a·s²·b bytes in fp32) and the causal mask
    (s² bytes). Korthikanti et al. 2022 count these as their 5as/h term; on CPU
    F.scaled_dot_product_attention keeps only a log-sum-exp per head and position instead."""
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def gpt_unfused_attention(cfg) -> "GPT":
    """The run's GPT with unfused_causal_attention in every block: a model spec,
    RunConfig(model="distlab.models.gpt:gpt_unfused_attention")."""
    model = GPT(GPTConfig.from_run(cfg))
    for block in model.blocks:
        block.attn.attend = unfused_causal_attention
    return model


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(c.n_embd, c.mlp_ratio * c.n_embd)
        self.proj = nn.Linear(c.mlp_ratio * c.n_embd, c.n_embd)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.attn = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.mlp = (MoE(c.n_embd, c.expert_width, c.n_experts, c.top_k, c.capacity_factor,
                        c.aux_loss_coef, c.moe_groups, n_shared=c.n_shared_experts,
                        bias_rate=c.expert_bias_rate, grouped=c.expert_grouped)
                    if c.n_experts else MLP(c))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        # the positions of the tokens forward sees (None: 0..T-1); context parallelism sets
        # this rank's, which are not the first T
        self.token_positions: torch.Tensor | None = None
        self.tok_emb = nn.Embedding(c.vocab_size, c.n_embd)
        self.pos_emb = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        # Not tied to tok_emb: a pipeline puts the embedding and the head on different stages.
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream
        for name, p in self.named_parameters():
            if name.endswith(("attn.o.weight", "mlp.proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = (self.token_positions.to(idx.device) if self.token_positions is not None
               else torch.arange(T, device=idx.device))
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        # mean over every token of this rank's batch; equal shards make the mean of the ranks'
        # losses equal the loss of the global batch
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        for block in self.blocks if self.config.n_experts else ():  # Switch's balance loss
            loss = loss + block.mlp.aux_loss_coef * block.mlp.aux_loss
        return loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def gpt_param_count(c: GPTConfig) -> int:
    """Parameters of `GPT(c)` by formula, layer by layer (checked against the module in tests)."""
    d, h, L = c.n_embd, c.mlp_ratio * c.n_embd, c.n_layer
    attn = 4 * (d * d + d)                      # q, k, v, o with biases
    mlp = (d * h + h) + (h * d + d)             # fc and proj with biases
    if c.n_experts:                             # E experts, the shared ones, a router
        he = c.expert_width
        mlp = (c.n_experts + c.n_shared_experts) * ((d * he + he) + (he * d + d)) \
            + d * c.n_experts
    norms = 2 * (2 * d)                         # ln1, ln2: weight and bias
    embeddings = c.vocab_size * d + c.block_size * d
    return embeddings + L * (attn + mlp + norms) + 2 * d + d * c.vocab_size  # ln_f, head
