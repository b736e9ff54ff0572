"""Mixed precision: autocast, fp32 master weights, fp32 islands, and dynamic loss scaling.

**Master weights.** With RunConfig(precision="bf16"|"fp16") the model's parameters, their
gradients (`.grad`) and the optimizer state stay float32: `torch.autocast` (`autocast` below) casts
each op's *inputs* to the low-precision dtype on the fly, so matmuls and convolutions compute in
bf16/fp16, while every update lands in float32. That is Micikevicius et al. 2018 ("Mixed
Precision Training")'s fp32 master copy, without a second copy: the only low-precision tensors
are the casts autocast makes during forward and the activations it saves. `param_dtypes(model)`
shows it. Why the master copy matters is `rounding_demo()` (distlab.studies.precision_lessons):
near w = 1, bf16 can only represent steps of 2^-7, so an update of 1e-3 applied to a bf16
weight rounds away, every step.

**fp32 islands.** `apply_fp32_modules(model, "tok_emb,head")` makes the named modules run with
autocast off and their inputs cast to float32 (numerically touchy layers: the output head and its
softmax, norms, the router of an MoE). Applied from outside, by name, as RunConfig.fp32_modules.

**Dynamic loss scaling** (fp16). fp16's smallest subnormal is 2^-24 ≈ 6e-8, and late in training
many gradient entries are smaller than that: cast to fp16 they become 0 (`fp16_underflow_demo()`
in distlab.studies.precision_lessons measures how many). Multiplying the loss by S multiplies every gradient by S (backward is
linear) and lifts them into range; `DynamicLossScaler` divides them back in fp32 before the
optimizer reads them. S is chosen on the fly, as torch.amp.GradScaler does:

    loss * S ──backward──► grads * S ──unscale (× 1/S, fp32)──► any inf/NaN?
        yes: skip the optimizer step, S *= backoff_factor (0.5), restart the clean-step count
        no:  optimizer step; after growth_interval clean steps in a row, S *= growth_factor (2)

so S hovers just below the largest scale that does not overflow. In a distributed run every
rank must agree to skip: with data parallelism (allreduce, ddp) the gradients are already
averaged, so an inf on one rank is an inf on all; with sharded gradients (ZeRO, FSDP) each rank
sees only its shard, so the found-inf flag is all-reduced across ranks (Comm kind
"loss_scale.found_inf", 4 bytes). The scaler does this whenever world > 1.

bf16 has fp32's exponent range (its smallest normal is ~1e-38), so it needs no loss scaling:
RunConfig.loss_scale="auto" means dynamic for fp16, none otherwise.

In the loop (distlab.rank.train), after `strategy.reduce_gradients`, `finish_step` unscales and
checks the gradients the strategy's optimizer will read (`strategy.step_gradients`), clips them
(`strategy.clip_gradients`, cfg.grad_clip), and steps or skips. The step event gets
`scale` (the scale this step's backward used; None without loss scaling), `skipped` and, with
clipping, `grad_norm` (the global norm before clipping).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from distlab.modules import find_module
from distlab.units import dtype_of



# -- loss scaling --------------------------------------------------------------------------------
def autocast(cfg, device: torch.device):
    """The forward's autocast for cfg.precision (bf16/fp16); fp32: none; fp8: none either (its
    Linears cast their own operands, distlab.rank.fp8_linear; the rest stays fp32)."""
    if cfg.precision in ("fp32", "fp8"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype_of(cfg.precision))


def resolve_loss_scale(cfg) -> str:
    """"dynamic" or "none": RunConfig.loss_scale with "auto" resolved (dynamic for fp16)."""
    if cfg.loss_scale == "auto":
        return "dynamic" if cfg.precision == "fp16" else "none"
    return cfg.loss_scale


def make_loss_scaler(cfg, comm=None) -> "DynamicLossScaler | NoLossScaling":
    if resolve_loss_scale(cfg) != "dynamic":
        return NoLossScaling()
    return DynamicLossScaler(init_scale=cfg.loss_scale_init,
                             growth_interval=cfg.loss_scale_growth_interval, comm=comm)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 gradients), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class NoLossScaling:
    """The loss scaler when loss scaling is off (fp32, bf16): the loss as it is, nothing to
    unscale, nothing to checkpoint."""
    enabled = False

    def scale(self, loss):
        return loss


class DynamicLossScaler:
    """Dynamic loss scaling written out; its scale follows torch.amp.GradScaler's step for step
    (tests/test_precision.py replays one sequence of gradients through both).

        scaler = DynamicLossScaler(growth_interval=2000, comm=comm)
        scaler.scale(loss).backward()
        found_inf = scaler.unscale_(grads)       # grads /= S in place; True if any inf/NaN
        if not found_inf:                          # (on any rank, when comm is given)
            optimizer.step()
        scaler.update(found_inf)

    The scale is kept as a float32 number, as GradScaler keeps it (a float32 tensor), and the
    gradients are multiplied by float32(1/S), as GradScaler's unscale kernel does, so both give
    bitwise the same gradients and the same trajectory.
    """
    enabled = True

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, comm=None):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1
                and growth_interval >= 1):
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                             "and growth_interval >= 1")
        self._scale = _f32(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.comm = comm
        self.clean_steps = 0  # GradScaler's growth tracker: finite steps since the last change
        self.skipped_steps = 0

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S (in the loss's dtype: float32 in distlab's models)."""
        return loss * self._scale

    def unscale_(self, grads) -> bool:
        """Divide `grads` (tensors, in place) by S and report whether any entry was inf/NaN, on
        this rank or, when a Comm with world > 1 was given, on any rank. Entries are checked
        before they are multiplied, as GradScaler does."""
        grads = [_local(g) for g in grads if g is not None]
        inv = _f32(1.0 / self._scale)
        found = torch.zeros((), dtype=torch.float32,
                            device=grads[0].device if grads else "cpu")
        for g in grads:
            found = torch.maximum(found, (~torch.isfinite(g)).any().to(found.dtype))
            if inv != 1.0:
                g.mul_(inv)
        if self.comm is not None and self.comm.world > 1:
            # every rank skips together: a sum of 0/1 flags is > 0 when any rank overflowed
            self.comm.all_reduce_async(found, kind="loss_scale.found_inf").wait()
        return bool(found.item() > 0)

    def update(self, found_inf: bool):
        """Back off after an overflow; grow after growth_interval clean steps in a row."""
        if found_inf:
            self._scale = _f32(self._scale * self.backoff_factor)
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            grown = _f32(self._scale * self.growth_factor)
            if grown != float("inf"):  # GradScaler keeps the old scale if growing overflows
                self._scale = grown
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self._scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}

    def load_state_dict(self, d: dict):
        self._scale, self.clean_steps = _f32(d["scale"]), int(d["clean_steps"])
        self.skipped_steps = int(d.get("skipped_steps", 0))


def _f32(x: float) -> float:
    """x rounded to float32 (GradScaler stores its scale in a float32 tensor)."""
    return torch.tensor(x, dtype=torch.float64).float().item()


def finish_step(strategy, model, optimizer, scaler: "DynamicLossScaler | NoLossScaling",
                grad_clip: float = 0.0) -> dict:
    """The loop's step after reduce_gradients: unscale and check (loss scaling), clip, then
    step or skip. Returns the step event's fields: scale, skipped, and grad_norm if clipping."""
    info = {"scale": None, "skipped": False}
    found_inf = False
    if scaler.enabled:
        info["scale"] = scaler.get_scale()
        found_inf = scaler.unscale_(strategy.step_gradients(model))
    if grad_clip and not found_inf:
        info["grad_norm"] = float(strategy.clip_gradients(model, grad_clip))
    if not found_inf:
        strategy.optimizer_step(optimizer)
    if scaler.enabled:
        scaler.update(found_inf)
    info["skipped"] = found_inf
    return info


# -- fp32 islands (selective precision) ------------------------------------------------------
def _to_fp32(x):
    if torch.is_tensor(x) and x.is_floating_point() and x.dtype != torch.float32:
        return x.float()
    return x


def _fp32_forward(forward):
    @functools.wraps(forward)
    def fp32_forward(*args, **kwargs):
        t = next((a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)), None)
        with torch.autocast(t.device.type if t is not None else "cpu", enabled=False):
            return forward(*(_to_fp32(a) for a in args),
                           **{k: _to_fp32(v) for k, v in kwargs.items()})
    return fp32_forward


def apply_fp32_modules(model: nn.Module, names) -> list[str]:
    """Run each named module in float32 under autocast: its forward is wrapped in
    `torch.autocast(device, enabled=False)` with its floating-point inputs cast to float32, so
    its outputs are float32 whatever the surrounding autocast does. `names` is a list or a
    comma-separated string (RunConfig.fp32_modules). Returns the module names wrapped."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    done = []
    for name in names:
        full, module = find_module(model, name)
        if getattr(module, "_distlab_fp32", False):
            continue
        module.forward = _fp32_forward(module.forward)
        module._distlab_fp32 = True
        done.append(full)
    return done


def param_dtypes(model: nn.Module) -> dict:
    """{dtype name: number of parameters}: under autocast, all float32 (the master weights)."""
    out: dict[str, int] = {}
    for p in model.parameters():
        k = str(p.dtype).replace("torch.", "")
        out[k] = out.get(k, 0) + p.numel()
    return out
