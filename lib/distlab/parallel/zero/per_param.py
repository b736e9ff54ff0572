"""fully_shard(model, layout="per_param"): FSDP2's per-parameter sharding beside the flat units.

Zhao et al. 2023 ("PyTorch FSDP") flattened each unit into one FlatParameter, as the ZeRO paper
did and as distlab.parallel.zero.fsdp's flat units do: a parameter's entries can straddle two
ranks' shards, so no rank's piece is a tensor of its own, and freezing, casting or saving one
parameter means cutting it back out of a flat buffer. FSDP2 (torchtitan's docs/fsdp.md says
why) shards each parameter on dim 0 instead, as a DTensor:

    parameter (d0 rows)   |  rows 0..c-1  |  rows c..2c-1  | ... | last rows, pad |
                              rank 0          rank 1               rank N-1
                          c = ceil(d0 / N): each rank holds c rows; the last chunks may be
                          short or empty, and are padded with zero rows on the wire

so `model.parameters()` are DTensors with placement Shard(0), `p.grad` after backward is this
rank's rows of the mean gradient (a DTensor too), a torch optimizer built over
`model.parameters()` steps the shards directly (tested: SGD and AdamW), `requires_grad_(False)`
on one parameter freezes it (it is still gathered; it gets no gradient, so the optimizer skips
it), and `model.state_dict()` is each rank's shards as DTensors, with no communication.

**One all-gather per unit** (FSDP2's foreach_all_gather). The unit's parameters are gathered
together, so the collective count equals the flat layout's; what changes is the copying:

    copy-in     each parameter's padded rows, side by side, into this rank's slice of the
                unit's all-gather buffer (cast to param_dtype on the way)
    all-gather  every rank's slice: the buffer holds [rank 0: p1 rows | p2 rows ...]
                [rank 1: p1 rows | p2 rows ...] ..., rank-major
    copy-out    torch.split_with_sizes_copy: each parameter's rows of every rank, into its own
                (padded) storage, which the module then computes with

The flat layout needs neither copy (each parameter is a view of the gathered buffer): that
is what its straddling buys. Backward mirrors it: each gradient's rows are cut into N chunks
and laid rank-major into the reduce-scatter buffer (torch._chunk_cat, FSDP2's copy-in), and the
reduce-scatter's output is cut back into each parameter's rows (copy-out: views in the
parameters' dtype, FSDP2's as_strided). `copy_s` adds up the seconds of the four copies, and of
wrapping each new gradient shard as a DTensor (the price of p.grad being one).

Bytes: the flat layout pads each unit (per dtype) to a multiple of N entries; this one pads
each parameter's dim 0 to a multiple of N rows (distlab.theory.fsdp_layouts has both formulas).

**The parameters.** The model's own parameters stay what forward and backward use (hooks
others put on them, tensor parallelism's among them, keep working); outside a unit's use
each module holds the parameter's DTensor shard instead, and `fully_shard` swaps one for the
other when the unit is gathered and freed (FSDP2's to_unsharded / to_sharded). The scheduling
(prefetch, resharding after forward, gathering again for backward, the order the first
forward recorded) is distlab.parallel.zero.fsdp's FullyShard, shared: only the unit changes.

**Composition with tensor parallelism** (dp x tp): call distlab.parallelize_module over the tp
group first, then fully_shard(layout="per_param", group=<dp group>): the TP-local parameters
are sharded on dim 0 over the dp ranks (torchtitan's order). Sequence parallelism is refused:
its LayerNorm gradients are completed after backward, past the point where this layout has
already reduce-scattered them.

Not written here (refused by fully_shard or the zero3 strategy): offload, HSDP's
replicate_gradients, loading a state dict after sharding, checkpoints of the zero3 strategy.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.comm import Pending
from distlab.parallel.data_parallel.allreduce import broadcast_buffers
from distlab.parallel.data_parallel.syncbn import attach_comm
from distlab.parallel.weak_hooks import on_gradient_accumulated
from distlab.parallel.zero.fsdp import LAYOUTS, FullyShard, _in_backward
from distlab.parallel.zero.optimizer import ShardedGradients
from distlab.units import storage_bytes, tensor_bytes

# the four copies FSDP2 makes and the flat layout does not, and the wrapping of each new
# gradient shard as a DTensor (seconds of each in PerParamShard.copy_s)
COPIES = ("all-gather copy-in", "all-gather copy-out", "reduce-scatter copy-in",
          "reduce-scatter copy-out", "gradient DTensor wrap")


def _dtensor():
    """torch's DTensor and Shard, imported when first used: torch.distributed.tensor takes
    ~0.5 s to import, which every process that builds a RunConfig (it reads every strategy's
    knobs, so imports this module) would otherwise pay."""
    from torch.distributed.tensor import DTensor, Shard
    return DTensor, Shard


def rows_per_rank(d0: int, world: int) -> int:
    """c = ceil(d0 / N): the rows each rank's chunk holds (torch.chunk's and FSDP2's cut)."""
    return -(-d0 // world)


def local_rows(d0: int, world: int, rank: int) -> int:
    """The rows of a d0-row parameter rank `rank` really holds: c, fewer on the last ranks."""
    c = rows_per_rank(d0, world)
    return max(0, min(c, d0 - rank * c))


def _contiguous_stride(shape) -> tuple:
    return torch.empty(0).new_empty(shape).stride() if len(shape) else ()


@dataclass(eq=False)
class ParamUnit:
    """One unit's parameters (one dtype), each sharded on dim 0 (FSDP2's FSDPParamGroup)."""
    index: int
    name: str
    modules: list[nn.Module]
    params: list[nn.Parameter]  # the model's own: unsharded, what forward and backward use
    sharded: list[nn.Parameter]  # their DTensor shards: on the modules between uses
    locals_: list[torch.Tensor]  # each shard's c rows (zero-padded); the DTensor's rows view it
    full: list[torch.Tensor]  # each parameter's N·c rows in param_dtype; p.data views them
    sizes: list[int]  # c_i · (entries per row): each parameter's part of one rank's slice
    ag_buffer: torch.Tensor  # (N · Σ sizes,) the all-gather's output, freed after copy-out
    slots: list[list[tuple[nn.Module, str]]]  # where each parameter is registered
    live: bool = False  # an all-gather started, or the parameters are unsharded
    unsharded: bool = False  # copied out: the modules hold the full parameters
    gather: Pending | None = None
    gather_in: torch.Tensor | None = None
    gather_record: dict = field(default_factory=dict)
    reduce: Pending | None = None
    reduce_out: torch.Tensor | None = None
    grad_full: torch.Tensor | None = None  # the reduce-scatter's input while it runs
    trainable: list[int] = field(default_factory=list)  # parameters in that reduce-scatter
    hooked: set = field(default_factory=set)  # parameters whose gradient hook is registered
    inputs_pending: int = 0  # forwards whose inputs backward has not reached yet (frozen ones)
    waiting: int = 0  # trainable gradients of the running backward not yet arrived

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def padded(self) -> int:
        """Entries one all-gather delivers: Σ N·c_i·(entries per row)."""
        return self.ag_buffer.numel()

    def bytes_of(self, tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)


def _resize(t: torch.Tensor, on: bool) -> None:
    """Give t's storage its bytes back (on) or free them; t keeps its shape (and its views)."""
    t.untyped_storage().resize_(t.numel() * t.element_size() if on else 0)


class PerParamShard(FullyShard):
    """fully_shard's state with layout="per_param" (see the module docstring)."""
    layout = "per_param"

    def __init__(self, module, specs, policy, comm, reshard_after_forward, offload, prefetch=1):
        _refuse_sequence_parallel(module)
        device = next(module.parameters()).device
        group = comm.group if comm.group is not None else dist.group.WORLD
        from torch.distributed.device_mesh import DeviceMesh
        self.mesh = DeviceMesh.from_group(group, device.type)  # the DTensors' (no collective)
        self._sharded_of: dict[int, nn.Parameter] = {}  # id(own parameter) -> its shard
        self.copy_s = dict.fromkeys(COPIES, 0.0)  # seconds spent copying (take_copy_seconds)
        super().__init__(module, specs, policy, comm, reshard_after_forward, offload, prefetch)

    # -- setup: FullyShard's, with these units -----------------------------------------------
    def _shards(self, p: nn.Parameter) -> bool:
        return True  # frozen parameters too: freezing is per parameter, not per unit

    def _claim(self, params: list) -> None:
        """Nothing to guard: a torch optimizer over model.parameters() steps the DTensor shards
        themselves (the model's own parameters are never handed out between steps)."""

    def _flatten(self, name: str, modules: list, params: list, offload: bool) -> list[ParamUnit]:
        kinds: dict = {}
        for p in params:
            kinds.setdefault((p.dtype, p.device), []).append(p)
        return [self._make_unit(name if len(kinds) == 1 else
                                f"{name}.{str(dtype).removeprefix('torch.')}", modules, ps)
                for (dtype, _), ps in kinds.items()]

    def _make_unit(self, name: str, modules: list, params: list) -> ParamUnit:
        """Broadcast rank 0's values, keep this rank's rows of each parameter as a DTensor
        shard, and free the full parameters (their storage comes back at each gather)."""
        for p in params:
            if p.dim() == 0:
                raise ValueError(f"unit {name!r}: a 0-dim parameter cannot be sharded on dim 0 "
                                 "(layout='per_param'); give it shape (1,)")
        with torch.no_grad():  # one broadcast per unit: every rank starts from rank 0's
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            self.comm.broadcast(flat, src=0)
            for p, v in zip(params, flat.split([p.numel() for p in params])):
                p.copy_(v.view_as(p))
        dtype = self._gather_dtype(params[0])
        u = ParamUnit(len(self.units), name, list(modules), list(params), [], [], [], [],
                      torch.empty(0), [])
        for p in params:
            self._shard(u, p)
        u.ag_buffer = torch.empty(self.world * sum(u.sizes), dtype=dtype, device=params[0].device)
        _resize(u.ag_buffer, False)
        self.units.append(u)
        self._swap(u, sharded=True)
        return u

    def _gather_dtype(self, p: nn.Parameter) -> torch.dtype:
        dtype = self.policy.param_dtype
        return dtype if dtype is not None and p.is_floating_point() else p.dtype

    def _shard(self, u: ParamUnit, p: nn.Parameter) -> None:
        """p's rows [r·c, r·c + local) as this rank's DTensor shard; p a view of its padded
        full storage, freed."""
        DTensor, Shard = _dtensor()
        N, r, d0 = self.world, self.rank, p.shape[0]
        c, n = rows_per_rank(d0, N), local_rows(d0, N, self.rank)
        local = p.new_zeros((c, *p.shape[1:]))
        with torch.no_grad():
            local[:n].copy_(p[r * c: r * c + n])
        shard = DTensor.from_local(local[:n], self.mesh, [Shard(0)], run_check=False,
                                   shape=p.shape, stride=_contiguous_stride(p.shape))
        sharded = nn.Parameter(shard, requires_grad=p.requires_grad)
        sharded._distlab_per_param = self  # grad_shard / full_grad find their state
        full = torch.empty((N * c, *p.shape[1:]), dtype=self._gather_dtype(p), device=p.device)
        p.data = full[:d0]
        _resize(full, False)
        u.sharded.append(sharded)
        u.locals_.append(local)
        u.full.append(full)
        u.sizes.append(local.numel())
        u.slots.append([(m, k) for m in self.module.modules()
                        for k, q in m._parameters.items() if q is p])
        self._sharded_of[id(p)] = sharded

    def _swap(self, u: ParamUnit, sharded: bool) -> None:
        """Register the DTensor shards (between uses) or the full parameters (while used) on
        the modules (FSDP2's to_sharded / to_unsharded)."""
        for i, p in enumerate(u.params):
            if not sharded:  # freezing is the shard's flag; autograd reads the parameter's
                p.requires_grad_(u.sharded[i].requires_grad)
                if p.requires_grad and i not in u.hooked:  # (torch refuses one on a frozen one)
                    on_gradient_accumulated(p, self._grad_ready_at, u.index, i)
                    u.hooked.add(i)
            for m, k in u.slots[i]:
                m._parameters[k] = u.sharded[i] if sharded else p

    def _replicate_rest(self, module: nn.Module) -> None:
        """Every parameter is in a unit (frozen ones too); buffers are rank 0's."""
        broadcast_buffers(self.comm, module, 0)
        attach_comm(module, self.comm)

    def _install_state_dict_hooks(self, module: nn.Module) -> None:
        # state_dict(): the registered DTensor shards, as they are (no hook, no communication)
        module.register_load_state_dict_pre_hook(_refuse_load)

    def _param_layout(self) -> list:
        """The parameters' identities, each own parameter read as its shard (a unit may still
        be gathered); requires_grad is left out: freezing one parameter is allowed here."""
        return [id(self._sharded_of.get(id(p), p)) for p in self.module.parameters()]

    def adopt(self, optimizer, params: list):
        raise ValueError("distlab.ZeroOptimizer steps fully_shard's flat units; with "
                         "layout='per_param' build a torch optimizer over model.parameters() "
                         "(it steps the DTensor shards)")

    # -- gathering: copy-in, all-gather, copy-out --------------------------------------------
    def _prefetch(self, u: ParamUnit, phase: str):
        """Copy this rank's rows of every parameter into its slice of the unit's all-gather
        buffer (copy-in) and start the all-gather."""
        if u.live:
            return
        _resize(u.ag_buffer, True)
        u.live = True
        self._track("params", tensor_bytes(u.ag_buffer))
        t0 = time.perf_counter()
        S = sum(u.sizes)
        u.gather_in = u.ag_buffer.narrow(0, self.rank * S, S)
        with torch.no_grad():
            torch._foreach_copy_(list(u.gather_in.split(u.sizes)),
                                 [t.reshape(-1) for t in u.locals_])
        self.copy_s["all-gather copy-in"] += time.perf_counter() - t0
        u.gather = self.comm.all_gather_async(u.ag_buffer, u.gather_in)
        u.gather_record = {"unit": u.name, "phase": phase, "issued": u.gather.issued}
        self.gathers.append(u.gather_record)

    def _gather(self, u: ParamUnit, phase: str):
        super()._gather(u, phase)
        if not u.unsharded:
            self._copy_out(u)

    def _copy_out(self, u: ParamUnit):
        """Each parameter's rows from every rank's slice into its own storage; the buffer is
        freed and the modules hold the full parameters."""
        t0 = time.perf_counter()
        for t in u.full:
            _resize(t, True)
        with torch.no_grad():
            torch.split_with_sizes_copy(u.ag_buffer.view(self.world, -1), u.sizes, dim=1,
                                        out=[t.view(self.world, -1) for t in u.full])
        self.copy_s["all-gather copy-out"] += time.perf_counter() - t0
        self._track("params", u.bytes_of(u.full) - tensor_bytes(u.ag_buffer))
        _resize(u.ag_buffer, False)
        u.unsharded = True
        self._swap(u, sharded=False)

    def _free(self, u: ParamUnit):
        if not u.live:
            return
        if u.gather is not None:  # prefetched, never used: wait before freeing its buffer
            u.gather.wait()
            u.gather = u.gather_in = None
        if u.unsharded:
            for t in u.full:
                _resize(t, False)
            self._track("params", -u.bytes_of(u.full))
            self._swap(u, sharded=True)
        else:
            _resize(u.ag_buffer, False)
            self._track("params", -tensor_bytes(u.ag_buffer))
        u.live = u.unsharded = False

    # -- when a unit with frozen parameters may be freed in backward -------------------------
    # The flat layout frees a unit when its last gradient arrives: the node that computed a
    # weight's gradient also used the weight, so nothing needs it after. A frozen weight has no
    # gradient to arrive: backward may still need it to reach the unit's inputs (a LoRA
    # layer's base weight, after its adapters' gradients are in). As FSDP2's post-backward
    # hook on a module's inputs, such a unit is freed once backward has reached its inputs.
    def _before_forward(self, module, args, kwargs):
        if not _in_backward() and torch.is_grad_enabled():
            for u in self.units:  # a forward whose backward never ran left counts behind
                u.inputs_pending = 0
        return super()._before_forward(module, args, kwargs)

    def _pre_forward(self, k: int, module, args, kwargs):
        args, kwargs = super()._pre_forward(k, module, args, kwargs)
        frozen = any(not s.requires_grad for u in self.chain[k] for s in u.sharded)
        if frozen and torch.is_grad_enabled() and not _in_backward():
            args = self._watch_inputs(k, args)
        return args, kwargs

    def _watch_inputs(self, k: int, args: tuple) -> tuple:
        """args with the tensors that need a gradient passed through _BackwardReached."""
        at = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
        if not at:  # backward never reaches these inputs: the last gradient frees the unit
            return args
        out = _BackwardReached.apply(weakref.ref(self), k, *(args[i] for i in at))
        for u in self.chain[k]:
            u.inputs_pending += 1
        args = list(args)
        for i, t in zip(at, out):
            args[i] = t
        return tuple(args)

    def _inputs_reached(self, k: int):
        for u in self.chain[k]:
            u.inputs_pending -= 1
            if u.inputs_pending == 0 and u.waiting == 0:  # and its gradients are in
                self._free(u)

    def _unit_backward_done(self, u: ParamUnit):
        if u.inputs_pending:  # reduce its gradients now, free it when the inputs are reached
            ShardedGradients._unit_backward_done(self, u)
        else:
            super()._unit_backward_done(u)

    # -- gradients: copy-in, reduce-scatter, copy-out ----------------------------------------
    def _grad_ready(self, u: ParamUnit, i: int, p: nn.Parameter):
        """Parameter i's gradient accumulated in p.grad (a hook, during backward); it stays
        there until the unit's reduce-scatter takes it (no_sync: across backwards)."""
        self._open_backward()
        u.waiting -= 1
        if u.waiting == 0:
            self._unit_backward_done(u)

    def _close_backward(self):
        """End of backward: the last units' reduce-scatters are waited for here, so p.grad is
        every shard's mean gradient when backward returns (FSDP2's semantics: a torch
        optimizer's step() may follow at once)."""
        super()._close_backward()
        while self._inflight:
            self._finish_reduce(self._inflight.pop(0))

    def _reduce_dtype(self, u: ParamUnit) -> torch.dtype:
        return self.policy.reduce_dtype or u.ag_buffer.dtype

    def _launch_reduce(self, u: ParamUnit):
        """Cut each trainable parameter's gradient into N row chunks laid rank-major
        (copy-in; zeros for a parameter no gradient reached, the same shapes on every rank)
        and start the reduce-scatter."""
        while self._inflight:
            self._finish_reduce(self._inflight.pop(0))
        u.trainable = [i for i, s in enumerate(u.sharded) if s.requires_grad]
        if not u.trainable:  # a frozen unit: nothing to reduce
            return
        t0 = time.perf_counter()
        dtype = self._reduce_dtype(u)
        grads = [u.params[i].grad if u.params[i].grad is not None
                 else torch.zeros_like(u.params[i]) for i in u.trainable]
        S = sum(u.sizes[i] for i in u.trainable)
        u.grad_full = grads[0].new_empty(self.world * S, dtype=dtype)
        torch._chunk_cat([g.to(dtype) for g in grads], 0, self.world,
                         out=u.grad_full.view(self.world, -1))
        for i in u.trainable:
            u.params[i].grad = None
        self.copy_s["reduce-scatter copy-in"] += time.perf_counter() - t0
        self._track_grads(tensor_bytes(u.grad_full))
        u.reduce_out = u.grad_full.new_empty(S)
        u.reduce = self.comm.reduce_scatter_async(u.reduce_out, u.grad_full)
        self._inflight.append(u)

    def _finish_reduce(self, u: ParamUnit):
        """The mean gradient's rows of each parameter, added to its shard's .grad (copy-out)."""
        DTensor, Shard = _dtensor()
        u.reduce.wait()
        u.reduce_out.div_(self.world)  # the sum over ranks -> the global batch's mean
        for i, piece in zip(u.trainable, u.reduce_out.split([u.sizes[k] for k in u.trainable])):
            t0 = time.perf_counter()
            s = u.sharded[i]
            n = local_rows(s.shape[0], self.world, self.rank)
            rows = piece.view(u.locals_[i].shape)[:n].to(s.dtype)  # a view, unless cast
            if s.grad is not None:  # accumulating (no zero_grad since the last step)
                s.grad.to_local().add_(rows)
            t1 = time.perf_counter()
            self.copy_s["reduce-scatter copy-out"] += t1 - t0
            if s.grad is None:
                s.grad = DTensor.from_local(rows, self.mesh, [Shard(0)], run_check=False,
                                            shape=s.shape, stride=s.stride())
                self.copy_s["gradient DTensor wrap"] += time.perf_counter() - t1
        self._track_grads(-tensor_bytes(u.grad_full))
        u.reduce = u.reduce_out = u.grad_full = None

    def reduce_gradients(self) -> None:
        """Each trainable shard's .grad: this rank's rows of the global batch's mean gradient.
        Gradients no syncing backward sent (no_sync, or set on a gathered parameter) are
        reduced now. Every rank calls it."""
        while self._inflight:
            self._finish_reduce(self._inflight.pop(0))
        for u in self.units:
            if any(p.grad is not None for p in u.params):
                self._launch_reduce(u)
        while self._inflight:
            self._finish_reduce(self._inflight.pop(0))

    def zero_grad(self) -> None:
        """Forget this step's gradients: the shards' and any not yet reduced."""
        while self._inflight:  # a backward's reduce-scatters that no step() waited for
            self._finish_reduce(self._inflight.pop(0))
        for u in self.units:
            for p, s in zip(u.params, u.sharded):
                p.grad = s.grad = None

    def gradient_shards(self) -> list[torch.Tensor]:
        """This rank's rows of each trainable parameter's mean gradient (plain tensors: what a
        loss scaler unscales and checks), after reduce_gradients()."""
        return [s.grad.to_local() for u in self.units for s in u.sharded if s.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The shards scaled by the global L2 norm: ‖g‖² summed over this rank's rows, one
        all-reduce of that number (padding rows are in no shard)."""
        self.reduce_gradients()
        grads = self.gradient_shards()
        sq = torch.zeros((), dtype=torch.float32, device=self.units[0].ag_buffer.device)
        for g in grads:
            sq += g.float().pow(2).sum()
        self.comm.all_reduce_async(sq, kind="clip.norm_sq").wait()
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    # -- what a step spent and what this rank holds -----------------------------------------
    def take_copy_seconds(self) -> dict:
        """Seconds each of COPIES took since the last call (a step's, when the loop asks)."""
        out, self.copy_s = self.copy_s, dict.fromkeys(COPIES, 0.0)
        return out

    def local_bytes(self, optimizer) -> dict:
        """Bytes this rank holds, from the tensors (views of one storage count once): params,
        each shard's padded rows plus any parameter still gathered; grads, the shards'
        gradients (the reduce-scatter outputs they view) and any not yet reduced; optim, the
        optimizer's state (DTensors by their local rows)."""
        params = [t for u in self.units for t in u.locals_ + u.full]
        grads = [t for u in self.units for p, s in zip(u.params, u.sharded)
                 for t in (p.grad, s.grad)]
        state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        return {"params": storage_bytes(params), "grads": storage_bytes(grads),
                "optim": storage_bytes(state)}

    # -- reading gradients and parameters whole ----------------------------------------------
    def grad_shard(self, param: nn.Parameter) -> torch.Tensor:
        """distlab.grad_shard: this rank's rows of param's mean gradient, flattened."""
        self.reduce_gradients()
        if param.grad is None:
            return param.to_local().new_zeros(param.to_local().numel())
        return param.grad.to_local().reshape(-1)

    def full_grad(self, param: nn.Parameter) -> torch.Tensor:
        """distlab.full_grad: param's whole mean gradient (an all-gather of the rows)."""
        self.reduce_gradients()
        rows = (param.grad.to_local() if param.grad is not None
                else torch.zeros_like(param.to_local()))
        return self._full(rows.detach(), param.shape)

    def _full(self, rows: torch.Tensor, shape) -> torch.Tensor:
        """Every rank's rows of a dim-0-sharded tensor, all-gathered (padded) and cut to shape."""
        c = rows_per_rank(shape[0], self.world)
        mine = rows.new_zeros((c, *shape[1:]))
        mine[:rows.shape[0]].copy_(rows)
        whole = mine.new_empty((self.world * c, *shape[1:]))
        self.comm.all_gather(whole.view(-1), mine.view(-1))
        return whole[:shape[0]].clone()

    def full_state_dict(self) -> dict:
        """The whole parameters (in the shards' dtype) and buffers under state_dict's names:
        each shard all-gathered (a collective: every rank calls it). state_dict() itself is
        the shards, with no communication."""
        DTensor, _ = _dtensor()
        out = {}
        for k, v in self.module.state_dict(keep_vars=True).items():
            out[k] = (self._full(v.to_local().detach(), v.shape) if isinstance(v, DTensor)
                      else v.detach().clone())
        return out



class _BackwardReached(torch.autograd.Function):
    """Identity forward; its backward runs once backward has reached these inputs of a unit,
    and tells the state (held weakly: a graph kept alive keeps no model alive)."""

    @staticmethod
    def forward(ctx, state_ref, k, *tensors):
        ctx.state_ref, ctx.k = state_ref, k
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state_ref()
        if state is not None:
            state._inputs_reached(ctx.k)
        return (None, None, *grads)


def _refuse_sequence_parallel(module: nn.Module) -> None:
    tp = getattr(module, "_distlab_tp", None)
    if tp is not None and tp.partial_params:
        raise ValueError("fully_shard(layout='per_param') over a sequence-parallel module: its "
                         "LayerNorm gradients are summed over the tp ranks after backward, "
                         "after this layout reduce-scattered them. Use sp=False, or "
                         "layout='flat'")


def _refuse_load(module, *args):
    raise RuntimeError("load_state_dict on a module fully_shard(layout='per_param') sharded is "
                       "not written here: load the state dict before calling fully_shard")


LAYOUTS["per_param"] = PerParamShard
