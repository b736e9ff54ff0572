"""NaN detection in the training loop, and a NaN on purpose.

The detector itself (NanDetector: hooks that name the rank, the step and the first module to
make inf/NaN) is distlab.non_finite, shared with the public API (distlab.detect_nan, the
wrappers' detect_nan=True). Here: the loop's choice of it for RunConfig(detect_nan=True), where
the loop sets the step and logs a "nan" event, so a launched run fails with a RunError that
names them (off by default: `NoNanCheck`, no hooks).

Fault drill: RunConfig(fault="nan", fault_step=k) writes a NaN into one weight of one module at
step k (`poison`); RunConfig.fault_module picks the module (default: the first nn.Linear,
blocks.0.attn.q in the GPT).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distlab.modules import find_module
from distlab.non_finite import (  # noqa: F401 (NonFiniteError: also imported from here)
    NanDetector, NonFiniteError, _local, _strip)


class NoNanCheck:
    """The loop's detector when cfg.detect_nan is off: no hooks, nothing checked."""
    step = None

    def check_gradients(self, model: nn.Module):
        pass


def nan_detector(cfg, model: nn.Module, log) -> "NanDetector | NoNanCheck":
    """The loop's detector for cfg.detect_nan. With loss scaling an inf gradient is routine
    (the scaler skips that step), so then only the forward is checked."""
    if not cfg.detect_nan:
        return NoNanCheck()
    scaled = cfg.loss_scale == "dynamic" or (cfg.loss_scale == "auto" and cfg.precision == "fp16")
    return NanDetector(model, log, check_backward=not scaled)


def default_fault_module(model: nn.Module) -> str:
    """The module the "nan" fault poisons by default: the first nn.Linear."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            return _strip(name)
    for name, m in model.named_modules():
        if isinstance(getattr(m, "weight", None), torch.Tensor):
            return _strip(name)
    raise ValueError(f"{type(model).__name__} has no module with a weight to poison")


def poison(model: nn.Module, name: str = "", value: float = float("nan")) -> str:
    """Write `value` into the first entry of module `name`'s weight (the "nan" fault drill).
    Returns the module's name."""

    name = name or default_fault_module(model)
    full, module = find_module(model, name)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"module {full!r} ({type(module).__name__}) has no weight to poison")
    with torch.no_grad():
        _local(weight).view(-1)[0] = value
    return _strip(full)
