"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti
et al. 2022), written from scratch on distlab.comm so every byte is counted by kind.

Every rank holds 1/t of each attention and MLP matrix and sees the WHOLE batch (dp_degree is 1:
`batch` returns the global batch on every rank).

It is written once, for any module: `parallelize_module(module, plan)` with the styles
ColwiseParallel, RowwiseParallel, SequenceParallel and PrepareModuleInput (torch's names),
exported from distlab. The `tp` strategy applies it with the GPT's plan (`plan_table` as data,
`gpt_plan` as styles, `tp_plan` with shapes): the model knows nothing about parallelism; the
plan replaces modules from outside by name.

One concept a file, in the order data flows through them (this file keeps the `tp` strategy
and re-exports the names the others hold, so `distlab.parallel.tensor.tp` imports them all):

    operators.py    f, g and their sequence-parallel forms (the math); SP's partial gradients
    layers.py       ColumnParallelLinear, RowParallelLinear, where a region starts
    styles.py       ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput
    plans.py        the GPT's plan (plan_table, gpt_plan, tp_plan); Hugging Face's style names
    parallelize.py  parallelize_module, its state, clipping, full_state_dict
"""

from __future__ import annotations

import os

from distlab.parallel.base import Strategy
from distlab.parallel.composed_checkpoint import ComposedCheckpoints
from distlab.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, fused_rows
from distlab.parallel.tensor.operators import (KINDS, F_Copy, G_Reduce, GatherSeq,
                                               GatherSeqToReplicated, ReduceScatterSeq, SplitSeq)
from distlab.parallel.tensor.parallelize import (TensorParallelState, clip_by_global_norm,
                                                 full_state_dict, parallelize_module,
                                                 sharded_ids)
from distlab.parallel.tensor.plans import HF_STYLES, gpt_plan, plan_table, tp_plan
from distlab.parallel.tensor.styles import (FUSED_NAMES, LAYOUTS, ColwiseParallel,
                                            PrepareModuleInput, RowwiseParallel,
                                            SequenceParallel)

__all__ = ["KINDS", "F_Copy", "G_Reduce", "GatherSeq", "ReduceScatterSeq", "SplitSeq",
           "GatherSeqToReplicated", "ColumnParallelLinear", "RowParallelLinear", "fused_rows",
           "LAYOUTS", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "FUSED_NAMES", "sharded_ids", "clip_by_global_norm",
           "TensorParallelState", "parallelize_module", "HF_STYLES", "full_state_dict",
           "plan_table", "tp_plan", "gpt_plan", "TensorParallel"]


class TensorParallel(ComposedCheckpoints, Strategy):
    """`tp`: Megatron tensor parallelism over all ranks (tp = world), optional sp: the GPT's
    plan (gpt_plan) applied by parallelize_module; a model of your own brings its plan as its
    attribute `tp_plan` ({module name pattern: style}, what parallelize_module takes)."""
    name = "tp"
    degrees = frozenset({"tp"})
    supports = Strategy.supports | {"sp"}

    @classmethod
    def mesh_preset(cls, cfg):
        return {"tp": cfg.world_size, "zero_stage": 0}

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        self.sp = cfg.sp
        # the loop's runs feed every tp rank the same batch through the GPT (or your model's
        # factory), and their bytes per step are held to the formulas: shapes are compared
        # only when asked (RunConfig(debug=True)); the launcher explains gloo's abort otherwise
        self.checks = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"

    def wrap(self, model):
        # every rank built the same full model from cfg.seed; each keeps its slice of it
        if self.cfg.model == "gpt":
            # a mixture of experts in the blocks (the model's own config says): attention only
            plan = gpt_plan(len(model.blocks), self.sp, experts=bool(model.config.n_experts))
            model = parallelize_module(model, plan, comm=self.comm, check_shapes=self.checks)
        else:  # yours: its own plan (checked before spawn by distlab.models.factory.check)
            model = parallelize_module(model, model.tp_plan, comm=self.comm,
                                       check_shapes=self.checks)
        self.sharded = dict(model._distlab_tp.sharded)
        return model

    def after_model_split(self, model) -> None:
        """Forget the split modules a pipeline stage no longer holds (3d, mesh), and, with sp,
        the other stages' partial-sum parameters: each backward all-reduces only this
        stage's (it summed zeros for the rest: 832 floats a micro-batch where a stage of the
        4-layer, 32-wide GPT holds 384)."""
        def present(name):
            try:
                model.get_submodule(name)
                return True
            except AttributeError:
                return False
        self.sharded = {n: s for n, s in self.sharded.items() if present(n)}
        partial = getattr(getattr(model, "_distlab_tp", None), "partial_grads", None)
        if partial is not None:
            kept = {id(p) for p in model.parameters()}
            partial.params = [p for p in partial.params if id(p) in kept]

    def batch(self, data, step: int):
        # dp_degree is 1: every tensor-parallel rank computes on the whole global batch
        return data.global_batch(step, self.cfg.global_batch)

    def clip_gradients(self, model, max_norm: float) -> float:
        """Global norm: squares of the sharded gradients summed across ranks, the replicated
        ones (identical on every rank once backward returned) counted once."""
        sharded = sharded_ids(model, self.sharded)
        return float(clip_by_global_norm(self.comm, list(model.parameters()), sharded, max_norm))

    def full_state_dict(self, model) -> dict:
        """The unsharded weights under the names `single` uses (a collective: every rank)."""
        return full_state_dict(model)

    # -- training checkpoints: written whole, in ddp's layout (ComposedCheckpoints) ---------
    @property
    def tp_s(self):  # the blocks to gather and to cut are this strategy's
        return self

    trainable_order = Strategy.trainable_order  # every parameter is here: any model's own
