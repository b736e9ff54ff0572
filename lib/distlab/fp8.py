"""FP8 numbers and their scaling, written here: the formats, the four ways to pick a scale,
quantize and dequantize, and delayed scaling's amax history.

Formats (OCP 8-bit floating point, as torch has them, CPU included):

    e4m3 (float8_e4m3fn)  4 exponent bits, 3 mantissa bits, no infinities: max 448, smallest
                          normal 2^-6, smallest subnormal 2^-9; for weights and activations
    e5m2 (float8_e5m2)    5 exponent bits, 2 mantissa bits: max 57344, smallest normal 2^-14,
                          smallest subnormal 2^-16; for gradients (range over precision)

A tensor is stored as q = fp8(x · s) with a scale s per group of values, and read back as
q / s. The scale maps the group's largest magnitude (amax) onto the format's max, so the group
uses the format's whole range:

    s = fmax / amax                      (amax = 0: s = 1)

Groups (the scaling granularity):

    tensorwise    one scale for the whole tensor (torchao's float8 "tensorwise")
    rowwise       one per row, the last dimension's values together (torchao's "rowwise")
    block1x128    one per 128 consecutive values of a row (DeepSeek-V3's activations, 2024,
                  §3.3.2: 1 x 128 tiles)
    block128x128  one per 128 x 128 block of a matrix (DeepSeek-V3's weights)

A row or matrix whose size is not a multiple of 128 has a last, smaller group. Why groups
matter: one large value (an outlier channel, as LLM activations have) sets its whole group's
scale, and every other value of the group is then scaled down with it, towards the format's
subnormals (fewer mantissa bits) and, below half the smallest subnormal, to zero. Smaller
groups keep an outlier's damage inside its own group.

Delayed scaling (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; Transformer
Engine's default): the scale comes from the largest amax of the last `history` steps, known
before the tensor is, so no pass over the tensor is needed before casting; a tensor larger than
its history saturates (the cast clamps to ±fmax: measured, torch 2.13 CPU). Dynamic scaling
takes the current tensor's amax.
"""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
SCHEMES = ("tensorwise", "rowwise", "block1x128", "block128x128")
BLOCK = 128


def format_facts(dtype: torch.dtype) -> dict:
    """bits, eps (spacing above 1.0), smallest normal, smallest subnormal, max: from
    torch.finfo, the subnormal as smallest normal x eps (finfo does not list it)."""
    fi = torch.finfo(dtype)
    return {"bits": fi.bits, "eps": fi.eps, "smallest_normal": fi.smallest_normal,
            "smallest_subnormal": fi.smallest_normal * fi.eps, "max": fi.max}


def _check(x: torch.Tensor, scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not one of {SCHEMES}")
    if scheme == "block128x128" and x.dim() != 2:
        raise ValueError(f"block128x128 scales a matrix, not a tensor of shape {tuple(x.shape)}")
    if scheme != "tensorwise" and x.dim() < 1:
        raise ValueError(f"{scheme} needs at least one dimension")


def _pad_to(n: int, block: int) -> int:
    return -n % block


def group_amax(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """Each value's group's amax, the shape of x (so x * (fmax / amax) scales every value by
    its own group's scale)."""
    _check(x, scheme)
    a = x.detach().abs().float()
    if scheme == "tensorwise":
        return a.max().expand_as(a)
    if scheme == "rowwise":
        return a.amax(-1, keepdim=True).expand_as(a)
    if scheme == "block1x128":
        n = a.shape[-1]
        padded = torch.nn.functional.pad(a, (0, _pad_to(n, BLOCK)))
        tiles = padded.unflatten(-1, (-1, BLOCK)).amax(-1, keepdim=True)
        return tiles.expand(*tiles.shape[:-1], BLOCK).flatten(-2)[..., :n]
    r, c = a.shape  # block128x128
    padded = torch.nn.functional.pad(a, (0, _pad_to(c, BLOCK), 0, _pad_to(r, BLOCK)))
    R, C = padded.shape[0] // BLOCK, padded.shape[1] // BLOCK
    blocks = padded.view(R, BLOCK, C, BLOCK).amax(dim=(1, 3))  # (R, C)
    return blocks.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:r, :c]


def scale_for(amax: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """fmax / amax, 1 where amax is 0 (an all-zero group stays zero at any scale)."""
    fmax = torch.finfo(dtype).max
    return torch.where(amax > 0, fmax / amax.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.ones_like(amax))


def quantize(x: torch.Tensor, scheme: str = "tensorwise", dtype: torch.dtype = E4M3,
             amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): q = fp8(x · scale) of x's shape, scale per value's group (x's shape, fp32).
    `amax`: the amax to scale by (delayed scaling's, broadcastable to x); values beyond it
    saturate at ±fmax."""
    if amax is None:
        amax = group_amax(x, scheme)
    else:
        _check(x, scheme)
    scale = scale_for(amax.float(), dtype).expand_as(x)
    fmax = torch.finfo(dtype).max
    q = (x.float() * scale).clamp(-fmax, fmax).to(dtype)  # clamp: saturate, never NaN
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() / scale


def fake_quantize(x: torch.Tensor, scheme: str = "tensorwise", dtype: torch.dtype = E4M3,
                  amax: torch.Tensor | None = None) -> torch.Tensor:
    """x as FP8 reads it back: dequantize(quantize(x)), in fp32."""
    return dequantize(*quantize(x, scheme, dtype, amax))


def error_stats(x: torch.Tensor, scheme: str, dtype: torch.dtype = E4M3,
                amax: torch.Tensor | None = None, where: torch.Tensor | None = None) -> dict:
    """What FP8 does to x under a scheme, over the values `where` selects (default: all; e.g.
    every value but an outlier channel's, the ones its scale hurts): relative error
    ||x - read back|| / ||x||; the fractions of the nonzero values that became zero (flushed),
    that landed among the format's subnormals once scaled (fewer mantissa bits), and that
    saturated at ±fmax; and how many scales the tensor carries."""
    q, scale = quantize(x, scheme, dtype, amax)
    back = dequantize(q, scale)
    xf = x.float()
    sel = torch.ones_like(xf, dtype=torch.bool) if where is None else where.expand_as(xf)
    xs, bs = xf[sel], back[sel]
    scaled = (xs * scale[sel]).abs()
    nonzero = xs != 0
    n = max(int(nonzero.sum()), 1)
    facts = format_facts(dtype)
    return {"rel_error": float((xs - bs).norm() / xs.norm().clamp_min(1e-30)),
            "flushed": int((nonzero & (bs == 0)).sum()) / n,
            "subnormal": int((nonzero & (scaled < facts["smallest_normal"])
                              & (bs != 0)).sum()) / n,
            # beyond fmax by more than the scale's own rounding (amax x fmax/amax)
            "saturated": int((scaled > facts["max"] * (1 + 2 ** -20)).sum()) / n,
            "scales": int(torch.unique(scale).numel())}


class DelayedScaling:
    """Delayed scaling of one tensor stream (an activation, a weight, a gradient): the amax to
    scale by is the largest of the last `history` amaxes seen (tensorwise), known before the
    tensor arrives; `observe(x)` records x's after it is used. Before any, the current tensor's
    own amax (what Transformer Engine does at its first step)."""

    def __init__(self, history: int = 16):
        if history < 1:
            raise ValueError(f"history={history} must be >= 1")
        self.history, self.seen = history, []

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        if not self.seen:
            return x.detach().abs().max().float()
        return torch.tensor(max(self.seen[-self.history:]))

    def observe(self, x: torch.Tensor) -> None:
        self.seen.append(float(x.detach().abs().max()))
        del self.seen[:-self.history]
