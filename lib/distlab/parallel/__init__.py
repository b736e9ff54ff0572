"""Strategies: each changes how the one training loop's model is wrapped, how gradients are
reduced and how the optimizer steps. None owns a copy of the loop (see distlab.rank.train).

REGISTRY is the one list of strategies: a name and where its class lives. Everything else a
strategy is (its data-parallel degree, what it supports, its config checks, its checkpoint
state) the class declares (distlab.parallel.base.Strategy); RunConfig and the checkpoints read it
from there. Adding a strategy is one file and one line here.

Classes are imported when first asked for, so a run imports only the strategy it uses.
state.py is the strategy side of training checkpoints (distlab.checkpoint reads it); agree.py
is the check every public wrapper runs when it is built: the ranks built it alike, or every rank
raises naming the first difference and who holds it.

May import: the foundation (comm, units, modules, memory, wire), data/ and models/. Never
config (a strategy reads the RunConfig it is given), checkpoint/ or anything above.
"""

from __future__ import annotations

import functools
import importlib

from distlab.parallel.base import DEGREES, FEATURE_FIELDS, FEATURES, Strategy

REGISTRY = {
    # data parallel (parallel/data_parallel/)
    "single": "distlab.parallel.data_parallel.allreduce:Single",
    "allreduce": "distlab.parallel.data_parallel.allreduce:AllReduceDP",
    "dp": "distlab.parallel.data_parallel.dp:DataParallel",
    "ps-sync": "distlab.parallel.data_parallel.ps:SyncParameterServer",
    "ps-async": "distlab.parallel.data_parallel.ps:AsyncParameterServer",
    "ddp": "distlab.parallel.data_parallel.ddp:DDP",
    "ddp-torch": "distlab.parallel.data_parallel.ddp_torch:TorchDDP",
    "diloco": "distlab.parallel.data_parallel.diloco:DiLoCo",
    # ZeRO and FSDP (parallel/zero/)
    "zero1": "distlab.parallel.zero.stages:ZeRO1",
    "zero2": "distlab.parallel.zero.stages:ZeRO2",
    "zero3": "distlab.parallel.zero.stages:ZeRO3",
    "zero1-torch": "distlab.parallel.zero.zero_torch:TorchZeRO1",
    "fsdp-torch": "distlab.parallel.zero.zero_torch:TorchFSDP",
    # tensor and pipeline parallel (parallel/tensor/, parallel/pipeline/), and the 3D mesh
    "tp": "distlab.parallel.tensor.tp:TensorParallel",
    "tp-torch": "distlab.parallel.tensor.tp_torch:TorchTP",
    "pp": "distlab.parallel.pipeline.pp:PipelineParallel",
    "pp-torch": "distlab.parallel.pipeline.pp_torch:TorchPP",
    "3d": "distlab.parallel.mesh:ThreeD",
    # every dimension at once: pp x dp_replicate x dp_shard x cp x tp (parallel/parallelize.py)
    "mesh": "distlab.parallel.parallelize:MeshParallel",
    # context parallelism (parallel/context/)
    "cp": "distlab.parallel.context.strategy:ContextParallelDP",
    # expert parallelism (parallel/expert/)
    "ep": "distlab.parallel.expert.strategy:ExpertParallelDP",
}
STRATEGIES = tuple(REGISTRY)

# RunConfig knobs that only some strategies read. Under any other strategy a value other than
# the default would be silently ignored, so RunConfig refuses it.
KNOBS = {
    "allreduce": ("allreduce",),
    "dp_threads": ("dp",), "dp_gather": ("dp",),
    "bucket_mb": ("ddp", "ddp-torch"), "compress": ("ddp", "ddp-torch"), "topk_ratio": ("ddp",),
    "powersgd_rank": ("ddp-torch",),
    "sync_every": ("diloco",), "outer_lr": ("diloco",), "outer_momentum": ("diloco",),
    "microbatches": ("pp", "pp-torch", "3d", "mesh"),
    "schedule": ("pp", "pp-torch", "3d", "mesh"),
    "virtual_stages": ("pp", "pp-torch", "3d", "mesh"), "pp_op_delay_s": ("pp", "3d", "mesh"),
    "mesh_order": ("3d",),
    "cp_ranks": ("cp",), "cp_layout": ("cp", "mesh"), "cp_attention": ("cp", "mesh"),
    "cp": ("mesh",), "dp_shard": ("mesh",), "dp_replicate": ("mesh",), "zero_stage": ("mesh",),
    "ep": ("mesh",),
    "param_dtype": ("zero3",), "reduce_dtype": ("zero3",), "fsdp_units": ("zero3",),
    "fsdp_prefetch": ("zero3", "mesh"),
    "fsdp_layout": ("zero3",),
    "shard_ranks": ("fsdp-torch",),
}


@functools.cache
def strategy_class(name: str) -> type[Strategy]:
    """The class registered under `name` (imports its module)."""
    if name not in REGISTRY:
        raise ValueError(f"strategy={name!r} is not one of: {', '.join(map(repr, REGISTRY))}")
    module, attr = REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module), attr)
    if cls.name != name:
        raise TypeError(f"REGISTRY[{name!r}] is {cls.__qualname__}, which declares "
                        f"name={cls.name!r}")
    return cls


def strategies(supporting: str | None = None) -> tuple[str, ...]:
    """Strategy names, in registry order; with `supporting`, those that declare that feature
    (one of FEATURES, or "checkpoint": those with a checkpoint layout)."""
    if supporting is None:
        return tuple(REGISTRY)
    if supporting != "checkpoint" and supporting not in FEATURES:
        raise ValueError(f"feature {supporting!r} is not one of: {', '.join(FEATURES)}, checkpoint")
    if supporting == "checkpoint":
        return tuple(s for s in REGISTRY if strategy_class(s).checkpoint_layout is not None)
    return tuple(s for s in REGISTRY if supporting in strategy_class(s).supports)


def strategy_knobs() -> tuple[str, ...]:
    """The RunConfig fields that only some strategies read: KNOBS's, the model-parallel degrees
    (Strategy.degrees) and the fields that ask for an optional feature (Strategy.supports)."""
    return (*KNOBS, *DEGREES, *FEATURE_FIELDS.values())


def reads(strategy: str, field: str) -> bool:
    """Whether `strategy` reads RunConfig field `field`: KNOBS's fields under the strategies
    they list, tp and pp under those declaring the degree, a feature's field under those
    supporting the feature; any other field every strategy reads."""
    cls = strategy_class(strategy)
    if field in KNOBS:
        return strategy in KNOBS[field]
    if field in DEGREES:
        return field in cls.degrees
    feature = {f: name for name, f in FEATURE_FIELDS.items()}.get(field)
    return feature is None or feature in cls.supports


def make_strategy(cfg, comm) -> Strategy:
    return strategy_class(cfg.strategy)(cfg, comm)


__all__ = ["DEGREES", "FEATURES", "FEATURE_FIELDS", "KNOBS", "REGISTRY", "STRATEGIES", "Strategy",
           "make_strategy", "reads", "strategies", "strategy_class", "strategy_knobs"]
