"""ZeRO-1 and ZeRO-2 as a torch optimizer: `distlab.ZeroOptimizer`, and the flat padded buffers
(units) every ZeRO stage of distlab.parallel.zero.stages is cut into.

Rajbhandari et al. 2020 (the stages, their bytes and the wire: distlab.parallel.zero.stages's
docstring). Stages 1 and 2 leave the parameters whole on every rank, so they need nothing from
the model: they are an optimizer over parameters, used as torch's are,

    opt = distlab.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

and the training loop's `zero1` and `zero2` strategies are this optimizer over the loop's model
(one implementation).

**Units.** Each parameter group's trainable parameters are flattened into one flat buffer per
dtype (and device), a unit, padded with zeros to a multiple of N and cut into N shards; rank r
owns shard r. Each parameter's .data becomes a view of the unit's buffer `full`, so an
all-gather into `full` updates the parameters in place. The inner optimizer (`optimizer_class`)
is built over one master tensor per unit, the rank's shard (a view: no copy), one inner group
per outer group: per-group settings (no weight decay on norms, another lr) hold, and its state
(AdamW's moments) is 1/N of the model's. Construction broadcasts rank 0's values, so every rank
starts from the same parameters.

**step()**, after backward on every rank:

    stage 1  gradients accumulate in a flat gradient buffer per unit (each .grad is a view of
             it); step() reduce-scatters it in place: shard r becomes shard r's mean gradient
    stage 2  a hook on each parameter moves its gradient into the unit's flat gradient buffer
             as backward produces it and drops .grad; when the unit's last gradient is in, its
             reduce-scatter starts (async) and the flat gradient is freed once it is done: what
             stays between steps is the S-sized shard of the mean gradient
    then     the inner optimizer steps the shards; an all-gather (in place) gives every rank
             every rank's updated shard

Gradient accumulation: several backwards before one step add up, as torch's do. Stage 2
reduce-scatters after each backward (accumulating the mean shards); `no_sync()` around every
backward but the last keeps them local until then (one reduce-scatter per step).

**ZeRO-3.** distlab.fully_shard (distlab.parallel.zero.fsdp) shards the parameters too: its
units own their shard and gather the parameters around each unit's forward and backward; the
gradient path above (ShardedGradients, shared by every stage) is its, and a ZeroOptimizer
built over that model's parameters steps its units' shards (stage 3).

**Outside optimizers.** Stepping parameters this optimizer shards with another optimizer would
train wrong in silence (stage 2: .grad is None, nothing moves; stage 1: each rank steps its own
local gradient, and the ranks drift apart). Every sharded parameter is marked, and a global
step pre-hook (torch.optim.optimizer.register_optimizer_step_pre_hook) makes any other
optimizer's step() over a marked parameter raise an error that says what to do.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from distlab.comm import Comm, Pending
from distlab.parallel.agree import agree
from distlab.parallel.weak_hooks import on_gradient_accumulated
from distlab.step_ledger import StepCounter
from distlab.units import tensor_bytes


# -- units: flat padded buffers and their shards -------------------------------------------------
def padded_size(numel: int, world: int) -> int:
    """numel rounded up to a multiple of world: the flat buffer every rank's shard cuts."""
    return -(-numel // world) * world


@dataclass(eq=False)
class Unit:
    """One flat group of parameters and its shard on this rank (see the module docstring)."""
    index: int
    name: str
    modules: list[nn.Module]
    params: list[nn.Parameter]
    offsets: list[int]
    full: torch.Tensor  # (P,) the parameters side by side; each param's .data views into it
    shard: torch.Tensor  # (S,) this rank's block of full (zero1/2: a view of it)
    master: torch.Tensor  # what the optimizer steps: the shard, or a CPU copy (offload on CUDA)
    grad_shard: torch.Tensor | None = None  # (S,) this rank's block of the mean gradient
    grad_full: torch.Tensor | None = None  # (P,) local gradients waiting for the reduce-scatter
    grad_dtype: torch.dtype | None = None  # grad_full's dtype (fully_shard's reduce_dtype)
    gather: Pending | None = None  # zero3: an all-gather into full in flight
    gather_in: torch.Tensor | None = None  # its input: the shard, cast to full's dtype
    fp8: bool = False  # zero3: an FP8 Linear's weights (fully_shard's FP8 all-gather)
    fp8_scales: torch.Tensor | None = None  # an FP8 all-gather in flight: each param's scale
    gather_record: dict = field(default_factory=dict)  # its entry in the step's timeline
    reduce: Pending | None = None  # a reduce-scatter of grad_full in flight
    reduce_out: torch.Tensor | None = None  # where it lands (grad_shard, or a scratch to add)
    live: bool = True  # full has storage (zero3 frees it outside forward and backward)
    waiting: int = 0  # gradients of the running backward not yet arrived
    reduced: bool = False  # grad_shard holds a reduced gradient since the last zero_grad

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def padded(self) -> int:
        return self.full.numel()

    @property
    def nbytes(self) -> int:
        return self.padded * self.full.element_size()

    def piece(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's entries of a (P,) flat tensor."""
        return flat[self.offsets[i]: self.offsets[i] + self.params[i].numel()]

    def shard_piece(self, shard: torch.Tensor, i: int, rank: int) -> torch.Tensor:
        """Parameter i's entries within rank `rank`'s (S,) shard (a view, maybe empty): the
        entries [lo, hi) of its flattened self, lo and hi where its range meets the shard's."""
        S = shard.numel()
        lo = max(self.offsets[i], rank * S)
        hi = min(self.offsets[i] + self.params[i].numel(), (rank + 1) * S)
        return shard[lo - rank * S: max(lo, hi) - rank * S]

    def new_grad_full(self) -> torch.Tensor:
        return torch.zeros(self.padded, dtype=self.grad_dtype or self.full.dtype,
                           device=self.full.device)


def make_unit(index: int, name: str, params: list, comm: Comm, modules=(),
              own_shard: bool = False, master_on_cpu: bool = False) -> Unit:
    """Flatten `params` (one dtype) into a zero-padded buffer, broadcast rank 0's values, make
    each parameter's .data a view of it, and keep this rank's shard. own_shard: the shard is a
    copy (zero3 frees the buffer); master_on_cpu: the master is a CPU copy (ZeRO-Offload)."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise ValueError(f"unit {name}: parameters of several dtypes {dtypes}")
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    full = torch.zeros(padded_size(offsets[-1], comm.world), dtype=params[0].dtype,
                       device=params[0].device)
    with torch.no_grad():
        for p, off in zip(params, offsets):
            full[off: off + p.numel()].copy_(p.reshape(-1))
        comm.broadcast(full, src=0)  # every rank starts from rank 0's weights
    for p, off in zip(params, offsets):
        p.data = full[off: off + p.numel()].view_as(p)
    S = full.numel() // comm.world
    shard = full[comm.rank * S: (comm.rank + 1) * S]
    if own_shard:
        shard = shard.clone()
    master = shard.detach().cpu().clone() if master_on_cpu else shard
    return Unit(index, name, list(modules), list(params), offsets[:-1], full, shard,
                nn.Parameter(master))


# -- the guard rail: no other optimizer steps a sharded parameter -----------------------------
_GUARD = []  # the global step pre-hook's handle, once a parameter was claimed


def claim(params, owner: str, fix: str, grads: "ShardedGradients") -> None:
    """Mark `params` as sharded by `owner` (words naming it), whose gradient path is `grads`;
    any other optimizer's step() over one of them raises, naming `fix`, and
    torch.nn.utils.clip_grad_norm_ over them clips the shards by the global norm."""
    for p in params:
        if getattr(p, "_distlab_zero", None):
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is already sharded by "
                             f"{p._distlab_zero[0]}: shard each parameter once (build one "
                             "ZeroOptimizer over all of them, with parameter groups if needed)")
    for p in params:  # grads weakly: it holds the params (a cycle would outlive the run)
        p._distlab_zero = (owner, fix, weakref.ref(grads))
    if not _GUARD:
        _GUARD.append(register_optimizer_step_pre_hook(_refuse_outside_step))
        route_torch_clip()


_TORCH_CLIP = torch.nn.utils.clip_grad_norm_


def route_torch_clip() -> None:
    """`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` is the line nanoGPT, torchtitan
    and the HF Trainer write. Over sharded parameters it would clip nothing (ZeRO-2/3: .grad is
    None) or clip by one rank's unreduced norm (ZeRO-1). From the first sharded parameter on,
    the name points to clip_grad_norm_ below: the same function for everything else, and for
    distlab's shards the global norm (what it returns over torch's FSDP2 too)."""
    import torch.nn.utils.clip_grad as module
    torch.nn.utils.clip_grad_norm_ = module.clip_grad_norm_ = clip_grad_norm_


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    """torch.nn.utils.clip_grad_norm_, and over the parameters one ZeroOptimizer or one
    fully_shard model shards: their gradient path's clip_grad_norm_ (the shards scaled by the
    global L2 norm, which it returns; every rank calls it, as the torch habit has them do);
    over a parallelize_module model's, its state's clip_grad_norm_ (the same global norm).
    Anything it cannot do right (another norm, a subset of the shards, a mix with replicated
    gradients) raises, naming the call that is right."""
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    tp = {id(s): s for p in params if (s := getattr(p, "_distlab_tp_clip", None)) is not None}
    if tp:  # a tensor-parallel module's (distlab.parallelize_module): its global norm
        if len(tp) > 1 or any(getattr(p, "_distlab_zero", None) for p in params):
            raise ValueError("torch.nn.utils.clip_grad_norm_ over parameters of several "
                             "distlab shardings at once: clip each one's parameters apart")
        return next(iter(tp.values())).clip_grad_norm_(params, max_norm, norm_type,
                                                       error_if_nonfinite)
    marks = [getattr(p, "_distlab_zero", None) for p in params]
    if not any(marks):
        return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    grads = {id(g): g for m in marks if m and (g := m[2]()) is not None}
    if not grads:
        raise ValueError("torch.nn.utils.clip_grad_norm_ over parameters whose ZeroOptimizer "
                         "no longer exists: their gradients went with it")
    path = next(iter(grads.values()))
    sharded = {id(p) for u in path.units for p in u.params}
    given = {id(p) for p, m in zip(params, marks) if m}
    loose = [p for p, m in zip(params, marks) if not m and p.grad is not None]
    if len(grads) > 1 or given != sharded or loose or float(norm_type) != 2.0:
        owner = next(m for m in marks if m)[0]
        raise ValueError(
            f"torch.nn.utils.clip_grad_norm_ over parameters sharded by {owner}: "
            "no rank holds their whole gradient, so it clips the L2 norm of all of them "
            "together, and only that. Pass all of the model's parameters (and no others "
            "with a gradient), or call opt.clip_grad_norm_(max_norm) on its ZeroOptimizer")
    norm = path.clip_grad_norm_(float(max_norm))
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the total norm of the gradients is {norm.item()}: non-finite")
    return norm


def _refuse_outside_step(optimizer, args, kwargs):
    if isinstance(optimizer, ZeroOptimizer):
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            mark = getattr(p, "_distlab_zero", None)
            if mark:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() over a parameter (shape "
                    f"{tuple(p.shape)}) sharded by {mark[0]}: its gradient is reduced into "
                    "the shards that keeps (ZeRO-2/3: .grad is None here, so nothing would "
                    "move; ZeRO-1: each rank would step its own local gradient and the ranks "
                    f"would drift apart). {mark[1]}")


# -- the gradient path: units, their hooks, the reduce-scatters ---------------------------------
class ShardedGradients:
    """The units of ZeRO-1/2/3 and their gradient path (the module docstring's step()): a hook
    per parameter, the reduce-scatters into each unit's grad_shard, no_sync, zero_grad.
    ZeroOptimizer makes one for stages 1 and 2; distlab.fully_shard's state (stage 3) is one,
    which the ZeroOptimizer over that model's parameters then uses."""

    def __init__(self, stage: int, comm: Comm):
        self.stage, self.comm = stage, comm
        self.rank, self.world = comm.rank, comm.world
        self.units: list[Unit] = []
        self._sync = True  # False inside no_sync()
        self._bwd_open = False  # stages 2/3: a backward began; its end callback is queued
        self._inflight: list[Unit] = []  # stages 2/3: reduce-scatters in flight
        self._stale = False  # stage 1: the flat gradients hold the last step's reduction
        self.grad_bytes_live = self.grad_bytes_peak = 0  # stages 2/3: flat gradients alive
        # steps begun, where each step's first collective starts: stage 1 its reduce, stage 2
        # a synchronising backward (fully_shard counts its forwards); distlab.step_ledger
        self._steps = StepCounter("ZeroOptimizer")

    def add_unit(self, name: str, params: list, master_on_cpu: bool = False) -> Unit:
        u = make_unit(len(self.units), name, params, self.comm, own_shard=self.stage == 3,
                      master_on_cpu=master_on_cpu)
        S = u.shard.numel()
        if self.stage == 1:  # persistent gradients; the shard's is a view (in-place reduce)
            u.grad_full = torch.zeros_like(u.full)
            u.grad_shard = u.grad_full[self.rank * S: (self.rank + 1) * S]
            self._attach_views(u)
        else:
            u.grad_shard = torch.zeros_like(u.shard)  # the master's dtype (fp32 under bf16)
        for i, p in enumerate(params):
            on_gradient_accumulated(p, self._grad_ready_at, u.index, i)
        self.units.append(u)
        return u

    def _attach_views(self, u: Unit) -> None:
        """Stage 1: each .grad is a view of the unit's flat gradient buffer."""
        for i, p in enumerate(u.params):
            p.grad = u.piece(u.grad_full, i).view_as(p)

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside only accumulate locally (stages 2/3: in the flat gradient buffers);
        the next backward outside, or step(), reduce-scatters the sum. Stage 1 always waits
        for step(), so this changes nothing there."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def _grad_ready_at(self, unit: int, i: int, p: nn.Parameter):
        self._grad_ready(self.units[unit], i, p)  # by index: the hook holds no unit (weak_hooks)

    def _grad_ready(self, u: Unit, i: int, p: nn.Parameter):
        """Parameter i of unit u has its gradient (a hook, during backward)."""
        if self.stage == 1:
            if self._stale:
                raise RuntimeError("ZeroOptimizer (stage 1): backward after step() without "
                                   "zero_grad(): the flat gradient buffers hold the last "
                                   "step's reduce-scatter. Call optimizer.zero_grad() after "
                                   "each step (model.zero_grad() does not reach them)")
            return  # accumulated in place in the flat buffer (a view), or copied at step
        self._open_backward()
        if u.grad_full is None:
            u.grad_full = u.new_grad_full()
            self._track_grads(tensor_bytes(u.grad_full))
        u.piece(u.grad_full, i).add_(p.grad.reshape(-1))
        p.grad = None
        u.waiting -= 1
        if u.waiting == 0:
            self._unit_backward_done(u)

    def _track_grads(self, nbytes: int):
        self.grad_bytes_live += nbytes
        self.grad_bytes_peak = max(self.grad_bytes_peak, self.grad_bytes_live)

    def _open_backward(self):
        """First gradient of a backward: count what each unit waits for, and ask autograd to
        call _close_backward when this backward ends."""
        if self._bwd_open:
            return
        self._bwd_open = True
        if self.stage == 2 and self._sync:
            self._steps.begin()
        while self._inflight:  # the last backward's: its flat gradients are about to refill
            self._finish_reduce(self._inflight.pop(0))
        for u in self.units:
            u.waiting = sum(p.requires_grad for p in u.params)
        torch.autograd.Variable._execution_engine.queue_callback(self._close_backward)

    def _unit_backward_done(self, u: Unit):
        if self._sync:
            self._launch_reduce(u)

    def _close_backward(self):
        """End of a backward: units some of whose gradients never came (unused parameters)."""
        for u in self.units:
            if u.waiting > 0:
                u.waiting = 0
                self._unit_backward_done(u)
        self._bwd_open = False

    def _launch_reduce(self, u: Unit):
        """Start u's reduce-scatter; first finish the one before, freeing its flat gradient.
        Every rank launches units in the same order (backward's), as collectives must."""
        while self._inflight:
            self._finish_reduce(self._inflight.pop(0))
        if u.grad_full is None:  # no gradient reached this unit: it contributes zeros
            u.grad_full = u.new_grad_full()
            self._track_grads(tensor_bytes(u.grad_full))
        # into grad_shard itself, unless a second backward adds to it or the dtypes differ
        direct = not u.reduced and u.grad_full.dtype == u.grad_shard.dtype
        u.reduce_out = u.grad_shard if direct else u.grad_shard.new_empty(
            u.grad_shard.shape, dtype=u.grad_full.dtype)
        u.reduce = self.comm.reduce_scatter_async(u.reduce_out, u.grad_full)
        self._inflight.append(u)

    def _finish_reduce(self, u: Unit):
        u.reduce.wait()
        u.reduce_out.div_(self.world)  # the sum over ranks -> the global batch's mean
        if u.reduce_out is not u.grad_shard:  # grad_shard is zero after zero_grad
            u.grad_shard.add_(u.reduce_out)
        self._track_grads(-tensor_bytes(u.grad_full))
        u.reduce = u.reduce_out = u.grad_full = None
        u.reduced = True

    def reduce_gradients(self) -> None:
        """Make each unit's grad_shard this rank's shard of the global batch's mean gradient.
        Every rank must call it. Nothing to do if it already ran since the last zero_grad()."""
        if self.stage == 1:
            if self._stale:
                return
            self._steps.begin()
            for u in self.units:
                for i, p in enumerate(u.params):  # a .grad that is not the view: copy it in
                    view = u.piece(u.grad_full, i)
                    if p.grad is None:
                        view.zero_()
                    elif p.grad.data_ptr() != view.data_ptr():
                        view.copy_(p.grad.reshape(-1))
                self.comm.reduce_scatter(u.grad_shard, u.grad_full, op="avg")
            self._stale = True
        else:
            while self._inflight:  # the last backward's
                self._finish_reduce(self._inflight.pop(0))
            for u in self.units:  # local gradients no syncing backward sent (no_sync)
                self._take_loose_grads(u)
                if u.grad_full is not None or not u.reduced:
                    self._launch_reduce(u)
            while self._inflight:
                self._finish_reduce(self._inflight.pop(0))

    def _take_loose_grads(self, u: Unit):
        """Stages 2/3: a .grad that no hook moved (set by hand) joins the flat gradient. Not
        after this step's gradient was reduced into the shard: a whole gradient set by hand
        then (FSDP2's habit of writing p.grad) would be averaged and added a second time."""
        if u.reduced and any(p.grad is not None for p in u.params):
            i = next(i for i, p in enumerate(u.params) if p.grad is not None)
            raise RuntimeError(
                f"unit {u.name!r}: parameter {i} (shape {tuple(u.params[i].shape)}) has a "
                ".grad set by hand after this step's gradient was reduced into the shards; "
                "reducing it would add it to the mean gradient a second time. Read the reduced "
                "gradient with distlab.grad_shard(p) (or the optimizer's gradient_shards()), "
                "or call zero_grad() first if the hand-set .grad is meant to replace it")
        for i, p in enumerate(u.params):
            if p.grad is not None:
                if u.grad_full is None:
                    u.grad_full = u.new_grad_full()
                    self._track_grads(tensor_bytes(u.grad_full))
                u.piece(u.grad_full, i).add_(p.grad.reshape(-1))
                p.grad = None

    def gradient_shards(self) -> list[torch.Tensor]:
        """See ZeroOptimizer.gradient_shards."""
        return [u.grad_shard for u in self.units]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """See ZeroOptimizer.clip_grad_norm_."""
        self.reduce_gradients()
        sq = torch.zeros((), dtype=torch.float32, device=self.units[0].full.device)
        for u in self.units:
            sq += u.grad_shard.float().pow(2).sum()
        self.comm.all_reduce_async(sq, kind="clip.norm_sq").wait()
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for u in self.units:
            u.grad_shard.mul_(coef.to(u.grad_shard.dtype))
        return norm

    def zero_grad(self) -> None:
        """Forget this step's gradients. Stage 1 zeroes its flat buffers and keeps each .grad a
        view of them (one memset; no allocation in backward)."""
        while self._inflight:  # a backward's reduce-scatters that no step() waited for
            self._finish_reduce(self._inflight.pop(0))
        for u in self.units:
            if self.stage == 1:
                u.grad_full.zero_()
                self._attach_views(u)
            else:
                self.zero_unit_grad(u)
        self._stale = False

    def zero_unit_grad(self, u: Unit, drop_loose: bool = True) -> None:
        """Stages 2/3: unit u's gradient back to zero (its shard, and any local gradients);
        drop_loose: also each parameter's .grad (False inside a backward: a hook is reading it)."""
        if u.grad_full is not None:  # local gradients of a no_sync backward
            self._track_grads(-tensor_bytes(u.grad_full))
        u.grad_full, u.reduced = None, False
        u.grad_shard.zero_()
        for p in u.params if drop_loose else []:
            p.grad = None


# -- the optimizer -----------------------------------------------------------------------------
class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2 (P_os, P_os+g): any torch optimizer with its state, and with stage 2 its
    gradients, sharded over the ranks of a process group; the parameters stay whole. Over the
    parameters of a model distlab.fully_shard sharded, ZeRO-3 (P_os+g+p): it steps that model's
    shards (fp32 masters under a MixedPrecisionPolicy), and the stage is 3.

        opt = distlab.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        loss_fn(model(x), y).backward()    # each rank on its own rows of the global batch
        opt.step()                         # the global batch's mean gradient, then the update
        opt.zero_grad()

    params           parameters or parameter groups (dicts, as torch's optimizers take); a
                     group may carry "name" (the units' name, default "group<i>"). Over a
                     fully_shard model a group holds whole units (a unit steps as one shard)
    optimizer_class  a torch.optim.Optimizer class (or any callable(params, **defaults))
    stage            1: optimizer state sharded; 2: gradients too; default 1, or 3 over a
                     fully_shard model's parameters (3 needs one: it shards the parameters)
    group            a torch.distributed process group (default: the whole world; over a
                     fully_shard model, that model's group)
    offload          keep the master shards and their optimizer state on the CPU (ZeRO-Offload,
                     Ren et al. 2021): on an accelerator each step copies the gradient shards to
                     the CPU, steps there and copies the updated shards back; on a CPU, nothing
                     (stage 3: fully_shard's offload= decides)
    comm             a distlab.comm.Comm to communicate (and book bytes) through instead
    **defaults       optimizer_class's arguments (lr, weight_decay, betas, ...)

    Construction makes each parameter's .data a view of a flat buffer (and broadcasts rank
    0's values): build it after moving the model to its device and dtype. `state` is this
    rank's inner optimizer state (keyed by its shards); `state_dict()` is this rank's shard
    and `consolidated_state_dict()` (a collective) the whole state in the form a plain
    optimizer over the same groups has; load_state_dict takes either. Call `zero_grad()` after
    each step (stage 1 refuses a backward over the previous step's reduced buffers).
    """

    def __init__(self, params, optimizer_class, stage: int | None = None, group=None,
                 offload: bool = False, comm: Comm | None = None, **defaults):
        if stage not in (None, 1, 2, 3):
            raise ValueError(f"stage={stage!r} is not one of 1, 2, 3")
        self._asked, self.stage, self.offload, self.optim = stage, None, offload, None
        self._inner_class = getattr(optimizer_class, "__name__", repr(optimizer_class))
        self.comm = comm if comm is not None else Comm(group)
        self.grads: ShardedGradients | None = None  # the units' gradient path (stage 3: shared)
        self.units: list[Unit] = []
        self._group_units: list[list[Unit]] = []  # the units of each param group
        super().__init__(params, defaults)  # calls add_param_group for each group
        self.optim = optimizer_class([self._inner_group(g, us) for g, us in
                                      zip(self.param_groups, self._group_units)], **defaults)
        for g, inner in zip(self.param_groups, self.optim.param_groups):
            self._fill_settings(g, inner)
        self.defaults = {**self.optim.defaults, **defaults}
        self.state = self.optim.state  # what this rank holds: the shards' state

    # -- setup -------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # torch's checks (duplicates, defaults)
        g = self.param_groups[-1]
        if any(getattr(p, "_distlab_per_param", None) is not None for p in g["params"]):
            raise ValueError("these parameters are DTensor shards of fully_shard(layout="
                             "'per_param'): build a torch optimizer over model.parameters() "
                             "(it steps the shards); ZeroOptimizer steps flat units only")
        trainable = [p for p in g["params"] if p.requires_grad]
        held = [p for p in trainable if getattr(p, "_distlab_fsdp", None) is not None]
        self._agree(g, held[0]._distlab_fsdp.comm if held else self.comm)
        if held:
            units = self._adopt(trainable, held)
        else:
            self._settle(None)
            units = self._new_units(g, trainable)
        self._group_units.append(units)
        self.units += units
        if self.optim is not None:  # a group added after construction
            self.optim.add_param_group(self._inner_group(g, units))
            self._fill_settings(g, self.optim.param_groups[-1])

    def _agree(self, g: dict, comm: Comm) -> None:
        """Before a group's first broadcast: every rank passed the same optimizer, stage and
        group (a width or a learning rate that differs would shard or step inconsistently)."""
        k = len(self.param_groups) - 1
        agree(comm, "distlab.ZeroOptimizer",
              {"the optimizer class": self._inner_class, "stage": self._asked,
               "offload": self.offload,
               f"param group {k}'s parameters (shape, dtype, requires_grad)":
                   [(tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad)
                    for p in g["params"]],
               f"param group {k}'s settings": repr({key: v for key, v in sorted(g.items())
                                                     if key != "params"})})

    def _settle(self, fsdp) -> None:
        """The first group decides the stage and whose gradient path this is; later groups
        must agree (one fully_shard model's parameters, or none)."""
        if self.grads is None:
            self.stage = self._stage_for(fsdp)
            if fsdp is not None:
                self.grads, self.comm = fsdp, fsdp.comm
            else:
                self.grads = ShardedGradients(self.stage, self.comm)
            self.rank, self.world = self.comm.rank, self.comm.world
        elif self.grads is not fsdp and (fsdp is not None or self.stage == 3):
            raise ValueError("a ZeroOptimizer steps the parameters of one model that "
                             "distlab.fully_shard sharded, or parameters no fully_shard holds, "
                             "not both: build one optimizer for each")

    def _stage_for(self, fsdp) -> int:
        if fsdp is not None:
            if self._asked not in (None, 3):
                raise ValueError(f"stage={self._asked}: these parameters are sharded by "
                                 "distlab.fully_shard (ZeRO-3); leave stage out (it is 3)")
            if self.offload:
                raise ValueError("offload=True: the master shards of a fully_shard model are "
                                 "its own; pass offload=True to distlab.fully_shard instead")
            return 3
        if self._asked == 3:
            raise ValueError("stage=3 shards the parameters too, which needs the model: call "
                             "distlab.fully_shard(model) first, then build ZeroOptimizer over "
                             "model.parameters() (the stage is then 3)")
        return self._asked or 1

    def _adopt(self, trainable: list, held: list) -> list[Unit]:
        """A group of a fully_shard model's parameters: step its units' shards."""
        fsdp = held[0]._distlab_fsdp
        if len(held) != len(trainable) or any(p._distlab_fsdp is not fsdp for p in held):
            raise ValueError("a parameter group mixes parameters of a model distlab.fully_shard "
                             "sharded with others: give ZeroOptimizer that model's parameters "
                             "(model.parameters()), and build another optimizer for the rest")
        self._settle(fsdp)
        return fsdp.adopt(self, held)

    def _new_units(self, g: dict, trainable: list) -> list[Unit]:
        """Stages 1/2: flatten the group, one unit per dtype (a flat buffer holds one)."""
        kinds: dict = {}
        for p in trainable:
            kinds.setdefault((p.dtype, p.device), []).append(p)
        claim(trainable, f"a ZeRO-{self.stage} optimizer (distlab.ZeroOptimizer)",
              grads=self.grads,
              fix="Step that ZeroOptimizer instead (it takes the optimizer class and its "
              "arguments, and parameter groups for per-group settings), and build no other "
              "optimizer over these parameters.")
        name = g.get("name", f"group{len(self._group_units)}")
        units = []
        for (dtype, _), ps in kinds.items():
            uname = name if len(kinds) == 1 else f"{name}.{str(dtype).removeprefix('torch.')}"
            units.append(self.grads.add_unit(
                uname, ps, master_on_cpu=self.offload and ps[0].device.type != "cpu"))
        return units

    @staticmethod
    def _inner_group(g: dict, units: list[Unit]) -> dict:
        return {**{k: v for k, v in g.items() if k != "params"},
                "params": [u.master for u in units]}

    @staticmethod
    def _fill_settings(outer: dict, inner: dict) -> None:
        """The outer group shows every setting the inner optimizer uses (its defaults too)."""
        for k, v in inner.items():
            if k != "params":
                outer.setdefault(k, v)

    # -- gradients: the units' gradient path (ShardedGradients) --------------------------------
    def no_sync(self):
        """Backwards inside only accumulate locally (stages 2/3: in the flat gradient buffers);
        the next backward outside, or step(), reduce-scatters the sum. Stage 1 always waits
        for step(), so this changes nothing there."""
        return self.grads.no_sync()

    def reduce_gradients(self) -> None:
        """Make each unit's grad_shard this rank's shard of the global batch's mean gradient
        (step() calls it; a loop that clips or unscales gradients calls it first). Every rank
        must call it. Nothing to do if it already ran since the last zero_grad()."""
        self.grads.reduce_gradients()

    def gradient_shards(self) -> list[torch.Tensor]:
        """This rank's shards of the mean gradient, after reduce_gradients() (what a loss
        scaler unscales and checks)."""
        return [u.grad_shard for u in self.units]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradient shards so the global gradient's L2 norm is at most max_norm;
        return the norm before clipping (torch.nn.utils.clip_grad_norm_'s coefficient). No rank
        sees the whole gradient: ‖g‖² is the sum over ranks of the shards' squares (one
        all-reduce of one number; padding is zero and adds nothing). Every rank must call it."""
        return self.grads.clip_grad_norm_(max_norm)

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Reduce-scatter the gradients (if not done yet), step this rank's shards with the
        inner optimizer, all-gather every rank's updated shard into the parameters (stage 3:
        the next forward gathers them). Every rank must call it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        for g, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update({k: v for k, v in g.items() if k != "params"})  # lr schedules etc.
        for u in self.units:  # offload: to the CPU master (else the same tensor, no copy)
            u.master.grad = u.grad_shard.to(u.master.device)
        self.optim.step()
        for u in self.units:
            if u.master.data_ptr() != u.shard.data_ptr():  # offloaded: back from the CPU
                u.shard.copy_(u.master.detach())
        if self.stage < 3:
            self._gather_params()
        return loss

    def _gather_params(self):
        """Every rank gets every rank's updated shard, in place (the master is the shard)."""
        pending = [self.comm.all_gather_async(u.full, u.shard) for u in self.units]
        for h in pending:
            h.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients. Stage 1 zeroes its flat buffers and keeps each .grad a
        view of them whatever set_to_none says (one memset; no allocation in backward)."""
        self.grads.zero_grad()

    # -- state dicts -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (the inner optimizer's state_dict), with
        the layout it belongs to; load it back at the same world size and groups."""
        return {"zero_shard": self.optim.state_dict(), "layout": self._layout()}

    def _layout(self) -> dict:
        return {"world": self.world, "rank": self.rank, "stage": self.stage,
                "units": [[u.name, u.numel] for u in self.units]}

    def consolidated_state_dict(self) -> dict:
        """The whole optimizer state, as a plain optimizer over the same parameter groups would
        have it (per parameter, keyed by its index in the groups): each shard-shaped state
        tensor is all-gathered and cut back into parameters; scalars (AdamW's step) are the same
        on every rank. A collective: every rank calls it, every rank gets the result."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state: dict = {}
        for u in self.units:
            for key, v in self.optim.state.get(u.master, {}).items():
                whole = None
                if torch.is_tensor(v) and v.shape == u.master.shape:
                    whole = torch.empty_like(u.full)
                    self.comm.all_gather(whole, v.to(u.full.device))
                for i, p in enumerate(u.params):
                    state.setdefault(index[id(p)], {})[key] = (
                        u.piece(whole, i).view_as(p).clone() if whole is not None
                        else v.clone() if torch.is_tensor(v) else v)
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load state_dict() of this rank (same world size, rank and groups), or a consolidated
        one (consolidated_state_dict(), or a plain optimizer's over the same groups: this rank
        keeps its shard of it)."""
        if "zero_shard" in state_dict:
            if state_dict["layout"] != self._layout():
                raise ValueError(f"this shard was saved with layout {state_dict['layout']}, "
                                 f"not this optimizer's {self._layout()}: load a consolidated "
                                 "state dict (consolidated_state_dict()) to change world size")
            inner = state_dict["zero_shard"]
        else:
            inner = self._shard_of(state_dict)
        self.optim.load_state_dict(inner)
        for g, ig in zip(self.param_groups, self.optim.param_groups):
            g.update({k: v for k, v in ig.items() if k != "params"})

    def _shard_of(self, sd: dict) -> dict:
        """This rank's inner state dict cut from a consolidated one."""
        if len(sd["param_groups"]) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(sd['param_groups'])} parameter groups, "
                             f"this optimizer {len(self.param_groups)}")
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state = {}
        for j, u in enumerate(self.units):
            per_param = [sd["state"].get(index[id(p)], {}) for p in u.params]
            S = u.shard.numel()
            state[j] = {}
            for key in per_param[0]:
                v0 = per_param[0][key]
                if torch.is_tensor(v0) and v0.shape == u.params[0].shape:
                    whole = torch.zeros_like(u.full, dtype=v0.dtype)
                    for i, s in enumerate(per_param):
                        u.piece(whole, i).copy_(s[key].reshape(-1))
                    state[j][key] = whole[self.rank * S: (self.rank + 1) * S].clone()
                else:
                    state[j][key] = v0
        masters = {id(u.master): j for j, u in enumerate(self.units)}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [masters[id(u.master)] for u in units]}
                  for g, units in zip(sd["param_groups"], self._group_units)]
        return {"state": {j: s for j, s in state.items() if s}, "param_groups": groups}
