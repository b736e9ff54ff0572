"""What a rank builds before its first step: the model (distlab's GPT with its fine-tuning and
recompute options, the BatchNorm net, or yours from distlab.models.factory; SyncBatchNorm when
asked) and the optimizer the strategy wraps. The loop (distlab.rank.train) calls these once.
"""

from __future__ import annotations

import torch

from distlab.config import RunConfig
from distlab.finetune.forgetting import load_init_from
from distlab.finetune.lora import inject_lora
from distlab.models import GPT, GPTConfig, factory
from distlab.models.bnnet import build_bnnet
from distlab.parallel.data_parallel.syncbn import convert_sync_batchnorm
from distlab.rank.fp8_linear import apply_fp8
from distlab.rank.recompute import apply_checkpointing


def build_optimizer(cfg: RunConfig, params):
    """cfg's optimizer over `params` (the strategy decides which: a shard, the adapters, ...)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def build_model(cfg: RunConfig) -> torch.nn.Module:
    """cfg's model on this rank, before the strategy wraps it (every rank builds the same
    one from cfg.seed; strategies also broadcast rank 0's)."""
    if factory.is_spec(cfg.model) or cfg.model == "bnnet":
        if cfg.precision == "fp8":
            raise ValueError(f"precision='fp8' makes distlab's GPT's Linears FP8 "
                             f"(distlab.rank.fp8_linear.apply_fp8); model={cfg.model!r} is not "
                             f"it: call apply_fp8 on your model yourself")
        model = factory.build_model(cfg) if cfg.model != "bnnet" else build_bnnet(cfg)
        # BatchNorm statistics over the global batch (distlab.parallel.data_parallel.syncbn)
        return convert_sync_batchnorm(model) if cfg.sync_bn else model
    model = GPT(GPTConfig.from_run(cfg, moe_groups=cfg.moe_groups_per_rank))
    if cfg.init_from:  # pre-trained weights, before adapters and wrapping (finetune/)
        load_init_from(model, cfg.init_from)
    if cfg.lora_rank:  # adapters on the named Linears, everything else frozen (finetune/)
        inject_lora(model, cfg.lora_targets, cfg.lora_rank, cfg.lora_alpha)
    if cfg.checkpointing != "none":  # per block, by name, from outside (distlab.rank.recompute)
        apply_checkpointing(model, cfg.checkpointing)
    if cfg.precision == "fp8":  # the blocks' Linears compute in FP8 (distlab.rank.fp8_linear)
        apply_fp8(model, cfg.fp8_scaling, cfg.fp8_grad_format)
    return model
