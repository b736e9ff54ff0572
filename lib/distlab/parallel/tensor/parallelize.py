"""parallelize_module: a plan applied to any module (torch's name and signature), and what it
leaves on the module (TensorParallelState, kept as module._distlab_tp): which layers are split,
the global-norm gradient clipping that follows from it (clip_by_global_norm, torch's
clip_grad_norm_ routed here), and full_state_dict, the whole weights gathered back under their
original names. An optimizer built before parallelize_module is refused at its step().
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from distlab.comm import Comm
from distlab.modules import name_matches
from distlab.parallel.agree import agree, buffer_layout, parameter_layout
from distlab.parallel.tensor.layers import _RegionEntry, fused_rows
from distlab.parallel.tensor.operators import KINDS, _PartialGrads
from distlab.parallel.tensor.plans import _from_string
from distlab.parallel.zero.optimizer import route_torch_clip


def sharded_ids(module: nn.Module, sharded: dict) -> set[int]:
    """ids of the parameters split across the ranks: the sharded layers' weights, and the
    column-parallel ones' biases (a row-parallel bias is replicated)."""
    ids = set()
    for name, style in sharded.items():
        try:
            m = module.get_submodule(name)
        except AttributeError:  # a pipeline stage that does not hold this layer (3d)
            continue
        ids.add(id(m.weight))
        if style == "colwise" and m.bias is not None:
            ids.add(id(m.bias))
    return ids


def clip_by_global_norm(comm, params: list, sharded: set, max_norm: float) -> torch.Tensor:
    """Scale the gradients so their global L2 norm is at most max_norm; return that norm.
    Squares of the sharded gradients are summed across the ranks (one all-reduce of one
    number), the replicated ones (identical on every rank once backward returned) counted
    once; torch.nn.utils.clip_grad_norm_'s coefficient max_norm / (norm + 1e-6), at most 1.
    Every rank of the group calls it with the same parameters."""
    grads = [(p.grad, id(p) in sharded) for p in params if p.grad is not None]
    dev = grads[0][0].device if grads else torch.device("cpu")  # NCCL: reduced on the GPU
    sq_sh, sq_rep = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    for g, split in grads:
        (sq_sh if split else sq_rep).add_(g.float().pow(2).sum())
    comm.all_reduce_async(sq_sh, kind=KINDS["norm"]).wait()
    norm = (sq_sh + sq_rep).sqrt()[0]
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g, _ in grads:
        g.mul_(scale.to(g.dtype))
    return norm


class TensorParallelState:
    """What parallelize_module did to a module (kept as module._distlab_tp): the group's
    Comm, the sharded layers by name ("colwise"/"rowwise"), and the replicated parameters
    whose gradients are partial sums (sequence parallel)."""

    def __init__(self, comm, check_shapes="doubling"):
        self.comm, self.entry = comm, _RegionEntry(comm)
        # when the ranks' shapes are compared before each exit's sum (operators.shapes_due)
        self.check_shapes = check_shapes
        self.calls: dict[str, int] = {}  # PrepareModuleInput's calls, by name
        self.sharded: dict[str, str] = {}
        self.transposed: set[str] = set()  # Conv1D layers: their whole weight is (in, out)
        self.fused: dict[str, tuple] = {}  # fused column-parallel layers: their parts' widths
        self.partial_params: list[nn.Parameter] = []
        self.partial_grads = None
        self.split: set[int] = set()  # ids of the parameters split across the ranks

    def clip_grad_norm_(self, params, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ over this module's parameters: the global norm (each
        rank holds 1/t of the split layers' gradients, so a local norm would differ by rank
        and clip each rank's shard by another factor)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"torch.nn.utils.clip_grad_norm_ with norm_type={norm_type} over "
                             "a tensor-parallel module: distlab computes the global L2 norm "
                             "only (norm_type=2)")
        norm = clip_by_global_norm(self.comm, params, self.split, float(max_norm))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is {norm.item()}: non-finite")
        return norm


def parallelize_module(module: nn.Module, plan: dict, group=None, comm=None,
                       check_shapes: bool | None = None) -> nn.Module:
    """Megatron tensor parallelism on any module, over a process group (default: the world).

        model = distlab.parallelize_module(model, {"blocks.*.attn.q": distlab.ColwiseParallel(),
                                                   "blocks.*.attn.o": distlab.RowwiseParallel()})

    plan     module name (fnmatch pattern per dotted part, as torch's parallelize_module takes
             them: "blocks.*.mlp.fc") -> ColwiseParallel(), RowwiseParallel(),
             SequenceParallel() or PrepareModuleInput(...)
    comm     a distlab.comm.Comm to communicate (and book bytes) through instead of one made
             over `group`
    check_shapes  compare the ranks' shapes before each RowwiseParallel's sum and each
             PrepareModuleInput, and name the layer and both shapes when they differ (gloo
             would abort a rank with "Received data size doesn't match"): True at every
             call, False never; None (default): at each layer's calls 1, 2, 4, 8, ... (one
             small all-gather each, so log2(n) + 1 in n forwards), or every call when
             TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's switch for its own check)

    Every rank first takes rank 0's parameters and buffers (broadcast), then keeps its block
    of each sharded layer; the module changes in place (sharded layers are replaced) and is
    returned: build the optimizer after this. Every rank feeds the whole batch. The replicated
    parameters that see a sequence shard (SequenceParallel, and a RowwiseParallel bias with
    output_layout="sequence") get the ranks' summed gradient when backward returns.
    `full_state_dict(model)` gathers the whole weights (a collective)."""
    if getattr(module, "_distlab_tp", None) is not None:
        raise ValueError("this module is already tensor-parallel (parallelize_module ran on it): "
                         "its layers hold 1/t blocks and would be split again; call it once, "
                         "with every entry in one plan")
    if check_shapes is None:
        detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
        check_shapes = True if detail else "doubling"
    state = TensorParallelState(comm if comm is not None else Comm(group), check_shapes)
    targets = _match(module, plan)
    agree(state.comm, "distlab.parallelize_module",  # before the broadcast, which would not
          {"parameters": parameter_layout(module),    # notice a shape that differs
           "buffers": buffer_layout(module),
           "plan": [(name, _describe(style)) for name, style in targets]})
    if state.comm.world > 1:
        with torch.no_grad():  # every rank splits the same weights: rank 0's
            state.comm.broadcast_tensors(
                [t.data for t in list(module.parameters()) + list(module.buffers())], src=0)
    before = dict(module.named_parameters())
    for name, style in targets:
        new = style.apply(name, module.get_submodule(name) if name else module, state)
        if name:
            parent, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, child, new)
    _retire(before, {id(p) for p in module.parameters()})
    if state.partial_params:
        state.partial_grads = _PartialGrads(state.comm, state.partial_params)
    module._distlab_tp = state
    state.split = sharded_ids(module, state.sharded)
    for p in module.parameters():  # torch's clip habit reaches state.clip_grad_norm_
        p._distlab_tp_clip = state
    route_torch_clip()
    return module


_RETIRED_HOOK = []  # the global optimizer step pre-hook's handle, once a layer was replaced


def _retire(before: dict, live: set) -> None:
    """Parameters the replaced layers held are no longer the model's: an optimizer built over
    them (before parallelize_module) would step them and never the model (measured before
    this check: the losses equalled the untrained model's to 4 digits). Mark them, and refuse
    such an optimizer's step()."""
    for name, p in before.items():
        if id(p) not in live:
            p._distlab_replaced = name
    if not _RETIRED_HOOK:
        _RETIRED_HOOK.append(register_optimizer_step_pre_hook(_refuse_retired))


def _refuse_retired(optimizer, args, kwargs):
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = getattr(p, "_distlab_replaced", None)
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() over a parameter (shape "
                    f"{tuple(p.shape)}) named {name!r}, which distlab.parallelize_module "
                    "replaced by its tensor-parallel shard: this optimizer was built before "
                    "parallelize_module and would never update the model. Build the optimizer "
                    "after parallelize_module, over model.parameters()")


def _describe(style) -> str:
    """A style as every rank can compare it: its class and settings (no object address)."""
    settings = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(style).items()))
    return f"{type(style).__name__}({settings})"


def _match(module, plan) -> list[tuple[str, object]]:
    """(module name, style) for every plan entry, patterns expanded; each module once."""
    names = [n for n, _ in module.named_modules() if n]
    out, owner = [], {}
    for pattern, style in plan.items():
        style = _from_string(pattern, style)
        if not hasattr(style, "apply"):
            raise TypeError(f"plan[{pattern!r}] is a {type(style).__name__}, not a distlab style: "
                            f"use distlab.ColwiseParallel(), RowwiseParallel(), "
                            f"SequenceParallel() or PrepareModuleInput(...)")
        hits = [n for n in names if name_matches(n, pattern)]
        if not hits:
            raise ValueError(f"plan entry {pattern!r} matches no module of this "
                             f"{type(module).__name__}; its names look like "
                             f"{', '.join(names[:6])}{', ...' if len(names) > 6 else ''}")
        for n in hits:
            if n in owner:
                raise ValueError(f"module '{n}' matches plan entries {owner[n]!r} and "
                                 f"{pattern!r}: give each module one style")
            owner[n] = pattern
            out.append((n, style))
    return out


def full_state_dict(module: nn.Module, sd: dict | None = None) -> dict:
    """A tensor-parallel module's whole weights under its original names: the sharded layers'
    blocks all-gathered from the group (a collective: every rank calls it). sd: the module's
    tp-local state dict when another wrapper has gathered it already (a mesh's per-parameter
    fully_shard), else module.state_dict()."""
    state = getattr(module, "_distlab_tp", None)
    sd = dict(module.state_dict() if sd is None else sd)
    if state is None:
        return sd
    for name, style in state.sharded.items():
        try:
            m = module.get_submodule(name)
        except AttributeError:  # a pipeline stage that does not hold this layer (3d)
            continue
        for pname, p in m.named_parameters():
            if style == "rowwise" and pname == "bias":
                continue  # replicated
            # the state dict's value, not p: under ZeRO-3 (the mesh) p's storage is freed
            # between steps and module.state_dict() has gathered it
            block = sd.get(f"{name}.{pname}", p).detach()
            whole = _gather_block(state.comm, block, 0 if style == "colwise" else -1)
            if name in state.fused:  # rank-major [q_0 k_0 v_0 | q_1 ...] back to [q | k | v]
                order = torch.cat([fused_rows(state.fused[name], r, state.comm.world)
                                   for r in range(state.comm.world)])
                whole = torch.empty_like(whole).index_copy_(0, order.to(whole.device), whole)
            if name in state.transposed and pname == "weight":
                whole = whole.t().contiguous()  # back to Conv1D's (in, out)
            sd[f"{name}.{pname}"] = whole
    return sd


def local_block(module: nn.Module, name: str, whole: torch.Tensor) -> torch.Tensor:
    """This rank's block of `whole`, the tensor `single` names `name` (a weight, a bias, or
    optimizer state shaped like one): full_state_dict's gather undone. Replicated tensors come
    back whole."""
    state = getattr(module, "_distlab_tp", None)
    layer, _, pname = name.rpartition(".")
    style = state.sharded.get(layer) if state is not None else None
    if style is None or (style == "rowwise" and pname == "bias"):
        return whole
    if layer in state.transposed and pname == "weight":
        whole = whole.t()  # Conv1D's (in, out) to the (out, in) the blocks are cut from
    if layer in state.fused:  # [q | k | v] to rank-major [q_0 k_0 v_0 | q_1 ...]
        order = torch.cat([fused_rows(state.fused[layer], r, state.comm.world)
                           for r in range(state.comm.world)])
        whole = whole.index_select(0, order.to(whole.device))
    dim = 0 if style == "colwise" else -1
    return whole.chunk(state.comm.world, dim)[state.comm.rank].contiguous()


def _gather_block(comm, x, dim):
    x = x.contiguous()
    out = torch.empty(comm.world * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x.view(-1))
    return torch.cat(list(out.view(comm.world, *x.shape)), dim=dim)
