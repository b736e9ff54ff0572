"""Finding where a NaN or an inf was born: the rank, the step, the phase and the first module.

A NaN spreads: one poisoned weight or one bad row makes its module's output NaN, then every
later activation, the loss, and in backward every gradient; under data parallelism the
all-reduce then carries it into every rank's weights, and the run goes on, silent, with NaN
everywhere (torch's DDP and FSDP say nothing either). Looking at the loss tells you *that* it
happened; to find *where*, `NanDetector` watches every module:

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

On the first non-finite value it raises `NonFiniteError` (and logs a "nan" event when given an
EventLog). Only the rank that saw it raises; its peers are left in their next collective, and
the launcher (torchrun, or distlab's) ends them.

Who uses it (one detector, three switches, all off by default as torch's anomaly checks are):

    RunConfig(detect_nan=True)                              the training loop (distlab.debug.nan)
    distlab.DistributedDataParallel(model, detect_nan=True) the wrappers: the step is theirs
    distlab.fully_shard(model, detect_nan=True)
    distlab.detect_nan(model)                               any model (tp, pp, your own loop)

Cost: one `isfinite(...).all()` per module output and per gradient, on the fly (a reduction
over each activation; on a GPU each check also synchronises). Off: no hook at all.

With dynamic loss scaling (fp16) an inf gradient is routine: the scaler skips the step and
backs off. There check only the forward (`check_backward=False`); an overflow in backward
shows up as a skipped step instead.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.modules import tensors_in


class NonFiniteError(FloatingPointError):
    """A loss, activation or gradient went inf/NaN. Fields: step, phase, module, detail, rank
    (None where the launcher names it: the training loop)."""

    def __init__(self, step, phase: str, module: str, detail: str, rank: int | None = None):
        self.step, self.phase, self.module, self.detail = step, phase, module, detail
        self.rank = rank
        where = f"step {step}" if step is not None else "an unknown step"
        who = f" on rank {rank}" if rank is not None else ""  # the launcher's error names it
        super().__init__(f"non-finite values{who} at {where} in {phase}: first in module "
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

    def __init__(self, model: nn.Module, log=None, check_backward: bool = True,
                 rank: int | None = None, step_of=None):
        self.log, self.check_backward, self.step = log, check_backward, None
        self.rank = rank
        self.step_of = step_of  # called as each forward starts; None: the loop sets .step
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
        if self.step_of is not None:
            self.step = self.step_of()
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
        raise NonFiniteError(self.step, phase, module, detail, self.rank)

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class TrainingForwards:
    """The step when no wrapper counts one: the model's forwards with gradients on, from 1 (a
    micro-batch of gradient accumulation counts as one; an eval forward keeps the count)."""

    def __init__(self):
        self.n = 0

    def __call__(self) -> int:
        if torch.is_grad_enabled():
            self.n += 1
        return self.n


def this_rank() -> int | None:
    """This process's global rank, or None outside torch.distributed."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def detect_nan(model: nn.Module, check_backward: bool = True, step_of=None) -> NanDetector:
    """Hooks on every module of `model` that raise NonFiniteError at the first inf/NaN, naming
    this rank, the step and the module where it appeared (the input, a module's output, a
    gradient). Exported as `distlab.detect_nan`; the wrappers' `detect_nan=True` calls it.

        with distlab.detect_nan(model):           # or: detector = ...; detector.remove()
            for step in ...: loss_fn(model(x), y).backward(); opt.step()

    check_backward  False: the forward only (fp16 with a loss scaler, where an inf gradient
                    is routine)
    step_of         a function giving the step as each forward starts; default: the model's
                    training forwards (TrainingForwards)
    """
    return NanDetector(model, check_backward=check_backward, rank=this_rank(),
                       step_of=step_of if step_of is not None else TrainingForwards())
