"""Activation checkpointing (recomputation): keep a region's inputs, recompute the rest in backward.

Backward needs tensors from the forward: each layer saves what its gradient formula reads.
Checkpointing a region keeps only the region's inputs and recomputes the rest in backward:
memory falls, compute grows. It is applied from outside the model, by module name, as
torchtitan applies its parallelisms: the model code knows nothing of it.

    apply_checkpointing(model, "full")        each GPT block `blocks.i`
    apply_checkpointing(model, "selective")   each block, keeping the matmul outputs
    RunConfig(checkpointing="full")           the training loop calls it in build_model

What a block of our GPT saves for backward, in units of s·b·h values (4 bytes each in fp32;
s sequence, b micro-batch, h n_embd, r mlp_ratio, a heads; distlab.theory.estimate derives it):

    none       ln1 in, ln1 out, q, k, v, attention out, ln2 in, ln2 out,   8 + 2r   (16 at r=4)
               fc out (r), gelu out (r); plus LayerNorm mean/rstd (4sb) and the attention's
               log-sum-exp (a·s·b)
    selective  block in, q, k, v, o out, fc out (r), proj out               6 + r   (10 at r=4)
    full       block in                                                     1

`full`: torch.utils.checkpoint.checkpoint(block, use_reentrant=False) around each block.
Backward reruns the whole block forward: about one more forward pass, ~1/3 more step compute.

`selective`, following Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Section 5): recompute the operations whose outputs are large but cheap to
recompute, keep the ones that are expensive (the matmuls). Korthikanti et al. recompute the
attention core (QKᵀ, softmax, dropout, attention over V), whose 5as²b bytes dwarf its FLOPs.
On this stack that core is F.scaled_dot_product_attention, which on CPU runs a flash kernel:
it already keeps no s×s matrix (it saves q, k, v, its output and the log-sum-exp and
recomputes the softmax in backward — the paper's selective recomputation, done inside the
kernel). So checkpointing the core alone would save only the log-sum-exp (a·s·b floats). Our
`selective` therefore recomputes the attention core *and* the other cheap elementwise and
normalisation ops — LayerNorm, GELU, residual adds (Megatron-core's selective modules
"core_attn", "layernorm" and the activation function) — and keeps the outputs of every matmul
(q, k, v, o, fc, proj), so no matmul is recomputed. It uses torch's selective activation
checkpointing (create_selective_checkpoint_contexts with a policy). It drops ln1 out, ln2 in,
ln2 out, the attention output and the GELU output (2 + r values per position) and adds the o
and proj outputs the recomputation needs to rebuild the residual stream: 16 -> 10 at r=4.
The recomputation costs the attention forward (~4·s²·h·b FLOPs, causal roughly half) plus
elementwise ops, against the block's matmuls (2·(4 + 2r)·s·b·h² FLOPs) that `full` reruns.

Measured (benchmarks/memory_checkpointing.py, one thread, AdamW; activations equal the
estimate to the byte):

    GPT 4x128, 16x64 tokens   activations MiB   peak MiB   step time
      none                        33.40           44.3       1.00x
      selective                   21.27           35.7       ~1.23x
      full                         3.27           22.5       ~1.24x
    GPT 4x256, 8x128 tokens
      none                        66.40          107.1       1.00x
      selective                   42.27           90.0       ~1.07x
      full                         6.27           68.1       ~1.20x

At the default size selective costs as much time as full: torch's selective checkpointing runs
every op of the block through Python dispatch modes (caching in forward, replaying in the
recomputation), a fixed cost per op that the small matmuls do not hide; as the model grows the
matmuls dominate and selective's cost falls towards its recomputed FLOPs.

The outputs that selective checkpointing keeps live in torch's own cache, not in autograd's
saved tensors; the policy reports them to distlab.memory's ActivationMeter (count_saved), so
the meter's bytes are what is kept for backward in all three modes.

Gradients are unchanged: recomputation reruns the same ops on the same inputs (no dropout in
our GPT, so no RNG to replay; torch's checkpoint would restore it anyway), and the results are
bitwise equal on CPU (tests/test_checkpointing.py checks).

Training checkpoints (save, resume, resharding) belong here too; they come in a later issue.
"""

from __future__ import annotations

import functools
import re
import types

import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from distlab.memory import count_saved

MODES = ("none", "full", "selective")
# Module names checkpointed per block: our GPT's blocks are `blocks.0`, `blocks.1`, ...
BLOCK_PATTERN = r"blocks\.\d+"

aten = torch.ops.aten
# The FLOP-heavy ops whose outputs selective checkpointing keeps (Linear lowers to these).
_KEEP = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
         aten.linear.default}


def _selective_policy(ctx, func, *args, **kwargs):
    """Keep the output of matmuls; recompute everything else (attention core, LayerNorm,
    GELU, adds, views). Called once per op in the forward."""
    if func in _KEEP:
        out = getattr(ctx, "op_output", None)  # torch >= 2.9 hands the output to the policy
        if isinstance(out, torch.Tensor):
            count_saved(out)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed_forward(self, *args, **kwargs):
    """The block's forward under torch.utils.checkpoint (installed on the instance)."""
    if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
        return self._distlab_inner_forward(*args, **kwargs)
    if self._distlab_checkpointing == "selective":
        return checkpoint(self._distlab_inner_forward, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                       _selective_policy), **kwargs)
    return checkpoint(self._distlab_inner_forward, *args, use_reentrant=False, **kwargs)


def apply_checkpointing(model: nn.Module, mode: str, pattern: str = BLOCK_PATTERN) -> list[str]:
    """Checkpoint every module whose name matches `pattern` (default: each GPT block) in
    `mode` ("full" or "selective"; "none" removes it). Returns the names changed.

    The module keeps its name, parameters and state_dict keys: only its forward is wrapped
    (on the instance; a deep copy of the model stays checkpointed and bound to the copy)."""
    if mode not in MODES:
        raise ValueError(f"checkpointing={mode!r} is not one of: {', '.join(map(repr, MODES))}")
    names = [(n, m) for n, m in model.named_modules() if re.fullmatch(pattern, n)]
    if not names and mode != "none":
        raise ValueError(f"checkpointing={mode!r}: no module of {type(model).__name__} is "
                         f"named like {pattern!r} (activation checkpointing is per GPT block)")
    for _, module in names:
        if getattr(module, "_distlab_checkpointing", None) is not None:
            if mode == "none":  # undo: back to the forward it had
                inner = module._distlab_inner_forward
                del module._distlab_checkpointing, module._distlab_inner_forward
                if getattr(inner, "__self__", None) is module and \
                        inner.__func__ is type(module).forward:
                    del module.forward  # the class's forward again
                else:
                    module.forward = inner
            else:
                module._distlab_checkpointing = mode
            continue
        if mode == "none":
            continue
        module._distlab_inner_forward = module.forward  # bound method, or an earlier wrapper
        module._distlab_checkpointing = mode
        module.forward = types.MethodType(_checkpointed_forward, module)
    return [n for n, _ in names]


def checkpointing_of(model: nn.Module) -> dict:
    """{module name: mode} for every checkpointed module."""
    return {n: m._distlab_checkpointing for n, m in model.named_modules()
            if getattr(m, "_distlab_checkpointing", None) is not None}
