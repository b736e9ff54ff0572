"""ZeRO-3 for any module: `distlab.fully_shard`, named and called like torch's FSDP2.

Rajbhandari et al. 2020 (P_os+g+p) and Zhao et al. 2023 ("PyTorch FSDP"): every rank keeps
1/N of each unit's parameters, gradients and optimizer state; a unit's full parameters exist
only while its forward or backward runs.

    distlab.fully_shard(model, units=(Block,))            # in place; returns model
    opt = distlab.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss_fn(model(x), y).backward()                        # each rank on its rows
    opt.step(); opt.zero_grad()

**Units.** `units` picks the modules gathered one at a time: module types (every outermost
submodule of one of them) or qualified names (an item may be a list of names: one unit of
several modules). Parameters in no unit, the root module's own among them, form the root unit,
gathered for the whole forward and backward (FSDP2 does not reshard its root either). Default:
distlab.parallel.zero.stages's find_units (each ModuleList item, the other top-level children
grouped between them): the zero3 strategy's cut. A unit is flattened into one padded buffer
per dtype (distlab.parallel.zero.optimizer's Unit: fp64 next to fp32 makes two).

**Forward and backward.** A unit's forward pre-hook waits for its all-gather and starts the
next unit's (prefetch; `prefetch` units ahead, 1 as FSDP2); the next unit's start frees it
(reshard_after_forward; False keeps it until its gradients are in). Hooks on its outputs'
gradients gather it again for backward and prefetch the unit before it; when its last
gradient arrives its parameters are freed and its reduce-scatter starts (the gradient path
is distlab.parallel.zero.optimizer's ShardedGradients, the one every ZeRO stage uses).
Between steps, `prefetch_forward` starts the next forward's first gathers (the zero3
strategy calls it; FSDP2 leaves it to its user, as module.unshard(async_op=True)).

**Mixed precision** (MixedPrecisionPolicy, as FSDP2's): the shards stay in the parameters'
dtype (fp32: the masters the optimizer steps); each all-gather sends the shard cast to
param_dtype, so bf16 moves half the bytes, and the parameters the model computes with are
param_dtype (floating inputs of the root and each unit are cast to it, as FSDP2's
cast_forward_inputs). Gradients are reduce-scattered in reduce_dtype (default param_dtype),
then added to the shard's fp32 gradient.

**FP8 all-gather** (`fp8_weights=True`, torchao's enable_fsdp_float8_all_gather): the weights
of the Linears that compute in FP8 (distlab.rank.fp8_linear marks them) form units of their own
(`<unit>.fp8`, under every policy, so runs compare like for like; their gathers are booked as
"all_gather.fp8_linears"). With fp8_weights each such unit's shard travels as e4m3 bytes, one
scale per parameter: its amax over every rank's piece (an all-gather of one float per
parameter, "fp8.amax"), so the scale is the one the Linear's tensorwise cast takes from the
whole weight, and the bytes each rank casts are those the Linear would cast. The gathered
bytes are read back into the full (fp32) buffer the forward uses; the Linear's own cast then
lands on the same FP8 values. One byte per weight on the wire instead of bf16's two.

**The optimizer**, built after fully_shard over `model.parameters()`: distlab.ZeroOptimizer,
or any elementwise torch optimizer (torch.optim.AdamW, SGD, ...: distlab.parallel.zero.bound
binds it to the units' shards at construction). Either steps the shards; an optimizer built
before fully_shard raises at step() (optimizer.py's guard rail): its parameters' .grad is None
(gradients live in the shards), so it would move nothing. `grad_shard(p)` is this rank's piece
of p's mean gradient (a view of the unit's gradient shard), `full_grad(p)` the whole of it.

**HSDP** (hybrid sharding; Zhao et al. 2023, Section 3.2.2): fully_shard over each node's ranks
(comm = the node's group) and, between backward and the optimizer's step,
`replicate_gradients(model, across)`: each gradient shard averaged over the ranks holding the same
shard on the other nodes (across = distlab.parallel.data_parallel.hierarchical's inter group).
The all-gathers and reduce-scatters then stay inside a node; only the shards' all-reduce crosses.

**State dict.** `model.state_dict()` (every rank calls it) all-gathers each unit's shards:
full tensors in the shards' dtype (fp32 under a bf16 policy), as FSDP2's full state dict.

**Layout.** All of the above is the flat layout (`layout="flat"`, the default: FSDP1's
FlatParameter). `layout="per_param"` keeps this scheduling and shards each parameter on dim 0
as a DTensor instead, as FSDP2 does (distlab.parallel.zero.per_param: p.grad is the shard,
freezing is per parameter, the state dict is the shards; it pays a copy in and out of each
all-gather and reduce-scatter buffer).
"""

from __future__ import annotations

import functools
import time
import types
from dataclasses import dataclass

import torch
import torch.nn as nn

from distlab import fp8
from distlab.comm import Comm
from distlab.modules import tensors_in
from distlab.non_finite import detect_nan as nan_detector
from distlab.parallel.agree import agree, buffer_layout, parameter_layout
from distlab.parallel.data_parallel.allreduce import broadcast_buffers
from distlab.parallel.data_parallel.syncbn import attach_comm
from distlab.parallel.zero import bound
from distlab.parallel.zero.optimizer import ShardedGradients, Unit, claim
from distlab.step_ledger import StepCounter


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """param_dtype: what the all-gather sends and the forward and backward compute in (None:
    the parameters' own). reduce_dtype: what gradients are reduce-scattered in (None:
    param_dtype). The shards, their gradients and the optimizer stay in the parameters'
    dtype."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    fp8_weights: bool = False  # the FP8 Linears' weights all-gathered in e4m3 (docstring)


# fully_shard's layouts -> the class of the state that shards a module so: FullyShard for
# "flat" (below); distlab.parallel.zero.per_param adds "per_param" (its class builds on
# FullyShard, so this module cannot import it; the package's __init__ imports it)
LAYOUTS: dict[str, type] = {}


def fully_shard(module: nn.Module, *, units=None, mp_policy: MixedPrecisionPolicy | None = None,
                group=None, reshard_after_forward: bool = True, offload: bool = False,
                prefetch: int = 1, comm: Comm | None = None, layout: str = "flat",
                ignored_params=None, detect_nan: bool = False) -> nn.Module:
    """Shard `module`'s trainable parameters over the ranks of `group` (ZeRO-3), in place;
    returns `module`. Then build distlab.ZeroOptimizer(module.parameters(), ...).

    units                  module types (a tuple of classes) or qualified names (a list; an
                           item may be a list of names, one unit; a ModuleList or ModuleDict
                           stands for its items); None: find_units' cut (the repeated blocks
                           at any depth). The parameters in no unit are the root unit
    mp_policy              MixedPrecisionPolicy(param_dtype, reduce_dtype); None: no casts
    group                  a torch.distributed process group (default: the whole world)
    reshard_after_forward  free each unit after its forward (and gather it again for
                           backward); False keeps it gathered until its gradients are in
    offload                the master shards and their optimizer state on the CPU (on a CPU
                           run, nothing moves)
    prefetch               units ahead of the running one whose all-gather is started (1, as
                           FSDP2; 0: each unit gathered when needed). Each one more keeps one
                           more unit's full parameters alive
    comm                   a distlab.comm.Comm to communicate (and book bytes) through
    layout                 "flat": each unit one padded flat buffer (FSDP1's FlatParameter);
                           "per_param": each parameter a DTensor sharded on dim 0, as FSDP2's
                           (distlab.parallel.zero.per_param: build a torch optimizer over
                           model.parameters(); ZeroOptimizer steps flat units only)
    ignored_params         parameters left alone (torch's name): not sharded, not broadcast,
                           not gathered; their gradients and their optimizer are the caller's
                           (the mesh's experts, held differently by each rank of an ep group)
    detect_nan             raise at the first inf/NaN in the forward or a module's backward,
                           naming this rank, the step (fully_shard's training forwards) and the
                           module (distlab.non_finite); off by default, as FSDP2 has none

    Call it after moving the module to its device and dtype, and change no parameter after it:
    every rank starts from rank 0's values (parameters, frozen ones and buffers broadcast).
    """
    _refuse_sharded(module)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {tuple(LAYOUTS)}")
    if layout == "per_param" and (offload or (mp_policy and mp_policy.fp8_weights)):
        raise ValueError(f"{'offload' if offload else 'fp8_weights'}=True with "
                         "layout='per_param': written for the flat units only; use "
                         "layout='flat'")
    if not (isinstance(prefetch, int) and prefetch >= 0):
        raise ValueError(f"prefetch={prefetch!r} must be an integer >= 0 (units gathered ahead "
                         "of need; 0: none)")
    ignored = frozenset(id(p) for p in ignored_params or ())
    if ignored and layout != "flat":
        raise ValueError(f"ignored_params with layout={layout!r}: written for the flat layout "
                         "only; use layout='flat'")
    comm = comm if comm is not None else Comm(group)
    specs, policy = unit_specs(module, units), mp_policy or MixedPrecisionPolicy()
    kept = [row for row, p in zip(parameter_layout(module), module.parameters())
            if id(p) not in ignored]  # ignored ones may differ between the ranks
    agree(comm, "distlab.fully_shard",  # before the first broadcast
          {"parameters": kept, "buffers": buffer_layout(module),
           "units": [name for name, _ in specs], "mp_policy": repr(policy),
           "reshard_after_forward": reshard_after_forward, "offload": offload,
           "prefetch": prefetch, "layout": layout})
    LAYOUTS[layout](module, specs, policy, comm, reshard_after_forward, offload, prefetch,
                    **({"ignored": ignored} if ignored else {}))  # per_param takes none
    if detect_nan:  # hooked after the units' own, so each forward's step is already counted
        state = module._distlab_fsdp
        nan_detector(module, step_of=lambda: state._steps.step)
    return module


def grad_shard(param: nn.Parameter) -> torch.Tensor:
    """This rank's piece of `param`'s mean gradient: a 1-D view of its unit's gradient shard
    (fp32 under a bf16 policy), the entries [lo, hi) of param's flattened gradient that fall in
    this rank's shard (maybe none). Concatenated in rank order, every rank's pieces are the
    whole flattened gradient. It first finishes the reduce-scatters (a collective the first
    time after a backward: every rank calls it). Valid until zero_grad(). layout="per_param":
    the local rows of param.grad, flattened (a dim-0 shard is such a range)."""
    if getattr(param, "_distlab_per_param", None) is not None:
        return param._distlab_per_param.grad_shard(param)
    state, u, i = _reduced(param, "grad_shard")
    return u.shard_piece(u.grad_shard, i, state.rank)


def full_grad(param: nn.Parameter) -> torch.Tensor:
    """`param`'s whole mean gradient, shaped like it, on every rank (FSDP2's
    p.grad.full_tensor()): its unit's gradient shards all-gathered. A collective: every rank
    calls it. A copy: changing it changes nothing."""
    if getattr(param, "_distlab_per_param", None) is not None:
        return param._distlab_per_param.full_grad(param)
    state, u, i = _reduced(param, "full_grad")
    whole = u.grad_shard.new_empty(u.padded)
    state.comm.all_gather(whole, u.grad_shard)
    return u.piece(whole, i).view(param.shape).clone()


def replicate_gradients(module: nn.Module, across: Comm) -> None:
    """HSDP: average every unit's gradient shard over `across`, the ranks on the other nodes
    that hold the same shard (one all-reduce per unit, 2(n-1)/n of the shard per rank). The
    shards were each node's mean; equal rows per node make this the global batch's mean. Every
    rank calls it after backward, before the optimizer's step (which then has nothing to
    reduce)."""
    state = _flat_state(module, "replicate_gradients")
    state.reduce_gradients()  # each node's reduce-scatters first
    for u in state.units:
        across.all_reduce(u.grad_shard, op="avg")


def shard_bytes(module: nn.Module) -> int:
    """Bytes of this rank's gradient shards (each unit's padded shard): what HSDP's
    replicate_gradients all-reduces per step."""
    return sum(u.grad_shard.numel() * u.grad_shard.element_size()
               for u in _flat_state(module, "shard_bytes").units)


def _flat_state(module: nn.Module, caller: str):
    state = _state(module, caller)
    if state.layout != "flat":
        raise ValueError(f"{caller} is written for fully_shard's flat units; this module was "
                         f"sharded with layout={state.layout!r}")
    return state


def _state(module: nn.Module, caller: str):
    if getattr(module, "_distlab_fsdp", None) is not None:
        return module._distlab_fsdp
    state = next((p._distlab_fsdp for p in module.parameters()
                  if getattr(p, "_distlab_fsdp", None) is not None), None)
    if state is None:
        raise ValueError(f"{caller}: the module is not sharded by distlab.fully_shard")
    return state


def _reduced(param: nn.Parameter, caller: str):
    """param's FullyShard state, unit and index in it, its gradients reduced (a collective)."""
    state = getattr(param, "_distlab_fsdp", None)
    if state is None:
        raise ValueError(f"{caller}: this parameter is not sharded by distlab.fully_shard "
                         "(its gradient is .grad)")
    state.reduce_gradients()
    u, i = state.place[id(param)]
    return state, u, i


# -- the units' cut ----------------------------------------------------------------------------
def find_units(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The model cut into units gathered one at a time, the repeated blocks wherever they sit:

    * every item of a ModuleList or ModuleDict of blocks, at any depth, is a unit
      ("blocks.3", nanoGPT's "transformer.h.3", torchtitan's "layers.3");
    * a container that is never called, a ModuleDict of different modules (nanoGPT's
      `transformer`), or a module that holds blocks deeper down (HF's `transformer`), is
      looked into, not made a unit (its pre-forward hook would never fire, or would gather
      every block at once);
    * the other modules that hold parameters are grouped with their neighbours up to the
      next block ("tok_emb+pos_emb", "ln_f+head"), and groups that share a parameter (an
      output head tied to the embedding) are one unit, so no unit frees a weight another
      still needs."""
    cut: list = []  # in forward order: ("block", name, module) or ("leaf", name, module)

    def visit(prefix: str, m: nn.Module):
        for name, child in m.named_children():
            path = prefix + name
            if _holds_blocks(child):
                cut.extend(("block", f"{path}.{k}", b) for k, b in child.named_children()
                           if any(True for _ in b.parameters()))
            elif isinstance(child, nn.ModuleDict) or _has_blocks_inside(child):
                visit(path + ".", child)
            elif any(True for _ in child.parameters()):
                cut.append(("leaf", path, child))

    visit("", model)
    units, group = [], []
    for kind, name, m in cut + [("block", None, None)]:
        if kind == "leaf":
            group.append((name, m))
            continue
        if group:
            units.append(("+".join(n for n, _ in group), [m for _, m in group]))
            group = []
        if name is not None:
            units.append((name, [m]))
    return _merge_tied(units)


def _holds_blocks(m: nn.Module) -> bool:
    """A ModuleList, or a ModuleDict whose items are all of one type: repeated blocks."""
    if isinstance(m, nn.ModuleList):
        return True
    items = list(m.children())
    return isinstance(m, nn.ModuleDict) and len(items) > 1 and len({type(i) for i in items}) == 1


def _has_blocks_inside(m: nn.Module) -> bool:
    return any(_holds_blocks(sub) for sub in m.modules() if sub is not m)


def _merge_tied(units: list) -> list:
    """Join the non-block units that share a parameter (tied weights) into the first of them."""
    owner: dict = {}  # id(param) -> index of the first unit that uses it
    merged: list = []
    for name, modules in units:
        ids = {id(p) for m in modules for p in m.parameters()}
        into = next((owner[i] for i in ids if i in owner), None)
        if into is None:
            merged.append((name, list(modules)))
            into = len(merged) - 1
        else:
            first, mods = merged[into]
            merged[into] = (f"{first}+{name}", mods + list(modules))
        for i in ids:
            owner.setdefault(i, into)
    return merged


def unit_specs(model: nn.Module, units) -> list[tuple[str, list[nn.Module]]]:
    """fully_shard's `units` as (name, modules) pairs, checked not to nest."""
    if units is None:
        specs = find_units(model)
    elif isinstance(units, type) or (isinstance(units, tuple)
                                     and all(isinstance(t, type) for t in units)):
        specs = _outermost(model, units)
    else:
        specs = [spec for item in units for spec in _named(model, item)]
    inside: dict = {}  # every module within a unit -> that unit's name
    for name, modules in specs:
        for m in modules:
            for sub in m.modules():
                if id(sub) in inside:
                    raise ValueError(f"units {inside[id(sub)]!r} and {name!r} overlap (one "
                                     "holds the other, or a module is named twice): choose "
                                     "units that do not contain each other")
                inside[id(sub)] = name
    return specs


def _outermost(model: nn.Module, types_) -> list:
    found = []

    def visit(prefix: str, m: nn.Module):
        for name, child in m.named_children():
            if isinstance(child, types_):
                found.append((prefix + name, [child]))
            else:
                visit(prefix + name + ".", child)

    visit("", model)
    return found


def _named(model: nn.Module, item) -> list[tuple]:
    """A `units` item as (name, modules) specs. A ModuleList or ModuleDict named alone is never
    called, so hooks on it would never gather: it stands for one unit per item."""
    names = [item] if isinstance(item, str) else list(item)
    try:
        modules = [model.get_submodule(n) for n in names]
    except AttributeError as e:
        raise ValueError(f"units: {e} (qualified names, as model.named_modules() gives them)")
    if len(modules) == 1 and isinstance(modules[0], (nn.ModuleList, nn.ModuleDict)):
        return [(f"{names[0]}.{k}", [m]) for k, m in modules[0].named_children()]
    if any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in modules):
        raise ValueError(f"units: {item!r} holds a ModuleList or ModuleDict, which is never "
                         "called, so the unit would never be gathered: name the modules inside")
    return [("+".join(names), modules)]


def _refuse_sharded(module: nn.Module) -> None:
    if getattr(module, "_distlab_fsdp", None) is not None:
        raise ValueError("this module is already sharded by distlab.fully_shard: call it once "
                         "(keep using the module it returned)")
    for name, p in module.named_parameters():
        if getattr(p, "_distlab_fsdp", None) or getattr(p, "_distlab_per_param", None):
            raise ValueError(f"parameter {name} is already sharded by an earlier fully_shard "
                             "(on a submodule?): call fully_shard once, on the root module, and "
                             "choose the units with units=(Block,) or units=['blocks.0', ...] "
                             "(FSDP2's habit of one call per block, then the root, is one call "
                             "here)")
        if getattr(p, "_distlab_zero", None):
            raise ValueError(f"parameter {name} is already sharded by {p._distlab_zero[0]}: "
                             "call fully_shard first, then build distlab.ZeroOptimizer over "
                             "model.parameters()")


def _cast(x, dtype):
    """Floating tensors in x (nested tuples, lists, dicts) cast to dtype."""
    if torch.is_tensor(x):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x


def _in_backward() -> bool:
    """True inside autograd's backward (e.g. a checkpointed block recomputing its forward)."""
    return torch._C._current_graph_task_id() != -1


def _refuse_apply(self, fn, recurse=True):
    raise RuntimeError("this module's parameters are sharded by distlab.fully_shard (views of "
                       "buffers freed outside forward and backward): .to(), .double(), .cuda() "
                       "and the like cannot change them now. Move or cast the module first, "
                       "then call fully_shard")


def _refuse_load(module, *args):
    raise RuntimeError("load_state_dict on a module distlab.fully_shard sharded: its parameters "
                       "are views of freed buffers, not loaded in place here. Load the state "
                       "dict before calling fully_shard")


# -- the state fully_shard leaves on the module ------------------------------------------------
class FullyShard(ShardedGradients):
    """ZeRO-3 on one module (see the module docstring): its units, the gathers around their
    forward and backward, and ShardedGradients' gradient path. module._distlab_fsdp."""
    layout = "flat"

    def __init__(self, module: nn.Module, specs: list, policy: MixedPrecisionPolicy,
                 comm: Comm, reshard_after_forward: bool, offload: bool, prefetch: int = 1,
                 ignored: frozenset = frozenset()):
        super().__init__(3, comm)
        self.module, self.policy, self.reshard = module, policy, reshard_after_forward
        self.ignored = ignored  # ids of parameters left to the caller (_shards)
        self.prefetch = prefetch  # units ahead whose all-gather starts before they run
        self.optimizer = None  # the ZeroOptimizer stepping the shards, once built
        self._steps = StepCounter("fully_shard")  # training forwards; a failing collective says
        self.chain: list[list[Unit]] = []  # each spec's units (one per dtype), in spec order
        self.root: list[Unit] = []  # parameters in no unit: gathered all forward and backward
        self.place: dict = {}  # id(param) -> (unit, index in it)
        self._current: int | None = None  # the chain entry whose forward is running
        self._order: list[int] = []  # chain entries in the order the first forward used them
        self._order_done = False
        self.gathers: list[dict] = []  # all-gathers since step_info's last reset
        self.live = {"params": 0}  # bytes of gathered parameters alive now, and their peak
        self.peak = {"params": 0}
        cut = self._assign(specs)
        self._claim([p for _, _, ps in cut for p in ps])
        for name, modules, params in cut:
            units = self._flatten(name, modules, params, offload)
            (self.root.extend if not modules else self.chain.append)(units)
        self._replicate_rest(module)
        self._install_hooks(module, specs)
        self._layout = self._param_layout()
        module._distlab_fsdp = self

    # -- setup -------------------------------------------------------------------------------
    def _shards(self, p: nn.Parameter) -> bool:
        """Whether p goes into a unit: the trainable ones (frozen ones are replicated), unless
        ignored."""
        return p.requires_grad and id(p) not in self.ignored

    def _claim(self, params: list) -> None:
        """Mark the sharded parameters: no other optimizer steps them (optimizer.py's guard
        rail), and torch optimizers built from now on step the shards (bound.py)."""
        claim(params, "distlab.fully_shard (ZeRO-3)",
              "Build the optimizer after fully_shard (torch.optim.AdamW(model.parameters(), "
              "lr=...) or distlab.ZeroOptimizer(model.parameters(), torch.optim.AdamW, "
              "lr=...)): it then steps the shards.", grads=self)
        bound.install()

    def _assign(self, specs: list) -> list:
        """Each trainable parameter's unit, (name, modules, params) in spec order, the root
        last; a parameter two units use (tied weights across units) is refused."""
        owner = {id(sub): k for k, (_, ms) in enumerate(specs) for m in ms for sub in m.modules()}
        users: dict = {}  # id(param) -> (its first name, the units whose modules use it)
        for mname, sub in self.module.named_modules():
            for pname, p in sub.named_parameters(recurse=False):
                if self._shards(p):
                    entry = users.setdefault(id(p), (f"{mname}.{pname}".lstrip("."), set()))
                    entry[1].add(owner.get(id(sub), -1))
        names = [n for n, _ in specs] + ["root (the parameters in no unit)"]
        for pname, ks in users.values():
            if len(ks) > 1:
                raise ValueError(f"parameter {pname} is used by units "
                                 f"{', '.join(repr(names[k]) for k in sorted(ks))} (tied "
                                 "weights?): a unit's parameters are freed when the next one "
                                 "runs, so put the modules sharing it in one unit")
        cut = []
        for k, (name, modules) in enumerate(specs):
            seen: dict = {}
            for m in modules:
                for p in m.parameters():
                    if self._shards(p):
                        seen.setdefault(id(p), p)
            cut.append((name, modules, list(seen.values())))
        rest = [p for p in self.module.parameters() if self._shards(p) and -1 in
                users[id(p)][1]]
        cut.append(("root", [], rest))
        return [c for c in cut if c[2]]

    def _flatten(self, name: str, modules: list, params: list, offload: bool) -> list[Unit]:
        """One unit per dtype; its shard is its own copy and its full buffer freed."""
        kinds: dict = {}
        for p in params:  # an FP8 Linear's weight apart: it may travel in FP8 (docstring)
            kinds.setdefault((p.dtype, p.device, _fp8_weight(p)), []).append(p)
        units, dtypes = [], {k[0] for k in kinds}
        for (dtype, device, fp8_weight), ps in kinds.items():
            uname = name if len(dtypes) == 1 else f"{name}.{str(dtype).removeprefix('torch.')}"
            uname += ".fp8" if fp8_weight else ""
            u = self.add_unit(uname, ps, master_on_cpu=offload and device.type != "cpu")
            u.modules, u.fp8 = list(modules), fp8_weight
            for p in ps if fp8_weight and self.policy.fp8_weights else ():
                p._distlab_fp8_gathered = True  # the Linear takes it as cast (fp8_linear)
            self._cast_full(u)
            u.grad_dtype = self.policy.reduce_dtype or self.policy.param_dtype
            u.full.untyped_storage().resize_(0)  # from now on parameters exist only while used
            u.live = False
            for i, p in enumerate(ps):
                self.place[id(p)] = (u, i)
                p._distlab_fsdp = self  # ZeroOptimizer steps this unit's shard for it
            units.append(u)
        return units

    def _cast_full(self, u: Unit) -> None:
        """Under a param_dtype policy the gathered buffer (and so each parameter) is that dtype;
        the shard keeps the parameters' own."""
        dtype = self.policy.param_dtype
        if dtype is None or dtype == u.full.dtype or not u.full.is_floating_point():
            return
        u.full = torch.empty(u.padded, dtype=dtype, device=u.full.device)
        for i, p in enumerate(u.params):
            p.data = u.piece(u.full, i).view_as(p)

    def _replicate_rest(self, module: nn.Module) -> None:
        """What is not sharded is rank 0's on every rank: frozen parameters, buffers."""
        with torch.no_grad():
            self.comm.broadcast_tensors([p.data for p in module.parameters()
                                         if not p.requires_grad], src=0)
        broadcast_buffers(self.comm, module, 0)
        attach_comm(module, self.comm)  # distlab's SyncBatchNorm shares statistics over these

    def _install_hooks(self, module: nn.Module, specs: list) -> None:
        module.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        for k, units in enumerate(self.chain):
            for m in units[0].modules:
                m.register_forward_pre_hook(functools.partial(self._pre_forward, k),
                                            with_kwargs=True)
                m.register_forward_hook(functools.partial(self._post_forward, k))
        module.register_forward_hook(self._after_forward)
        self._install_state_dict_hooks(module)
        for m in module.modules():  # .to()/.double() would touch freed storage
            m._apply = types.MethodType(_refuse_apply, m)

    def _install_state_dict_hooks(self, module: nn.Module) -> None:
        # a function, not a bound method: torch marks the hook with an attribute
        module.register_state_dict_post_hook(functools.partial(FullyShard._full_state_dict, self))
        module.register_load_state_dict_pre_hook(_refuse_load)

    def _param_layout(self) -> list:
        return [(id(p), p.dtype, p.shape, p.device, p.requires_grad)
                for p in self.module.parameters()]

    def adopt(self, optimizer, params: list) -> list[Unit]:
        """The units a ZeroOptimizer's parameter group steps: whole units, one optimizer."""
        if self.optimizer is not None and self.optimizer is not optimizer:
            raise ValueError(f"these parameters already have an optimizer "
                             f"({type(self.optimizer).__name__}): step that one (one optimizer "
                             "per fully_shard model)")
        ids = {id(p) for p in params}
        units = [u for u in self.units if any(id(p) in ids for p in u.params)]
        for u in units:
            if any(id(p) not in ids for p in u.params):
                raise ValueError(f"unit {u.name!r}: a parameter group holds some of its "
                                 "parameters, not all; a unit steps as one flat shard, so a "
                                 "group holds whole units (choose fully_shard's units along "
                                 "your groups)")
        self.optimizer = optimizer
        return units

    # -- gathering and freeing one unit -----------------------------------------------------
    def _track(self, kind: str, nbytes: int):
        self.live[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.live[kind])

    def _prefetch(self, u: Unit, phase: str):
        """Start gathering unit u's full parameters (async), if they are not there already;
        the shard goes out cast to the gathered dtype (param_dtype)."""
        if u.live:
            return
        u.full.untyped_storage().resize_(u.nbytes)
        u.live = True
        self._track("params", u.nbytes)
        kind = "all_gather.fp8_linears" if u.fp8 else "all_gather"
        if u.fp8 and self.policy.fp8_weights:
            u.gather_in, u.fp8_scales = self._fp8_shard(u)
            u.gather = self.comm.all_gather_async(
                torch.empty(u.padded, dtype=torch.uint8, device=u.full.device), u.gather_in,
                kind=kind)
        else:
            u.gather_in = u.shard if u.shard.dtype == u.full.dtype else u.shard.to(u.full.dtype)
            u.gather = self.comm.all_gather_async(u.full, u.gather_in, kind=kind)
        u.gather_record = {"unit": u.name, "phase": phase, "issued": u.gather.issued}
        self.gathers.append(u.gather_record)

    def _fp8_shard(self, u: Unit) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard as e4m3 bytes (uint8, for gloo), each parameter's piece scaled by
        the parameter's scale from its amax over every rank; and those scales."""
        rank, n = self.rank, len(u.params)
        pieces = [u.shard_piece(u.shard, i, rank) for i in range(n)]
        local = torch.stack([p.detach().abs().max().float() if p.numel() else
                             torch.zeros((), device=u.shard.device) for p in pieces])
        every = torch.empty(self.comm.world * n, device=local.device)
        self.comm.all_gather(every, local, kind="fp8.amax")
        amaxes = every.view(self.comm.world, n).amax(0)
        out = torch.zeros(u.shard.numel(), dtype=fp8.E4M3, device=u.shard.device)
        with torch.no_grad():  # the Linear's own cast: distlab.fp8.quantize, tensorwise
            for i, amax in enumerate(amaxes):
                u.shard_piece(out, i, rank).copy_(fp8.quantize(pieces[i], amax=amax)[0])
        return out.view(torch.uint8), fp8.scale_for(amaxes)

    def _gather(self, u: Unit, phase: str):
        """Unit u's full parameters, now: wait for its prefetch, or gather them."""
        needed = time.perf_counter()
        self._prefetch(u, phase)
        if u.gather is not None:
            gathered = u.gather.wait()
            rec = u.gather_record
            rec.update(prefetched=rec["issued"] < needed, blocked_s=u.gather.waited - needed,
                       needed=needed, waited=u.gather.waited)
            if getattr(u, "fp8_scales", None) is not None:  # e4m3 bytes and scales into full
                with torch.no_grad():
                    for i, s in enumerate(u.fp8_scales):
                        u.piece(u.full, i).copy_(
                            fp8.dequantize(u.piece(gathered.view(fp8.E4M3), i), s))
            u.gather = u.gather_in = u.fp8_scales = None

    def _free(self, u: Unit):
        """Drop unit u's full parameters: only its shard stays on this rank."""
        if not u.live:
            return
        if u.gather is not None:
            u.gather.wait()
            u.gather = u.gather_in = u.fp8_scales = None
        u.full.untyped_storage().resize_(0)
        u.live = False
        self._track("params", -u.nbytes)

    def _each(self, k: int | None, fn, phase: str | None = None):
        """fn on chain entry k's units (one per dtype); nothing for None."""
        for u in (self.chain[k] if k is not None else []):
            fn(u) if phase is None else fn(u, phase)

    def _next(self, k: int, step: int) -> int | None:
        """The chain entry forward runs after k (step=+1) or before it (-1): the order the
        first forward recorded, or the spec order while that is still being recorded."""
        order = (self._order if self._order_done and k in self._order
                 else list(range(len(self.chain))))
        i = order.index(k) + step
        return order[i] if 0 <= i < len(order) else None

    def _prefetch_ahead(self, k: int, step: int, phase: str, count: int | None = None):
        """Start the gathers of the `count` (default self.prefetch) chain entries that run
        after k."""
        for _ in range(self.prefetch if count is None else count):
            k = self._next(k, step)
            if k is None:
                return
            self._each(k, self._prefetch, phase)

    def _prefetch_from(self, k: int, step: int, phase: str):
        """Start entry k's gathers and the `prefetch` - 1 entries' after it: the next pass
        starts at k (nothing when prefetch is 0)."""
        if self.prefetch:
            self._each(k, self._prefetch, phase)
            self._prefetch_ahead(k, step, phase, self.prefetch - 1)

    def prefetch_forward(self):
        """After the optimizer step (the shards hold the new values), between steps: start the
        next forward's first gathers (the root's, the first unit's and the `prefetch` - 1
        after it), so they travel while the loop logs the step and fetches the next batch
        instead of while the forward waits. FSDP2 leaves this to its user
        (module.unshard(async_op=True)). Those units stay gathered until that forward."""
        if not self._order_done or not self.prefetch:
            return
        for u in self.root:
            self._prefetch(u, "forward")
        self._prefetch_from(self._order[0], +1, "forward")

    # -- forward and backward hooks ---------------------------------------------------------
    def _cast_inputs(self, args, kwargs):
        dtype = self.policy.param_dtype
        return (args, kwargs) if dtype is None else (_cast(args, dtype), _cast(kwargs, dtype))

    def _before_forward(self, module, args, kwargs):
        if self._param_layout() != self._layout:
            raise RuntimeError(
                "the module's parameters changed after distlab.fully_shard (added, replaced, "
                "frozen, or moved to another dtype/device): its units no longer match them. "
                "Change the module first, then call fully_shard")
        if not _in_backward():
            if torch.is_grad_enabled():
                self._steps.begin()  # a training forward: one step (distlab.step_ledger)
            self._current = None
            for u in self.root:
                self._gather(u, "forward")
        return self._cast_inputs(args, kwargs)

    def _pre_forward(self, k: int, module, args, kwargs):
        if _in_backward():  # a checkpointed unit recomputing its forward
            self._each(k, self._gather, "recompute")
        elif self._current != k:
            if self._current is not None and self.reshard:
                self._each(self._current, self._free)  # its forward is done
            self._current = k
            if not self._order_done and k not in self._order:
                self._order.append(k)
            self._each(k, self._gather, "forward")
            self._prefetch_ahead(k, +1, "forward")
        return self._cast_inputs(args, kwargs)

    def _post_forward(self, k: int, module, args, output):
        if torch.is_grad_enabled():  # backward reaches unit k through its outputs' gradients
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, k))

    def _after_forward(self, module, args, output):
        if _in_backward():
            return
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in(output))
        if self._current is not None and (self.reshard or not grads):
            self._each(self._current, self._free)
        self._current = None
        self._order_done = True
        if not grads:  # no backward follows: nothing stays gathered
            for u in self.units:
                self._free(u)
        elif self._order:
            self._prefetch_from(self._order[-1], -1, "backward")  # backward starts there

    def _pre_backward(self, k: int, grad):
        self._open_backward()
        self._each(k, self._gather, "backward")
        self._prefetch_ahead(k, -1, "backward")

    # -- ShardedGradients' gradient path, freeing as it goes ---------------------------------
    def _open_backward(self):
        if not self._bwd_open:
            bound.forget_zeroed(self)  # a plain torch optimizer's zero_grad() since its step
        super()._open_backward()

    def _unit_backward_done(self, u: Unit):
        self._free(u)  # its last gradient is in: its parameters are not needed
        super()._unit_backward_done(u)

    def _close_backward(self):
        super()._close_backward()
        for u in self.units:  # nothing stays gathered after backward
            self._free(u)

    # -- the full state dict ---------------------------------------------------------------
    def _full_state_dict(self, module, sd: dict, prefix: str, meta) -> None:
        """Full tensors in the shards' dtype: each unit's shards all-gathered (a collective)."""
        names: dict = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(prefix + name)
        for u in self.units:
            whole = u.shard.new_empty(u.padded)
            self.comm.all_gather(whole, u.shard)
            for i, p in enumerate(u.params):
                for key in names.get(id(p), []):
                    if key in sd:
                        sd[key] = u.piece(whole, i).view(p.shape).clone()


LAYOUTS["flat"] = FullyShard


def _fp8_weight(p: nn.Parameter) -> bool:
    """Whether p is the weight of a Linear computing in FP8 (distlab.rank.fp8_linear)."""
    return getattr(p, "_distlab_fp8", False)
