"""Find where a NaN or an inf was born: the step, the phase, and the first module.

A NaN spreads: one poisoned weight makes its module's output NaN, then every later activation,
the loss, and in backward every gradient. Looking at the loss tells you *that* it happened; to
find *where*, `NanDetector` watches every module:

* input: a pre-hook on the model checks the batch this rank feeds it, so a NaN that came in
  with the data is named as the data ("(input)"), not blamed on the first module that read it.
  Under data parallelism one rank's bad rows reach every rank's weights through the all-reduce;
  the rank that raises is the one that read them.
* forward: a forward hook on every module checks its output; modules finish their forward in
  execution order, so the first hook that sees a non-finite value names the module that made it
  (its inputs were still finite, or an earlier hook would have fired).
* backward: a full backward hook on every module checks the gradients flowing out of it (with
  respect to its inputs) and into it (with respect to its outputs); backward runs in reverse,
  so the first hook that fires on a non-finite value names the module whose backward made it.
  Then `check_gradients` sweeps the parameters' gradients (a weight's gradient can go
  non-finite while the gradient it passes on is finite, e.g. an embedding's).

On the first non-finite value it logs a "nan" event (step, phase, module, detail) and raises
`NonFiniteError`, so a launched run fails with a RunError that names them.

Cost: one `isfinite(...).all()` per module output and per gradient, on the fly (a reduction
over each activation; on a GPU each check also synchronises). Off by default; on with
RunConfig(detect_nan=True).

With dynamic loss scaling (fp16) an inf gradient is routine: the scaler skips the step and
backs off. There the detector checks only the forward (`check_backward=False`); an overflow in
backward shows up as a skipped step in the step events instead.

Fault drill: RunConfig(fault="nan", fault_step=k) writes a NaN into one weight of one module at
step k (`poison`); RunConfig.fault_module picks the module (default: the first nn.Linear,
blocks.0.attn.q in the GPT).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from distlab.modules import find_module, tensors_in


class NonFiniteError(FloatingPointError):
    """A loss, activation or gradient went inf/NaN. Fields: step, phase, module, detail."""

    def __init__(self, step, phase: str, module: str, detail: str):
        self.step, self.phase, self.module, self.detail = step, phase, module, detail
        where = f"step {step}" if step is not None else "an unknown step"
        super().__init__(f"non-finite values at {where} in {phase}: first in module "
                         f"{module!r} ({detail})")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bad(t) -> bool:
    t = _local(t)
    return t.is_floating_point() and not bool(torch.isfinite(t).all())


def _describe(t) -> str:
    t = _local(t).detach()
    return (f"{int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} inf of {t.numel()} "
            f"entries, {str(t.dtype).replace('torch.', '')}")


def _strip(name: str) -> str:
    """A wrapper's prefix off a module name ("module.head" -> "head"); the root is "(model)"."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name or "(model)"


class NanDetector:
    """Hooks on every module of `model` that name the first one to produce inf/NaN.

        detector = NanDetector(model, log)       # log: an EventLog, or None
        detector.step = step                      # the loop sets it each step
        loss = model(x, y); loss.backward()       # raises NonFiniteError at the first NaN/inf
        detector.check_gradients(model)           # parameter gradients, in backward order
        detector.remove()
    """

    def __init__(self, model: nn.Module, log=None, check_backward: bool = True):
        self.log, self.check_backward, self.step = log, check_backward, None
        self.handles = []
        if check_backward:  # a module whose inputs need no gradient (an embedding, the root)
            warnings.filterwarnings(  # gets its hook on its outputs' gradients: as intended
                "ignore", message="Full backward hook is firing when gradients are computed "
                "with respect to module outputs")
        self.handles.append(model.register_forward_pre_hook(self._input_hook, with_kwargs=True))
        for name, m in model.named_modules():
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
                continue  # containers have no forward
            name = _strip(name)
            self.handles.append(m.register_forward_hook(self._forward_hook(name, m)))
            if check_backward:
                self.handles.append(m.register_full_backward_hook(self._backward_hook(name, m)))

    def _input_hook(self, module, args, kwargs):
        for t in tensors_in((args, kwargs)):
            if _bad(t):
                self.report("forward", "(input)", f"the batch this rank fed the model: "
                            f"{_describe(t)}")

    def _forward_hook(self, name, m):
        def hook(module, inputs, output):
            for t in tensors_in(output):
                if _bad(t):
                    self.report("forward", name, f"{type(m).__name__} output: {_describe(t)}")
        return hook

    def _backward_hook(self, name, m):
        def hook(module, grad_input, grad_output):
            for t in tensors_in(grad_output):
                if _bad(t):
                    self.report("backward", name, f"{type(m).__name__}: the gradient arriving "
                                f"at its output: {_describe(t)}")
            for t in tensors_in(grad_input):
                if _bad(t):
                    self.report("backward", name, f"{type(m).__name__}: the gradient it passed "
                                f"to its input: {_describe(t)}")
        return hook

    def check_loss(self, loss):
        """The loss of a model whose loss is computed outside any hooked module."""
        if _bad(loss):
            self.report("forward", "(loss)", f"loss = {loss.item()}")

    def check_gradients(self, model: nn.Module):
        """After backward: the first parameter (in backward order, the reverse of registration)
        whose gradient holds inf/NaN."""
        if not self.check_backward:
            return
        for name, p in reversed(list(model.named_parameters())):
            if p.grad is not None and _bad(p.grad):
                mod, _, pname = _strip(name).rpartition(".")
                self.report("backward", mod or "(model)",
                            f"gradient of its parameter {pname!r}: {_describe(p.grad)}")

    def report(self, phase: str, module: str, detail: str):
        if self.log is not None:
            self.log.write("nan", step=self.step, phase=phase, module=module, detail=detail)
        raise NonFiniteError(self.step, phase, module, detail)

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


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
