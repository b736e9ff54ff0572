"""Mixed precision: autocast, fp32 master weights, fp32 islands, and dynamic loss scaling.

**Master weights.** With RunConfig(precision="bf16"|"fp16") the model's parameters, their
gradients (`.grad`) and the optimizer state stay float32: `torch.autocast` (distlab.train) casts
each op's *inputs* to the low-precision dtype on the fly, so matmuls and convolutions compute in
bf16/fp16, while every update lands in float32. That is Micikevicius et al. 2018 ("Mixed
Precision Training")'s fp32 master copy, without a second copy: the only low-precision tensors
are the casts autocast makes during forward and the activations it saves. `param_dtypes(model)`
shows it. Why the master copy matters is `rounding_demo()`: near w = 1, bf16 can only represent
steps of 2^-7, so an update of 1e-3 applied to a bf16 weight rounds away, every step.

**fp32 islands.** `apply_fp32_modules(model, "tok_emb,head")` makes the named modules run with
autocast off and their inputs cast to float32 (numerically touchy layers: the output head and its
softmax, norms, the router of an MoE). Applied from outside, by name, as RunConfig.fp32_modules.

**Dynamic loss scaling** (fp16). fp16's smallest subnormal is 2^-24 ≈ 6e-8, and late in training
many gradient entries are smaller than that: cast to fp16 they become 0 (`fp16_underflow_demo()`
measures how many). Multiplying the loss by S multiplies every gradient by S (backward is
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

In the loop (distlab.train), after `strategy.reduce_gradients`, `finish_step` unscales and
checks the gradients the strategy's optimizer will read (`strategy.step_gradients`), clips them
(`strategy.clip_gradients`, cfg.grad_clip), and steps or skips. The step event gets
`scale` (the scale this step's backward used; None without loss scaling), `skipped` and, with
clipping, `grad_norm` (the global norm before clipping).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from distlab.modules import find_module
from distlab.units import DTYPES



# -- loss scaling --------------------------------------------------------------------------------
def resolve_loss_scale(cfg) -> str:
    """"dynamic" or "none": RunConfig.loss_scale with "auto" resolved (dynamic for fp16)."""
    if cfg.loss_scale == "auto":
        return "dynamic" if cfg.precision == "fp16" else "none"
    return cfg.loss_scale


def make_loss_scaler(cfg, comm=None) -> "DynamicLossScaler | None":
    if resolve_loss_scale(cfg) != "dynamic":
        return None
    return DynamicLossScaler(init_scale=cfg.loss_scale_init,
                             growth_interval=cfg.loss_scale_growth_interval, comm=comm)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 gradients), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


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


def finish_step(strategy, model, optimizer, scaler: DynamicLossScaler | None,
                grad_clip: float = 0.0) -> dict:
    """The loop's step after reduce_gradients: unscale and check (loss scaling), clip, then
    step or skip. Returns the step event's fields: scale, skipped, and grad_norm if clipping."""
    info = {"scale": None, "skipped": False}
    found_inf = False
    if scaler is not None:
        info["scale"] = scaler.get_scale()
        found_inf = scaler.unscale_(strategy.step_gradients(model))
    if grad_clip and not found_inf:
        info["grad_norm"] = float(strategy.clip_gradients(model, grad_clip))
    if not found_inf:
        strategy.optimizer_step(optimizer)
    if scaler is not None:
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


# -- demonstrations for the notebook -------------------------------------------------------
def formats() -> dict:
    """Per format: bits of exponent/mantissa, eps (spacing just above 1.0), smallest normal,
    smallest subnormal, largest finite value. From torch.finfo, plus the subnormal, which
    torch.finfo does not list (smallest normal × eps)."""
    out = {}
    for name, dt in DTYPES.items():
        fi = torch.finfo(dt)
        out[name] = {"bits": fi.bits, "eps": fi.eps, "smallest_normal": fi.smallest_normal,
                     "smallest_subnormal": fi.smallest_normal * fi.eps, "max": fi.max}
    return out


def rounding_demo(w: float = 1.0, update: float = 1e-3, steps: int = 100) -> dict:
    """"The gradient that rounds": add `update` to a weight `w`, `steps` times, (a) with the
    weight itself stored in each format (pure low precision) and (b) with an fp32 master weight
    that is cast to the format only for use (mixed precision).

    With the defaults: an update of 1e-3 is below half of bf16's spacing at 1.0 (2^-7/2 ≈
    0.0039), so w stays exactly 1.0 in bf16 after any number of steps; fp16's spacing is 2^-10 ≈
    0.00098, so one update rounds *up* to 2^-10 (1.0009766, 2.3% too large) and 100 of them give
    1.0977 instead of 1.1; an fp32 weight (the master copy) reaches 1.1000047 (fp32's own
    rounding of 1e-3 accumulates to 5e-6), and cast to bf16 for use that reads 1.1015625, the
    nearest bf16 number: the updates were kept, only their use is rounded.
    """
    out = {}
    for name, dt in DTYPES.items():
        x = torch.tensor(w, dtype=dt)
        one = x + torch.tensor(update, dtype=dt)
        for _ in range(steps):
            x = x + torch.tensor(update, dtype=dt)
        out[name] = {"eps": torch.finfo(dt).eps, "after_one_update": one.item(),
                     f"after_{steps}_updates": x.item()}
    master = torch.tensor(w, dtype=torch.float32)
    for _ in range(steps):
        master = master + update
    out["fp32_master"] = {f"after_{steps}_updates": master.item(),
                          "as_bf16": master.to(torch.bfloat16).item(),
                          "as_fp16": master.to(torch.float16).item()}
    out["exact"] = w + steps * update
    return out


def tiny_gpt_gradients(seed: int = 0, **cfg_changes) -> dict:
    """{name: fp32 gradient} of one step of distlab's default tiny GPT (RunConfig()) on the
    first global batch of its data, computed in float32."""
    from distlab.config import RunConfig
    from distlab.dataset import make_data
    from distlab.models import GPT, GPTConfig

    cfg = RunConfig(seed=seed, **cfg_changes)
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig.from_run(cfg))
    x, y = make_data(cfg).rank_batch(0, cfg.global_batch, 0, 1)
    model(x, y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def fp16_underflow_demo(rms: float = 1e-5, scale: float = 2.0 ** 16, seed: int = 0) -> dict:
    """What fraction of a real gradient's entries become 0 when cast to fp16, without and with
    loss scaling.

    The gradients are those of distlab's tiny GPT (0.8M parameters, `tiny_gpt_gradients`),
    rescaled so their root-mean-square entry is `rms`: a late-training magnitude for a large
    model (a 1B-parameter model with global gradient norm 0.3 has an RMS entry of
    0.3/sqrt(1e9) ≈ 1e-5; the tiny GPT's own at init is ~4e-3). The shape of the distribution
    is the tiny GPT's. Each entry is cast to fp16 (a) as is, (b) multiplied by `scale`.

    Measured (seed 0, torch 2.13 CPU): 6.4% of the non-zero entries become 0 unscaled; 0.063%
    with a scale of 2^16, and those are exactly the key projections' biases, whose gradient is
    analytically zero (softmax ignores a constant added to every score of a row), ~1e-11 from
    fp32 rounding. Excluding them, 0.0%. 99.9% of entries are below fp16's smallest normal
    (2^-14) unscaled, so even the survivors lose mantissa bits as subnormals.
    """
    grads = tiny_gpt_gradients(seed)
    flat = torch.cat([g.flatten() for g in grads.values()]).double()
    k = rms / flat.pow(2).mean().sqrt()
    nonzero = flat != 0

    def zero_frac(t, mask):
        return ((t.to(torch.float16) == 0) & mask).sum().item() / mask.sum().item()

    unscaled, scaled = flat * k, flat * k * scale
    # the parameters whose gradient is analytically zero: attention key biases
    is_kbias = torch.cat([torch.full((g.numel(),), n.endswith("attn.k.bias"))
                          for n, g in grads.items()])
    by_param = {}
    for n, g in grads.items():
        z = ((g.double() * k * scale).to(torch.float16) == 0) & (g != 0)
        if z.any():
            by_param[n] = int(z.sum())
    return {
        "entries": flat.numel(), "nonzero": int(nonzero.sum()), "rms": rms, "scale": scale,
        "median_abs": (flat.abs() * k).median().item(),
        "zero_fraction_unscaled": zero_frac(unscaled, nonzero),
        "zero_fraction_scaled": zero_frac(scaled, nonzero),
        "zero_fraction_scaled_without_k_bias": zero_frac(scaled, nonzero & ~is_kbias),
        "subnormal_fraction_unscaled": ((unscaled.abs() < 2.0 ** -14) & nonzero).sum().item()
        / nonzero.sum().item(),
        "overflow_fraction_scaled": (scaled.abs() > torch.finfo(torch.float16).max)
        .double().mean().item(),
        "scaled_zeros_by_param": by_param,
    }


def skip_together_drill(rank: int, world: int, device, log, bad_rank: int = 1) -> dict:
    """Why the found-inf flag is all-reduced: each rank holds a different shard of the
    gradients (as under ZeRO), and only `bad_rank`'s shard holds an inf. Checked locally, only
    that rank would skip its step, and the ranks' parameters would drift apart; with the flag
    all-reduced through the Comm, every rank skips and backs off together.
    Run it with `run_ranks(skip_together_drill, 2)`."""
    from distlab.comm import Comm

    comm = Comm()
    shard = torch.full((4,), 1024.0 * (rank + 1), device=device)
    if rank == bad_rank:
        shard[1] = float("inf")
    local = DynamicLossScaler(init_scale=1024.0).unscale_([shard.clone()])
    synced = DynamicLossScaler(init_scale=1024.0, comm=comm)
    found = synced.unscale_([shard])
    synced.update(found)
    return {"local_found_inf": local, "synced_found_inf": found,
            "scale_after": synced.get_scale(), "comm": comm.snapshot()}
