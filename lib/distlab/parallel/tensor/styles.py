"""The plan styles, named as torch.distributed.tensor.parallel's: ColwiseParallel,
RowwiseParallel, SequenceParallel and PrepareModuleInput. A style is what a plan maps a module
name to; parallelize_module calls its apply(name, module, state), which checks the module and
returns what replaces it (a layer of layers.py) or the module with a hook. Hugging Face's
Conv1D is taken as the nn.Linear it is; a column split of a fused projection warns.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from distlab.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from distlab.parallel.tensor.operators import (GatherSeq, GatherSeqToReplicated, SplitSeq,
                                               same_shape, shapes_due)


LAYOUTS = ("replicate", "sequence")  # whole tensor on every rank / dim 1 cut into t blocks


def _layout(value, what):
    if value not in LAYOUTS:
        raise ValueError(f"{what}={value!r} is not one of {LAYOUTS}: 'replicate' (the whole "
                         f"tensor on every rank) or 'sequence' (dim 1 cut into a block per rank)")
    return value


class ColwiseParallel:
    """nn.Linear split by output features: rank r keeps out_features/t of them, its output is
    its block of the last dim. input_layout: "replicate" (Megatron's f enters the region) or
    "sequence" (the input is a sequence shard from SequenceParallel: all-gathered first).

    parts: a fused projection, several outputs side by side in one Linear: an int (that many
    equal parts: 3 for q|k|v) or the parts' widths (grouped KV heads: (q, k, v) widths). Rank r
    keeps block r of each part, so its output is [q_r | k_r | v_r], each 1/t as wide: the
    model's own split of it must then use the local widths (GPT-2: attn.split_size =
    n_embd // t; Megatron's attention does the same with its local head count)."""

    def __init__(self, input_layout: str = "replicate", parts: int | tuple | None = None):
        self.input_layout = _layout(input_layout, "input_layout")
        if parts is not None and not (isinstance(parts, int) and parts >= 2 or (
                isinstance(parts, (tuple, list)) and len(parts) >= 2
                and all(isinstance(w, int) and w > 0 for w in parts))):
            raise ValueError(f"parts={parts!r}: the number of equal parts (an int >= 2) or "
                             "their widths (a tuple of two or more positive ints)")
        self.parts = tuple(parts) if isinstance(parts, (tuple, list)) else parts

    def apply(self, name, module, state):
        module = _as_linear(name, module, state)
        t = state.comm.world
        if self.parts is None:
            _check_linear(self, name, module, "out_features", t)
            _warn_if_fused(name, module)
            widths = None
        else:
            _check_linear(self, name, module, "out_features", 1)
            widths = _part_widths(name, module.out_features, self.parts, t)
            state.fused[name] = widths
        state.sharded[name] = "colwise"
        return ColumnParallelLinear(module, state.comm, state.entry, self.input_layout, widths)


def _part_widths(name: str, out_features: int, parts, t: int) -> tuple[int, ...]:
    if isinstance(parts, int):
        if out_features % parts:
            raise ValueError(f"ColwiseParallel(parts={parts}) on '{name}': out_features="
                             f"{out_features} is not {parts} equal parts; give the widths")
        parts = (out_features // parts,) * parts
    if sum(parts) != out_features:
        raise ValueError(f"ColwiseParallel(parts={parts}) on '{name}': the widths add up to "
                         f"{sum(parts)}, not its out_features={out_features}")
    if any(w % t for w in parts):
        raise ValueError(f"ColwiseParallel(parts={parts}) on '{name}': each part is cut into "
                         f"{t} equal blocks, so each width must be divisible by {t} "
                         "(attention: heads, and KV heads, divisible by the ranks)")
    return tuple(parts)


class RowwiseParallel:
    """nn.Linear split by input features: takes the block a ColwiseParallel layer produced and
    sums the ranks' partial outputs. output_layout: "replicate" (all-reduce: Megatron's g) or
    "sequence" (reduce-scatter along dim 1, for SequenceParallel modules after it)."""

    def __init__(self, output_layout: str = "replicate"):
        self.output_layout = _layout(output_layout, "output_layout")

    def apply(self, name, module, state):
        module = _as_linear(name, module, state)
        _check_linear(self, name, module, "in_features", state.comm.world)
        state.sharded[name] = "rowwise"
        new = RowParallelLinear(module, state.comm, self.output_layout, name)
        new.check_shapes = state.check_shapes
        if self.output_layout == "sequence" and new.bias is not None:
            state.partial_params.append(new.bias)  # added to 1/t of the sequence on each rank
        return new


class SequenceParallel:
    """A norm or dropout run on this rank's block of the sequence (input and output
    sequence-sharded, weights replicated). Its parameters' gradients are partial sums over
    the ranks' blocks: they are all-reduced when backward returns."""

    TYPES = (nn.LayerNorm, nn.Dropout) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())

    def apply(self, name, module, state):
        if not isinstance(module, self.TYPES):
            raise TypeError(
                f"SequenceParallel applies to {', '.join(t.__name__ for t in self.TYPES)}; "
                f"'{name}' is a {type(module).__name__}. Modules that mix positions (attention) "
                f"need the whole sequence: leave them out of the plan (ColwiseParallel with "
                f"input_layout='sequence' gathers it for their linear layers)")
        state.partial_params.extend(p for p in module.parameters() if p.requires_grad)
        return module


class PrepareModuleInput:
    """Change the layout of a module's first positional input (names as torch's):

      "replicate" -> "sequence"   keep this rank's block of dim 1: the residual stream enters
                                  the sequence-parallel region (backward all-gathers)
      "sequence" -> "replicate"   all-gather dim 1 for a module that needs the whole sequence:
                                  use_local_output=False (default): its ColwiseParallel layers
                                  read it (attention: q, k, v), Megatron's g_sp, their partial
                                  input gradients reduce-scattered once; use_local_output=True:
                                  plain replicated code reads it (the output head), its
                                  gradient is whole on every rank and each keeps its block."""

    def __init__(self, input_layout: str, desired_input_layout: str,
                 use_local_output: bool = False):
        self.src = _layout(input_layout, "input_layout")
        self.dst = _layout(desired_input_layout, "desired_input_layout")
        self.local = use_local_output
        if self.src == self.dst:
            raise ValueError(f"input_layout and desired_input_layout are both {self.src!r}: "
                             f"nothing to prepare; leave this module out of the plan")

    def apply(self, name, module, state):
        module.register_forward_pre_hook(
            lambda mod, args: (self._prepare(args[0], state, name), *args[1:]))
        return module

    def _prepare(self, x, state, name):
        state.calls[name] = state.calls.get(name, 0) + 1
        if shapes_due(state.check_shapes, state.calls[name]):
            same_shape(state.comm, x, f"the input of PrepareModuleInput '{name}' ({self.src} "
                                      f"to {self.dst})")
        if self.dst == "sequence":
            return SplitSeq.apply(x, state.comm)
        if self.local:
            return GatherSeqToReplicated.apply(x, state.comm)
        y = GatherSeq.apply(x, state.comm)
        state.entry.prepare(y)  # the column-parallel layers reading y: entry done
        return y


FUSED_NAMES = ("c_attn", "qkv", "qkv_proj", "wqkv", "query_key_value", "gate_up_proj", "w13")


def _warn_if_fused(name: str, module: nn.Linear) -> None:
    """A column split of a fused projection (q|k|v side by side in one Linear) gives rank r the
    r-th block of the concatenation: all of q on rank 0 and all of v on the last, not each
    rank's heads of each, and the model's own split of the output then fails or, if the widths
    happen to divide, computes something else."""
    qkv_wide = module.out_features == 3 * module.in_features and "attn" in name.lower()
    if qkv_wide or name.rsplit(".", 1)[-1].lower() in FUSED_NAMES:
        warnings.warn(f"ColwiseParallel on '{name}' ({module.in_features} -> "
                      f"{module.out_features}): this looks like a fused projection (q, k and v, "
                      "or gate and up, side by side); a column split does not give each rank "
                      "its share of each part. Use ColwiseParallel(parts=3) (or the parts' "
                      "widths), which does, and make the model split its output by the local "
                      "widths", stacklevel=3)


def _is_conv1d(module) -> bool:
    """Hugging Face's Conv1D (GPT-2): y = x @ W + b with W stored (in, out), nf = out."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _as_linear(name: str, module, state):
    """A Conv1D as the nn.Linear it is (weight transposed); split like any Linear, and its
    whole weight handed back in Conv1D's layout by full_state_dict (state.transposed)."""
    if not _is_conv1d(module):
        return module
    n_in, n_out = module.weight.shape
    linear = nn.Linear(n_in, n_out, bias=module.bias is not None,
                       device=module.weight.device, dtype=module.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(module.weight.t())
        if module.bias is not None:
            linear.bias.copy_(module.bias)
    state.transposed.add(name)
    return linear


def _check_linear(style, name, module, dim, t):
    kind = type(style).__name__
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{kind} applies to nn.Linear; '{name}' is a {type(module).__name__}. "
                        f"Name its linear layers in the plan (norms and dropout: "
                        f"SequenceParallel; anything else stays replicated if left out)")
    if getattr(module, dim) % t:
        raise ValueError(f"{kind} on '{name}': {dim}={getattr(module, dim)} is not divisible by "
                         f"the group's {t} ranks; each rank keeps an equal block, so choose a "
                         f"width divisible by {t} (attention: heads divisible by {t})")
