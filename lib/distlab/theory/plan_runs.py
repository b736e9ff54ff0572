"""The planner's layouts as runs: a row of distlab.theory.plan.plan, trained on the mesh.

The planner (distlab.theory.plan) searches dp × tp × pp × cp × ep, ZeRO stages, micro-batch
sizes and recomputation by formula; the `mesh` strategy (distlab.parallel.parallelize) trains
any such layout. `model_of(cfg)` is the planner's Model of a RunConfig's GPT (its exact
parameter count), `run_config(row, base)` the RunConfig that trains a row:

    planner          RunConfig (strategy "mesh")
    dp, tp, pp, cp   dp_shard = dp (ZeRO shards over dp x cp, as the planner's memory model:
                     the cp ranks hold the same parameters), tp, pp, cp
    ep               ep (carved from the data-parallel ranks in both)
    zero             zero_stage
    micro_batch b    m = global_batch / (dp·b) micro-batches: the pipeline's (pp > 1: 1F1B,
                     or GPipe where m < pp), else gradient accumulation's
    recompute        checkpointing: none, selective, full
    sequence_parallel  sp (plan with sequence_parallel=False for a run without it)

Under a pipeline a mixture of experts trains without its balance loss (the stages do not carry
it: aux_loss_coef = 0); the planner does not model that loss.
"""

from __future__ import annotations

from distlab.config import RunConfig
from distlab.models import GPT, GPTConfig
from distlab.parallel.pipeline.pp import SPLIT_BACKWARD
from distlab.theory.plan import Model, Row


def model_of(cfg: RunConfig) -> Model:
    """The planner's Model of cfg's GPT: its shape and exact parameter count (a dense count;
    with n_experts the planner adds the experts as L·E·8h², which is distlab's MoE with
    mlp_ratio 4 up to the biases)."""
    import torch
    with torch.device("meta"):
        dense = GPT(GPTConfig.from_run(cfg.replace(n_experts=0))).num_params()
    return Model(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.seq_len, cfg.vocab_size,
                 n_params=dense, experts=cfg.n_experts, top_k=cfg.top_k,
                 capacity_factor=cfg.capacity_factor)


def run_config(row: Row, base: RunConfig, sequence_parallel: bool = False) -> RunConfig:
    """The mesh run of `row` on base's model and global batch (ValueError, naming why, if
    the runtime cannot train it)."""
    m = row.micro_batches
    pp = row.pp > 1
    if pp and row.schedule in SPLIT_BACKWARD:
        # the split schedules run in a pipeline alone (RunConfig says why: their W's land
        # after the hooks that DDP, ZeRO and FSDP reduce gradients in)
        if row.dp * row.tp * row.cp * row.ep > 1:
            raise ValueError(f"{label(row)} with schedule {row.schedule!r}: the zero-bubble "
                             "schedules run in a pipeline alone here; plan it with 1f1b")
        return base.replace(strategy="pp", world_size=row.pp, pp=row.pp, microbatches=m,
                            grad_accum=1, schedule=row.schedule,
                            checkpointing=row.recompute)
    return base.replace(
        strategy="mesh", world_size=row.dp * row.tp * row.pp * row.cp, dp_shard=row.dp,
        dp_replicate=1, tp=row.tp, pp=row.pp, cp=row.cp, ep=row.ep, zero_stage=row.zero,
        microbatches=m if pp else 1, grad_accum=1 if pp else m,
        # 1F1B needs m >= pp; with fewer micro-batches GPipe holds as many in flight (m) and
        # has the same bubble, (p-1)/m: the planner prices the two alike
        schedule=("1f1b" if m >= row.pp else "gpipe") if pp else base.schedule,
        checkpointing=row.recompute,
        sp=sequence_parallel and row.tp > 1,
        aux_loss_coef=0.0 if pp and base.n_experts else base.aux_loss_coef)


def label(row: Row) -> str:
    """"dp2 x tp2 x cp2, zero1, b4, none": a row's layout in the mesh's words."""
    dims = [f"{d}{getattr(row, d)}" for d in ("pp", "dp", "cp", "tp", "ep")
            if getattr(row, d) > 1] or ["1"]
    return f"{' x '.join(dims)}, zero{row.zero}, b{row.micro_batch}, {row.recompute}"
