"""FP8 training of the GPT's linear layers: RunConfig(precision="fp8", fp8_scaling=...).

Each of a block's Linear layers (attention's q, k, v, o; the MLP's or each expert's two) runs
its three matmuls on FP8 operands, as torchao's float8 training and DeepSeek-V3 do:

    forward   y      = x  @ Wᵀ     x: e4m3, W: e4m3
    backward  dL/dx  = g  @ W      g: the output's gradient in RunConfig.fp8_grad_format
              dL/dW  = gᵀ @ x      (e5m2 by default: range over precision; DeepSeek-V3 keeps
                                    e4m3 everywhere, its fine-grained scales giving the range)

Every operand is cast from the fp32 tensor (the master weight, the saved input) with its own
scale, computed from the values being cast (dynamic scaling), along the dimension its matmul
sums over, as torchao's rowwise recipe does; the products accumulate in fp32, and the bias,
the master weights, the gradients the optimizer reads and every other op (embeddings, norms,
softmax, the output head, an MoE's router) stay fp32. DeepSeek-V3 (2024, §3.3.1) keeps the same
parts out of FP8: the embedding, the output head, the gating, the norms and attention's
softmax. fp8_scaling picks the groups that share a scale (distlab.fp8):

    tensorwise   one scale per operand
    rowwise      one per row of the sum: per token for x, per output channel for W, ...
    blockwise    DeepSeek-V3's: 1 x 128 tiles of x and g along the sum, 128 x 128 blocks of W

The matmuls multiply the values FP8 reads back (dequantized, exact in fp32) in fp32: what
torch._scaled_mm computes from the FP8 bytes and their scales, up to the order of the fp32
sum (tests/test_fp8_training.py compares the two). The output and the gradients come back in
the input's and the parameters' dtypes (bf16 under zero3's param_dtype="bf16"). On a CPU this
is slower than fp32, not faster: the point here is the numerics.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distlab import fp8
from distlab.config.precision import FP8_GRAD_FORMATS, FP8_SCALINGS

KEPT_OUT = ("head", "router")  # Linears that stay fp32 (DeepSeek-V3 §3.3.1)


def cast(t: torch.Tensor, scaling: str, fmt: torch.dtype, summed: int, weight: bool = False):
    """t (2-D) as FP8 reads it back, scaled in groups along dim `summed` (the one its matmul
    sums over). blockwise: 128 x 128 blocks for a weight, 1 x 128 tiles along `summed` else."""
    if scaling == "tensorwise":
        return fp8.fake_quantize(t, "tensorwise", fmt)
    if scaling == "blockwise" and weight:
        return fp8.fake_quantize(t, "block128x128", fmt)
    scheme = "rowwise" if scaling == "rowwise" else "block1x128"
    if summed == 1:
        return fp8.fake_quantize(t, scheme, fmt)
    return fp8.fake_quantize(t.t(), scheme, fmt).t()


class FP8Matmul(torch.autograd.Function):
    """x @ Wᵀ (+ b) with every matmul of forward and backward on FP8 operands."""

    @staticmethod
    def forward(ctx, x, weight, bias, scaling: str, grad_format: torch.dtype):
        x2 = x.reshape(-1, x.shape[-1]).float()
        w = weight.float()
        # a weight zero3 all-gathered in FP8 arrives as its e4m3 values over their tensorwise
        # scale: cast already, and casting it again could move a value by the rounding of
        # its scale (distlab.parallel.zero.fsdp)
        ctx.on_grid = on_grid = (scaling == "tensorwise"
                                 and getattr(weight, "_distlab_fp8_gathered", False))
        wq = w if on_grid else cast(w, scaling, fp8.E4M3, 1, weight=True)
        y = cast(x2, scaling, fp8.E4M3, 1) @ wq.t()
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x2, w)
        ctx.scaling, ctx.grad_format, ctx.shape = scaling, grad_format, x.shape
        ctx.dtypes = x.dtype, weight.dtype, None if bias is None else bias.dtype
        # the input's dtype out (bf16 under zero3's bf16 parameters), as torchao's Linear
        return y.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x2, w = ctx.saved_tensors
        s, fmt = ctx.scaling, ctx.grad_format
        g = grad_y.reshape(-1, w.shape[0]).float()
        wq = w if ctx.on_grid else cast(w, s, fp8.E4M3, 0, weight=True)
        grad_x = cast(g, s, fmt, 1) @ wq
        grad_w = cast(g, s, fmt, 0).t() @ cast(x2, s, fp8.E4M3, 0)
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        grad_b = g.sum(0).to(b_dtype) if b_dtype is not None else None
        return grad_x.reshape(ctx.shape).to(x_dtype), grad_w.to(w_dtype), grad_b, None, None


def _fp8_forward(module: nn.Linear, scaling: str, grad_format: torch.dtype):
    def forward(x):
        return FP8Matmul.apply(x, module.weight, module.bias, scaling, grad_format)
    return forward


def apply_fp8(model: nn.Module, scaling: str = "tensorwise", grad_format: str = "e5m2",
              kept_out=KEPT_OUT) -> list[str]:
    """Make every nn.Linear of `model` compute in FP8, but those whose name ends in one of
    `kept_out`. The module, its parameters and their names stay as they are (the forward
    alone is replaced), so every strategy shards, gathers and checkpoints them as before.
    Returns the names of the layers made FP8."""
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8_scaling={scaling!r} is not one of {FP8_SCALINGS}")
    if grad_format not in FP8_GRAD_FORMATS:
        raise ValueError(f"fp8_grad_format={grad_format!r} is not one of {FP8_GRAD_FORMATS}")
    done = []
    for name, module in model.named_modules():
        if (isinstance(module, nn.Linear) and not name.split(".")[-1] in kept_out
                and not getattr(module, "_distlab_fp8", False)):
            module.forward = _fp8_forward(module, scaling, fp8.FORMATS[grad_format])
            module._distlab_fp8 = True
            module.weight._distlab_fp8 = True  # fully_shard may all-gather it in FP8
            done.append(name)
    return done
