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

import torch

from distlab.parallel.base import Strategy
from distlab.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, fused_rows
from distlab.parallel.tensor.operators import (KINDS, F_Copy, G_Reduce, GatherSeq,
                                               GatherSeqToReplicated, ReduceScatterSeq, SplitSeq)
from distlab.parallel.state import materialize_optimizer_state
from distlab.parallel.tensor.parallelize import (TensorParallelState, clip_by_global_norm,
                                                 full_state_dict, local_block,
                                                 parallelize_module, sharded_ids)
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


class TensorParallel(Strategy):
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

    # -- training checkpoints: written whole, as a replica writes them ------------------------
    checkpoint_layout = "replicated"  # ddp reads it as its own; ZeRO per parameter
    loads_canonical = True  # and tp reads theirs (distlab.checkpoint.reshard)

    def checkpoint_state(self, model, optimizer, for_load: bool = False) -> dict:
        """A replica's full format: each split weight and its optimizer state gathered whole
        (a collective: every rank), under single's names; the state by parameter index."""
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        whole = full_state_dict(model)
        keys = list(optimizer.state[params[0][1]]) if optimizer.state else []
        gathered = {k: full_state_dict(model, {n: optimizer.state[p][k] for n, p in params})
                    for k in keys  # AdamW's moments, shaped like their parameters
                    if all(optimizer.state[p][k].shape == p.shape for _, p in params)}
        if self.rank != 0:
            return {}
        state = {i: {k: gathered[k][n] if k in gathered else optimizer.state[p][k]
                     for k in keys} for i, (n, p) in enumerate(params)}
        return {"model": whole, "optimizer": {
            "state": state if keys else {},
            "param_groups": optimizer.state_dict()["param_groups"]}}

    def load_checkpoint_state(self, model, optimizer, state: dict) -> None:
        """A replica's full format (its own, or ddp's): this rank's blocks of it."""
        names = self.trainable_order(model)
        optim = {names[int(i)]: s for i, s in state["optimizer"]["state"].items()}
        self.load_canonical(model, optimizer, {"model": state["model"], "optim": optim})

    def load_canonical(self, model, optimizer, state: dict) -> None:
        """Any checkpoint named per parameter: this rank's block of each split tensor."""
        model.load_state_dict({n: local_block(model, n, t) for n, t in state["model"].items()})
        if not state["optim"]:
            return
        materialize_optimizer_state(optimizer)
        optimizer.zero_grad()  # that step's (zero) gradients are not the next step's
        with torch.no_grad():
            for n, p in model.named_parameters():
                for key, v in optimizer.state.get(p, {}).items():
                    saved = state["optim"][n][key]
                    v.copy_(local_block(model, n, saved) if v.shape == p.shape else saved)
