"""Strategies: each changes how the one training loop's model is wrapped, how gradients are
reduced and how the optimizer steps. None owns a copy of the loop (see distlab.train).

Strategies are imported when first used, so a notebook that needs one does not import all.
"""

import importlib

from .base import Strategy

_REGISTRY = {
    "single": "distlab.parallel.data:Single",
    "allreduce": "distlab.parallel.data:AllReduceDP",
    "dp": "distlab.parallel.dp:DataParallel",
    "ps-sync": "distlab.parallel.ps:SyncParameterServer",
    "ps-async": "distlab.parallel.ps:AsyncParameterServer",
    "ddp": "distlab.parallel.ddp:DDP",
    "ddp-torch": "distlab.parallel.ddp_torch:TorchDDP",
    "zero1": "distlab.parallel.zero:ZeRO1",
    "zero2": "distlab.parallel.zero:ZeRO2",
    "zero3": "distlab.parallel.zero:ZeRO3",
    "zero1-torch": "distlab.parallel.reference:TorchZeRO1",
    "fsdp-torch": "distlab.parallel.reference:TorchFSDP",
    "tp": "distlab.parallel.tensor:TensorParallel",
    "tp-torch": "distlab.parallel.tp_torch:TorchTP",
    "pp": "distlab.parallel.pipeline:PipelineParallel",
    "pp-torch": "distlab.parallel.pp_torch:TorchPP",
    "3d": "distlab.parallel.mesh:ThreeD",
}


def make_strategy(cfg, comm) -> Strategy:
    module, name = _REGISTRY[cfg.strategy].split(":")
    return getattr(importlib.import_module(module), name)(cfg, comm)


__all__ = ["Strategy", "make_strategy"]
