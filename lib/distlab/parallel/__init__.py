"""Strategies: each changes how the one training loop's model is wrapped, how gradients are
reduced and how the optimizer steps. None owns a copy of the loop (see distlab.train).

Strategies are imported when first used, so a notebook that needs one does not import all.
"""

import importlib

from distlab.parallel.base import Strategy

_REGISTRY = {
    "single": "distlab.parallel.data_parallel.allreduce:Single",
    "allreduce": "distlab.parallel.data_parallel.allreduce:AllReduceDP",
    "dp": "distlab.parallel.data_parallel.dp:DataParallel",
    "ps-sync": "distlab.parallel.data_parallel.ps:SyncParameterServer",
    "ps-async": "distlab.parallel.data_parallel.ps:AsyncParameterServer",
    "ddp": "distlab.parallel.data_parallel.ddp:DDP",
    "ddp-torch": "distlab.parallel.data_parallel.ddp_torch:TorchDDP",
    "zero1": "distlab.parallel.zero.zero:ZeRO1",
    "zero2": "distlab.parallel.zero.zero:ZeRO2",
    "zero3": "distlab.parallel.zero.zero:ZeRO3",
    "zero1-torch": "distlab.parallel.zero.zero_torch:TorchZeRO1",
    "fsdp-torch": "distlab.parallel.zero.zero_torch:TorchFSDP",
    "tp": "distlab.parallel.tensor.tp:TensorParallel",
    "tp-torch": "distlab.parallel.tensor.tp_torch:TorchTP",
    "pp": "distlab.parallel.pipeline.pp:PipelineParallel",
    "pp-torch": "distlab.parallel.pipeline.pp_torch:TorchPP",
    "3d": "distlab.parallel.mesh:ThreeD",
}


def make_strategy(cfg, comm) -> Strategy:
    module, name = _REGISTRY[cfg.strategy].split(":")
    return getattr(importlib.import_module(module), name)(cfg, comm)


__all__ = ["Strategy", "make_strategy"]
