"""Strategies: each changes how the one training loop's model is wrapped, how gradients are
reduced and how the optimizer steps. None owns a copy of the loop (see distlab.rank.train).

REGISTRY is the one list of strategies: a name and where its class lives. Everything else a
strategy is (its data-parallel degree, the RunConfig knobs it reads, what it supports, its
config checks, its checkpoint state) the class declares (distlab.parallel.base.Strategy);
RunConfig and the checkpoints read it from there, and KNOBS is built from it. Adding a strategy
is one file and one line here.

Classes are imported when first asked for. RunConfig's checks read every class's knobs, so the
process that checks a config imports them all (its first RunConfig took ~0.2 s longer on the
2-core machine); the ranks start from a fork server that has imported them already
(distlab.caller.launch.preload).
state.py is the strategy side of training checkpoints (distlab.checkpoint reads it); agree.py
is the check every public wrapper runs when it is built: the ranks built it alike, or every rank
raises naming the first difference and who holds it.

May import: the foundation (comm, units, modules, memory, wire), data/ and models/. Never
config (a strategy reads the RunConfig it is given), checkpoint/ or anything above.
"""

from __future__ import annotations

import functools
import importlib

from distlab.parallel.base import DEGREES, Strategy

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


def knobs() -> dict[str, tuple[str, ...]]:
    """{RunConfig field: the strategies that read it}, for the fields only some strategies read:
    what each class declares in `knobs` (Strategy.knobs), readers in registry order. Under any
    other strategy a value other than the field's default would be ignored in silence, so
    RunConfig refuses it. Imports every strategy's module."""
    out: dict[str, tuple[str, ...]] = {}
    for name in REGISTRY:
        for field in sorted(strategy_class(name).knobs):
            out[field] = out.get(field, ()) + (name,)
    return out


def __getattr__(name: str):
    # KNOBS is knobs(), built when read: a module-level table would import every strategy
    # with this package (and miss strategies registered later, as docs/library.md's example does)
    if name == "KNOBS":
        return knobs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    in `supports` (distlab.config.FEATURES), or "checkpoint": those with a checkpoint layout."""
    if supporting is None:
        return tuple(REGISTRY)
    known = {f for s in REGISTRY for f in strategy_class(s).supports}
    if supporting != "checkpoint" and supporting not in known:
        raise ValueError(f"feature {supporting!r} is not one of: {', '.join(sorted(known))}, "
                         "checkpoint")
    if supporting == "checkpoint":
        return tuple(s for s in REGISTRY if strategy_class(s).checkpoint_layout is not None)
    return tuple(s for s in REGISTRY if supporting in strategy_class(s).supports)


def make_strategy(cfg, comm) -> Strategy:
    return strategy_class(cfg.strategy)(cfg, comm)


__all__ = ["DEGREES", "KNOBS", "REGISTRY", "STRATEGIES", "Strategy", "knobs", "make_strategy",
           "strategies", "strategy_class"]
