"""Mixed precision, shown in the notebook's own process (03_memory_and_precision): the number
formats side by side, the update that rounds away without a master copy, the fp16 gradients
that underflow without loss scaling, and why ranks all-reduce the found-inf flag. The runtime's
side (autocast, the loss scaler, fp32 islands) is distlab.rank.precision.
"""

from __future__ import annotations

import torch

from distlab.comm import Comm
from distlab.config import RunConfig
from distlab.data.dataset import make_data
from distlab.fp8 import format_facts
from distlab.models import GPT, GPTConfig
from distlab.rank.precision import DynamicLossScaler
from distlab.units import DTYPES


def formats() -> dict:
    """Per format: bits of exponent/mantissa, eps (spacing just above 1.0), smallest normal,
    smallest subnormal, largest finite value. From torch.finfo, plus the subnormal, which
    torch.finfo does not list (smallest normal × eps)."""
    return {name: format_facts(dt) for name, dt in DTYPES.items()}


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


def skip_together_demo(rank: int, world: int, device, log, bad_rank: int = 1) -> dict:
    """Why the found-inf flag is all-reduced: each rank holds a different shard of the
    gradients (as under ZeRO), and only `bad_rank`'s shard holds an inf. Checked locally, only
    that rank would skip its step, and the ranks' parameters would drift apart; with the flag
    all-reduced through the Comm, every rank skips and backs off together.
    Run it with `run_ranks(skip_together_demo, 2)`."""
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


def bf16_small_values(x: float = 0.00012, tiny=(1e-8, 1e-20, 1e-38)) -> dict:
    """What bf16 does to a small gradient entry, against fp16: its two nearest bf16 numbers
    (the one at or below x and the next one up, from torch.nextafter on bf16), the value x
    becomes, and for each of `tiny` whether it survives a cast (bf16 has fp32's 8 exponent
    bits, so its smallest normal is fp32's, ~1.2e-38; fp16's is 6.1e-5, its subnormals end at
    6e-8)."""
    b = torch.tensor(x, dtype=torch.float32).to(torch.bfloat16)
    below = b if b.float().item() <= x else torch.nextafter(b, torch.tensor(0.0, dtype=b.dtype))
    above = torch.nextafter(below, torch.tensor(1.0, dtype=b.dtype))
    return {"x": x, "as_bf16": b.float().item(),
            "neighbours": (below.float().item(), above.float().item()),
            "survives": {t: {"bf16": torch.tensor(t).to(torch.bfloat16).item() != 0.0,
                             "fp16": torch.tensor(t).to(torch.float16).item() != 0.0}
                         for t in tiny}}


def adamw_step_vs_gradient_scale(scales=(1.0, 1e-3, 1e-6), lr: float = 1e-3) -> dict:
    """AdamW's first update of one weight for the same gradient multiplied by each of `scales`
    (torch.optim.AdamW, eps 1e-8): Adam divides the gradient by the root of its own running
    square, so the step does not shrink with the gradient (until the gradient nears eps). A
    larger learning rate for layers with small gradients answers a problem AdamW does not
    have."""
    out = {}
    for s in scales:
        w = torch.nn.Parameter(torch.zeros(4))
        opt = torch.optim.AdamW([w], lr=lr, weight_decay=0.0)
        w.grad = torch.full((4,), 0.5 * s)
        opt.step()
        out[s] = w.detach().abs().mean().item()
    return out
