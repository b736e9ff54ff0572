"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti
et al. 2022), written from scratch on distlab.comm so every byte is counted by kind.

Every rank holds 1/t of each attention and MLP matrix and sees the WHOLE batch (dp_degree is 1:
`batch` returns the global batch on every rank). A block needs two collectives forward and two
backward, made by the paper's conjugate operators:

    f : identity forward, all-reduce backward      (enters a tensor-parallel region)
    g : all-reduce forward, identity backward      (leaves it)

With sequence parallelism (sp=True) the LayerNorms run on 1/t of the sequence, and f/g become

    g_sp (gather):         all-gather along T forward, reduce-scatter backward   (enters)
    g_sp_bar (scatter):    reduce-scatter along T forward, all-gather backward   (leaves)

An all-reduce is a reduce-scatter followed by an all-gather, so SP moves the same bytes and
stores 1/t of the LayerNorm activations.

Replicated modules (embeddings, LayerNorms, head) see identical inputs on every rank without SP,
so their gradients are identical on every rank and need no communication. With SP a LayerNorm
(and the bias of a row-parallel layer, added after the reduce-scatter) sees only this rank's
part of the sequence: its gradient is a partial sum, all-reduced when backward finishes
(`_PartialGrads`, autograd's final callback).

It is written once, for any module: `parallelize_module(module, plan)` with the styles
ColwiseParallel, RowwiseParallel, SequenceParallel and PrepareModuleInput (torch's names),
exported from distlab. The `tp` strategy applies it with the GPT's plan (`plan_table` as data,
`gpt_plan` as styles, `tp_plan` with shapes): the model knows nothing about parallelism; the
plan replaces modules from outside by name.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

from distlab.comm import Comm
from distlab.modules import name_matches
from distlab.parallel.agree import agree, buffer_layout, parameter_layout
from distlab.parallel.base import Strategy
from distlab.parallel.weak_hooks import on_gradient
from distlab.parallel.zero.optimizer import route_torch_clip

KINDS = {"all_reduce": "tp.all_reduce", "all_gather": "sp.all_gather",
         "reduce_scatter": "sp.reduce_scatter", "grads": "sp.grad_all_reduce",
         "norm": "tp.grad_norm"}


# -- collectives along the sequence dimension (dim 1 of (B, T, d)) -----------------------------
def _all_reduce(comm, x):
    x = x.contiguous().clone()
    return comm.all_reduce_async(x, kind=KINDS["all_reduce"]).wait()


def _gather_seq(comm, x):
    """(B, T/t, d) on each rank -> (B, T, d), rank r's block at rows r·T/t."""
    x = x.contiguous()
    out = torch.empty(comm.world * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather_async(out, x.view(-1), kind=KINDS["all_gather"]).wait()
    B, Tl, d = x.shape
    return out.view(comm.world, B, Tl, d).transpose(0, 1).reshape(B, comm.world * Tl, d)


def _check_seq(comm, T):
    if T % comm.world:
        raise ValueError(f"sequence parallel cuts dim 1 into {comm.world} equal blocks; its "
                         f"length {T} is not divisible by {comm.world}: pad the sequence")


def _reduce_scatter_seq(comm, x):
    """(B, T, d) partial sums on each rank -> this rank's (B, T/t, d) block of their sum."""
    B, T, d = x.shape
    t = comm.world
    _check_seq(comm, T)
    blocks = x.reshape(B, t, T // t, d).transpose(0, 1).contiguous().view(-1)
    out = torch.empty(B * (T // t) * d, dtype=x.dtype, device=x.device)
    comm.reduce_scatter_async(out, blocks, kind=KINDS["reduce_scatter"]).wait()
    return out.view(B, T // t, d)


def _slice_seq(comm, x):
    _check_seq(comm, x.shape[1])
    Tl = x.shape[1] // comm.world
    return x[:, comm.rank * Tl:(comm.rank + 1) * Tl].contiguous()


# -- the paper's operators as autograd functions ----------------------------------------------
class F_Copy(torch.autograd.Function):
    """f: identity forward, all-reduce backward (each rank's input gradient is partial)."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(ctx.comm, dy), None


class G_Reduce(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs), identity backward."""
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class GatherSeq(torch.autograd.Function):
    """g_sp: all-gather along the sequence forward, reduce-scatter backward."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_seq(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter_seq(ctx.comm, dy), None


class ReduceScatterSeq(torch.autograd.Function):
    """g_sp_bar: reduce-scatter along the sequence forward, all-gather backward."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_seq(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return _gather_seq(ctx.comm, dy), None


class SplitSeq(torch.autograd.Function):
    """Enter the SP region from a replicated tensor (the embeddings' output): keep this rank's
    block forward; backward all-gathers, so every rank's embedding gradient is the full one."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _slice_seq(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return _gather_seq(ctx.comm, dy), None


class GatherSeqToReplicated(torch.autograd.Function):
    """Leave the SP region for a replicated consumer (the head): all-gather forward; the
    gradient arriving is identical on every rank, so backward keeps this rank's block."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_seq(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return _slice_seq(ctx.comm, dy), None


# -- the layers --------------------------------------------------------------------------------
class _RegionEntry:
    """Where a tensor-parallel region starts: f (replicated input) or g_sp (sequence-sharded
    input) before a column-parallel layer. Layers that read the same input tensor (q, k and v
    read ln1's output) share one application, as in Megatron's attention: their input
    gradients add up locally, then one all-reduce (or reduce-scatter) completes the sum,
    instead of one per layer. Sums are linear, so sharing changes no value, only the count.
    A tensor PrepareModuleInput already passed through g_sp (`prepared`) needs no entry."""

    def __init__(self, comm):
        self.comm = comm
        self._last = None  # (weak ref to the input, operator, output) of the latest entry
        self._prepared: dict[int, weakref.ref] = {}

    def prepare(self, y):
        """y went through g_sp already (PrepareModuleInput): layers reading it take it as is."""
        self._prepared = {k: r for k, r in self._prepared.items() if r() is not None}
        self._prepared[id(y)] = weakref.ref(y)

    def __call__(self, x, op):
        ref = self._prepared.get(id(x))
        if ref is not None and ref() is x:
            return x
        if self._last is not None:
            src, last_op, y = self._last
            if src() is x and last_op is op:
                return y
        y = op.apply(x, self.comm)
        # the input weakly (a new batch is a new tensor); the output strongly, so q, k and v
        # get the same one even when nothing saves it for backward (under no_grad)
        self._last = (weakref.ref(x), op, y)
        return y


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns (output features) across t ranks:

        X (B,T,in)  @  [ A_0 | A_1 | ... | A_t-1 ]  =  [ Y_0 | Y_1 | ... | Y_t-1 ]
                         in x out/t each                 rank r keeps Y_r (B,T,out/t)

    Each rank needs the whole X: the region's entry operator (f, or g_sp when the input is
    sequence-sharded) provides it, shared by the layers reading the same input. Rank r owns
    b_r. Stored like nn.Linear: weight is (out/t, in), rows r·out/t ... (r+1)·out/t.
    For q, k, v the column blocks are whole heads: out/t = (n_head/t)·head_dim.

    A fused projection (parts: the widths of q, k and v side by side in one Linear, as
    Megatron's and GPT-2's) is split part by part: rank r keeps block r of each part, side by
    side ([q_r | k_r | v_r]), so its output splits into its heads of each."""

    def __init__(self, linear: nn.Linear, comm, entry: _RegionEntry, input_layout="replicate",
                 parts: tuple[int, ...] | None = None):
        super().__init__()
        rows = fused_rows(parts or (linear.out_features,), comm.rank, comm.world)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = (nn.Parameter(linear.bias.detach()[rows].clone())
                     if linear.bias is not None else None)
        self.entry, self.input_layout = entry, input_layout

    def forward(self, x):
        op = GatherSeq if self.input_layout == "sequence" else F_Copy
        return F.linear(self.entry(x, op), self.weight, self.bias)


def fused_rows(parts: tuple[int, ...], rank: int, world: int) -> torch.Tensor:
    """The output features rank `rank` keeps of parts side by side: block `rank` of each."""
    rows, start = [], 0
    for width in parts:
        n = width // world
        rows.append(torch.arange(start + rank * n, start + (rank + 1) * n))
        start += width
    return torch.cat(rows)


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows (input features) across t ranks:

                                 [ A_0   ]   in/t x out
        [ X_0 | X_1 | ... ]  @   [ A_1   ]              =  X_0 A_0 + X_1 A_1 + ...  (partial sums)
          rank r has X_r         [ ...   ]
                                 [ A_t-1 ]

    Rank r computes X_r A_r (B,T,out), a partial sum; the region's exit (g: all-reduce, or
    g_sp_bar: reduce-scatter along T when the output is sequence-sharded) sums them; then the
    replicated bias is added once. Stored like nn.Linear: weight is (out, in/t), columns
    r·in/t ... (r+1)·in/t."""

    def __init__(self, linear: nn.Linear, comm, output_layout="replicate", name=""):
        super().__init__()
        n = linear.in_features // comm.world
        cols = slice(comm.rank * n, (comm.rank + 1) * n)
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.comm, self.output_layout, self.name = comm, output_layout, name

    def forward(self, x):
        if x.shape[-1] != self.weight.shape[1]:
            raise RuntimeError(
                f"RowwiseParallel '{self.name}' takes this rank's block of its input features "
                f"({self.weight.shape[1]} of them) and got {x.shape[-1]}: put ColwiseParallel "
                f"on the linear layer that feeds it, whose output is that block")
        exit_op = ReduceScatterSeq if self.output_layout == "sequence" else G_Reduce
        y = exit_op.apply(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias


# -- the public plan styles (named as torch.distributed.tensor.parallel's) -----------------------
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
            lambda mod, args: (self._prepare(args[0], state), *args[1:]))
        return module

    def _prepare(self, x, state):
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


# -- parallelize_module --------------------------------------------------------------------------
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

    def __init__(self, comm):
        self.comm, self.entry = comm, _RegionEntry(comm)
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


def parallelize_module(module: nn.Module, plan: dict, group=None, comm=None) -> nn.Module:
    """Megatron tensor parallelism on any module, over a process group (default: the world).

        model = distlab.parallelize_module(model, {"blocks.*.attn.q": distlab.ColwiseParallel(),
                                                   "blocks.*.attn.o": distlab.RowwiseParallel()})

    plan     module name (fnmatch pattern per dotted part, as torch's parallelize_module takes
             them: "blocks.*.mlp.fc") -> ColwiseParallel(), RowwiseParallel(),
             SequenceParallel() or PrepareModuleInput(...)
    comm     a distlab.comm.Comm to communicate (and book bytes) through instead of one made
             over `group`

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
    state = TensorParallelState(comm if comm is not None else Comm(group))
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


# Hugging Face's tensor-parallel plans (a model's `base_model_tp_plan`) name styles by string;
# the ones with a distlab equivalent, relative to the base model as theirs are.
HF_STYLES = {"colwise": lambda: ColwiseParallel(), "rowwise": lambda: RowwiseParallel(),
             "sequence_parallel": lambda: SequenceParallel()}


def _from_string(pattern: str, style):
    if not isinstance(style, str):
        return style
    if style not in HF_STYLES:
        raise ValueError(f"plan[{pattern!r}] = {style!r}: of Hugging Face's style names distlab "
                         f"takes {', '.join(map(repr, HF_STYLES))}; for the others (gathered, "
                         "replicated or packed outputs) name a distlab style or leave the layer "
                         "out of the plan")
    return HF_STYLES[style]()


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


class _PartialGrads:
    """Sequence parallel: each rank's gradient of these replicated parameters covers only its
    block of the sequence. A hook on each takes the gradient as it arrives (letting zeros
    accumulate), and autograd's final callback all-reduces them all in one flat buffer and
    adds the sums to .grad: complete when backward returns, and correct under accumulation
    (only this backward's part is summed, never what .grad already held)."""

    def __init__(self, comm, params):
        self.comm, self.params = comm, list(params)
        self.arrived: dict[int, torch.Tensor] | None = None
        for p in self.params:  # keyed by id: a pipeline stage may later drop some (params)
            on_gradient(p, self._arrive, id(p))  # weak: a hook holding p would never be freed

    def _arrive(self, key, g):
        if self.arrived is None:
            self.arrived = {}
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self.arrived[key] = g
        return torch.zeros_like(g)

    def _finish(self):
        arrived, self.arrived = self.arrived, None
        # every parameter, in the same order on every rank (zeros where none arrived)
        parts = [arrived.get(id(p), torch.zeros_like(p)).reshape(-1) for p in self.params]
        flat = torch.cat(parts)
        self.comm.all_reduce_async(flat, kind=KINDS["grads"]).wait()
        with torch.no_grad():
            for p, g in zip(self.params, flat.split([p.numel() for p in self.params])):
                g = g.view_as(p)
                p.grad = g.clone() if p.grad is None else p.grad.add_(g)


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


def _gather_block(comm, x, dim):
    x = x.contiguous()
    out = torch.empty(comm.world * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x.view(-1))
    return torch.cat(list(out.view(comm.world, *x.shape)), dim=dim)


# -- the plan: module name -> style ------------------------------------------------------------
def plan_table(n_layer: int, sp: bool = False, experts: bool = False) -> dict:
    """Which module gets which treatment, by name (torchtitan-style). Styles:
    colwise / rowwise: replaced by Column/RowParallelLinear; region: its input passes the
    entry operator (f, or g_sp with sp) once, shared by q, k, v (or fc); sequence: replicated
    weights on a sequence-sharded input (sp only; gradient all-reduced); scatter_seq /
    gather_seq: where the residual stream enters / leaves the SP region. Modules not named
    (tok_emb, pos_emb, and without sp ln1, ln2, ln_f, head) stay replicated. experts: the
    blocks' MLPs are mixtures of experts, which stay whole on every tp rank (Megatron-Core's
    expert tensor parallel size 1): only attention is split."""
    plan = {}
    for i in range(n_layer):
        b = f"blocks.{i}"
        if sp:
            plan[f"{b}.ln1"] = "sequence"
        plan[f"{b}.attn"] = "region"
        plan |= {f"{b}.attn.{n}": "colwise" for n in "qkv"}
        plan[f"{b}.attn.o"] = "rowwise"
        if sp:
            plan[f"{b}.ln2"] = "sequence"
        if experts:
            continue
        plan[f"{b}.mlp"] = "region"
        plan[f"{b}.mlp.fc"] = "colwise"
        plan[f"{b}.mlp.proj"] = "rowwise"
    if sp:
        plan = {"blocks.0": "scatter_seq", **plan, "ln_f": "sequence", "head": "gather_seq"}
    return plan


def tp_plan(model, tp: int, sp: bool = False) -> list:
    """The plan as rows a notebook can show: (module, style, full shape, this rank's shape)."""
    rows = []
    for name, style in plan_table(len(model.blocks), sp).items():
        m = model.get_submodule(name)
        full = tuple(m.weight.shape) if hasattr(m, "weight") and m.weight is not None else None
        local = full
        if style == "colwise":
            local = (full[0] // tp, full[1])
        elif style == "rowwise":
            local = (full[0], full[1] // tp)
        rows.append((name, style, full, local))
    return rows


def gpt_plan(n_layer: int, sp: bool = False, experts: bool = False) -> dict:
    """plan_table as parallelize_module's plan. Without sp "region" rows need no style: the
    column-parallel layers that read one input share their entry f (q, k, v: one all-reduce
    backward); with sp the region's module gathers the sequence (g_sp) for its layers."""
    styles = {"colwise": ColwiseParallel,
              "rowwise": lambda: RowwiseParallel(output_layout="sequence" if sp else "replicate"),
              "sequence": SequenceParallel,
              "region": lambda: PrepareModuleInput("sequence", "replicate"),
              "scatter_seq": lambda: PrepareModuleInput("replicate", "sequence"),
              "gather_seq": lambda: PrepareModuleInput("sequence", "replicate",
                                                       use_local_output=True)}
    return {name: styles[style]() for name, style in plan_table(n_layer, sp, experts).items()
            if sp or style != "region"}


class TensorParallel(Strategy):
    """`tp`: Megatron tensor parallelism over all ranks (tp = world), optional sp: the GPT's
    plan (gpt_plan) applied by parallelize_module; a model of your own brings its plan as its
    attribute `tp_plan` ({module name pattern: style}, what parallelize_module takes)."""
    name = "tp"
    degrees = frozenset({"tp"})
    supports = Strategy.supports | {"sp"}

    @classmethod
    def mesh_preset(cls, cfg):
        return {"tp": cfg.world_size, "zero_stage": 0}

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        self.sp = cfg.sp

    def wrap(self, model):
        # every rank built the same full model from cfg.seed; each keeps its slice of it
        if self.cfg.model == "gpt":
            # a mixture of experts in the blocks (the model's own config says): attention only
            plan = gpt_plan(len(model.blocks), self.sp, experts=bool(model.config.n_experts))
            model = parallelize_module(model, plan, comm=self.comm)
        else:  # yours: its own plan (checked before spawn by distlab.models.factory.check)
            model = parallelize_module(model, model.tp_plan, comm=self.comm)
        self.sharded = dict(model._distlab_tp.sharded)
        return model

    def after_model_split(self, model) -> None:
        """Forget the split modules a pipeline stage no longer holds (3d, mesh), and, with sp,
        the other stages' partial-sum parameters: each backward all-reduces only this
        stage's (it summed zeros for the rest: 832 floats a micro-batch where a stage of the
        4-layer, 32-wide GPT holds 384)."""
        def present(name):
            try:
                model.get_submodule(name)
                return True
            except AttributeError:
                return False
        self.sharded = {n: s for n, s in self.sharded.items() if present(n)}
        partial = getattr(getattr(model, "_distlab_tp", None), "partial_grads", None)
        if partial is not None:
            kept = {id(p) for p in model.parameters()}
            partial.params = [p for p in partial.params if id(p) in kept]

    def batch(self, data, step: int):
        # dp_degree is 1: every tensor-parallel rank computes on the whole global batch
        return data.global_batch(step, self.cfg.global_batch)

    def clip_gradients(self, model, max_norm: float) -> float:
        """Global norm: squares of the sharded gradients summed across ranks, the replicated
        ones (identical on every rank once backward returned) counted once."""
        sharded = sharded_ids(model, self.sharded)
        return float(clip_by_global_norm(self.comm, list(model.parameters()), sharded, max_norm))

    def full_state_dict(self, model) -> dict:
        """The unsharded weights under the names `single` uses (a collective: every rank)."""
        return full_state_dict(model)
