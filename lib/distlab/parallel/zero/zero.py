"""ZeRO written out: data parallelism that stops replicating the model state.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".
With DDP each of N ranks holds all Ψ parameters, all Ψ gradients and the whole optimizer state
(K·Ψ bytes: AdamW's two fp32 moments, K = 8, plus a 4-byte step counter per tensor; the paper's
K = 12 adds an fp32 master copy of fp16 weights, which distlab's autocast does not need: its
weights are fp32 already). ZeRO's stages partition these, so rank r keeps 1/N of each and
fetches the rest only when it is needed:

    stage  paper      rank r keeps (fp32 bytes)        on the wire per step, per rank
    zero1  P_os       4Ψ params  4Ψ grads  KΨ/N state  reduce-scatter + all-gather  = 2(N-1)/N·4Ψ
    zero2  P_os+g     4Ψ params  4Ψ/N grads  KΨ/N      reduce-scatter + all-gather  = 2(N-1)/N·4Ψ
    zero3  P_os+g+p   4Ψ/N params  4Ψ/N grads  KΨ/N    all-gather (forward) + all-gather
                                                       (backward) + reduce-scatter  = 3(N-1)/N·4Ψ

An all-reduce *is* a reduce-scatter followed by an all-gather (distlab.comm.ring_all_reduce), so
stages 1 and 2 move what DDP moves: each rank needs only its shard of the summed gradient (the
reduce-scatter) and then everyone needs everyone's updated shard (the all-gather). Stage 3 pays
one more all-gather, 1.5x DDP, because parameters are fetched twice: for forward and again for
backward.

**Units, flat buffers, padded shards.** Parameters are flattened into units: zero1 makes the
whole model one unit; zero2 and zero3 one unit per ModuleList item (each GPT block) with the
other top-level modules grouped between them (embeddings "tok_emb+pos_emb", head "ln_f+head"),
so gradients can leave and parameters arrive one block at a time. A unit's flat buffer is padded
with zeros to a multiple of N and cut into N equal shards; rank r owns shard r:

    unit blocks.0   |ln1|attn.q.w|attn.q.b| ... |mlp.proj.w|mlp.proj.b|pad|   Ψ_u values
                    |<-- shard 0 -->|<-- shard 1 -->|<-- shard 2 -->|<-- shard 3 -->|   N = 4
                    P_u = Ψ_u rounded up to a multiple of N,   S_u = P_u / N

Each parameter's .data is a view into its unit's flat buffer `full`, so an all-gather into
`full` updates the parameters in place and the model's code never knows it is sharded. The
optimizer (`build_optimizer`) is built over one fp32 master tensor per unit, the rank's shard
of `full` (zero1/2: a view into it, so no copy; zero3: the only copy), so its state (AdamW's
exp_avg, exp_avg_sq, step) is S_u-sized.

**zero1.** Gradients accumulate into a persistent flat gradient buffer per unit (`.grad` of each
parameter is a view into it, as DDP's gradient_as_bucket_view). After backward, one
reduce-scatter, in place: shard r of the buffer becomes the mean gradient of shard r. Each rank
steps its shard; an all-gather (in place) hands every rank everyone's updated shard.

    backward          reduce_gradients            optimizer_step
    grad_full (Ψ) ──► reduce-scatter ──► shard ──► step ──► all-gather ──► full params (Ψ)

**zero2.** Gradients leave during backward: a hook on each parameter copies its gradient into
its unit's flat buffer and drops `.grad`; when a unit's last gradient arrived, its reduce-scatter
starts (async) and, once it is done, the unit's flat gradient is freed. At most two units' full
gradients are alive at once; what stays is the S_u-sized gradient shard.

**zero3.** Parameters are sharded too: outside forward and backward each unit holds only its
shard; `full`'s storage is resized to 0 bytes (the parameters keep their shapes; autograd's
saved views of them keep pointing at the same storage, refilled before they are read again).

    forward:   unit k  pre-hook: wait for k's all-gather, start k+1's (prefetch), free k-1
    end of forward: free the last unit, start its all-gather again for backward
    backward:  unit k  pre-hook (on its outputs' gradient): wait for k, prefetch k-1
               unit k  last gradient arrived: free k's parameters, reduce-scatter k's gradient

    three units, time ─►
    compute          | fwd u0 | fwd u1 | fwd u2 | bwd u2 | bwd u1 | bwd u0 |
    all-gather  ag u0  ag u1    ag u2    ag u2    ag u1    ag u0
    (under)   (exposed) fwd u0   fwd u1   loss     bwd u2   bwd u1
    reduce-scatter                                rs u2    rs u1    rs u0

Every all-gather but the first runs while the unit before it computes (the "prefetched" count of
step_info); the reduce-scatter of a unit runs while the next one back computes.

**Gradient accumulation** (`no_sync`, every micro-batch but the last): zero1 accumulates in its
gradient buffer; zero2/3 accumulate in each unit's flat gradient buffer, which then stays
alive (Ψ bytes, as DDP's) until the last micro-batch's backward reduce-scatters it. zero3 still
gathers parameters for every micro-batch: per step it moves (2·micro-batches + 1)(N-1)/N·4Ψ.

**Clipping** (cfg.grad_clip): no rank sees the whole gradient, so each sums the squares of its
shards, one all-reduce of that number (4 bytes, Comm kind "clip.norm_sq") gives ‖g‖², and every
rank scales its shards by min(1, max_norm / (‖g‖ + 1e-6)), torch.nn.utils.clip_grad_norm_'s
coefficient. Padding is zero and adds nothing.

**Offload** (cfg.offload): the optimizer's master shard and its state live on the CPU (ZeRO-
Offload, Ren et al. 2021): on a CUDA run each step copies the gradient shards to the CPU, steps
there and copies the updated shards back. On a CPU run there is nothing to move; the state's
bytes are reported as "optim_offloaded" instead of "optim", where they would live.

**What a step event gets** (`step_info()["zero"]`): the stage, Ψ, ΣP_u and ΣS_u, the units
(name, Ψ_u, P_u), the peak bytes of gathered parameters and of flat gradient buffers alive
during the step, and for zero3 the all-gathers: how many were prefetched (issued before the
compute needed them) and the seconds the compute was blocked waiting for them.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from distlab.comm import Pending
from distlab.nan import tensors_in
from distlab.parallel.base import Strategy
from distlab.parallel.data_parallel.allreduce import broadcast_buffers, read_batch
from distlab.parallel.data_parallel.syncbn import attach_comm


# -- units -------------------------------------------------------------------------------------
def find_units(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The model cut into units gathered one at a time: every item of a top-level ModuleList
    is a unit (a GPT block); the other top-level children that hold parameters are grouped
    with their neighbours up to the next ModuleList ("tok_emb+pos_emb", "ln_f+head")."""
    units, group = [], []

    def close():
        if group:
            units.append(("+".join(n for n, _ in group), [m for _, m in group]))
            group.clear()

    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            close()
            units += [(f"{name}.{i}", [m]) for i, m in enumerate(child)]
        elif any(True for _ in child.parameters()):
            group.append((name, child))
    close()
    return units


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
    gather: Pending | None = None  # zero3: an all-gather into full in flight
    gather_record: dict = field(default_factory=dict)  # its entry in the step's timeline
    reduce: Pending | None = None  # a reduce-scatter of grad_full in flight
    live: bool = True  # full has storage (zero3 frees it outside forward and backward)
    waiting: int = 0  # gradients of the running backward not yet arrived
    reduced: bool = False  # this step's reduce-scatter was issued

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


def _in_backward() -> bool:
    """True inside autograd's backward (e.g. a checkpointed block recomputing its forward)."""
    return torch._C._current_graph_task_id() != -1


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


# -- the strategy ------------------------------------------------------------------------------
class ZeRO(Strategy):
    """ZeRO stage `stage` (1, 2 or 3); see the module docstring. ZeRO1/ZeRO2/ZeRO3 below."""
    supports = Strategy.supports | {"lora", "eval", "offload"}
    checkpoint_format = "sharded"

    stage = 0

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        self.units: list[Unit] = []
        self.frozen: list[nn.Parameter] = []  # requires_grad=False: replicated, not sharded
        self._sync = True  # False inside no_sync
        self._bwd_open = False  # a backward has begun and its end callback is queued
        self._inflight: list[Unit] = []  # units whose reduce-scatter is in flight
        self._grads_stale = False  # zero1: the gradient buffers hold the last step's
        self._current: Unit | None = None  # zero3: the unit whose forward is running
        self._order: list[Unit] = []  # zero3: units in the order the first forward used them
        self._order_done = False
        self._gathers: list[dict] = []  # zero3: this step's all-gathers (for step_info)
        self._live = {"params": 0, "grads": 0}  # bytes of transient flat buffers alive now
        self._peak = {"params": 0, "grads": 0}

    # -- setup -----------------------------------------------------------------------------
    def wrap(self, model):
        device = next(model.parameters()).device
        self.offload_to_cpu = self.cfg.offload and device.type == "cuda"
        specs = ([("model", [model])] if self.stage == 1 else find_units(model))
        owned = set()
        for name, modules in specs:
            params = [p for m in modules for p in m.parameters()
                      if p.requires_grad and id(p) not in owned]
            owned |= {id(p) for p in params}
            if params:
                self.units.append(self._make_unit(len(self.units), name, modules, params))
        loose = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
        if loose:
            raise ValueError(f"zero{self.stage}: parameters {loose} belong to no unit (the root "
                             "module's own parameters); put them in a submodule")
        self.frozen = [p for p in model.parameters() if not p.requires_grad]
        with torch.no_grad():
            for p in self.frozen:
                self.comm.broadcast(p.data, src=0)
        broadcast_buffers(self.comm, model, 0)
        attach_comm(model, self.comm)  # SyncBatchNorm shares statistics over these ranks
        self._install_hooks(model)
        self.model = model
        return model

    def _make_unit(self, index, name, modules, params) -> Unit:
        """Flatten `params` into a padded buffer, make each param a view of it, keep shard r."""
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"unit {name}: parameters of several dtypes {dtypes}")
        numel = sum(p.numel() for p in params)
        full = torch.zeros(padded_size(numel, self.world), dtype=params[0].dtype,
                           device=params[0].device)
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        with torch.no_grad():
            for p, off in zip(params, offsets):
                full[off: off + p.numel()].copy_(p.reshape(-1))
            self.comm.broadcast(full, src=0)  # every rank starts from rank 0's weights
        for p, off in zip(params, offsets):
            p.data = full[off: off + p.numel()].view_as(p)
        S = full.numel() // self.world
        shard = full[self.rank * S: (self.rank + 1) * S]
        if self.stage == 3:
            shard = shard.clone()  # the rank's only copy once full is freed
        master = shard.detach().cpu().clone() if self.offload_to_cpu else shard
        unit = Unit(index, name, modules, params, offsets[:-1], full, shard,
                    nn.Parameter(master))
        if self.stage == 1:  # persistent gradients; the shard's is a view (in-place reduce)
            unit.grad_full = torch.zeros_like(full)
            unit.grad_shard = unit.grad_full[self.rank * S: (self.rank + 1) * S]
        else:
            unit.grad_shard = torch.zeros_like(shard)
        if self.stage == 3:  # from now on the parameters exist only while a unit computes
            full.untyped_storage().resize_(0)
            unit.live = False
        return unit

    def _install_hooks(self, model):
        model.register_forward_pre_hook(self._before_forward)
        if self.stage >= 2:
            for u in self.units:
                for i, p in enumerate(u.params):
                    p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, u, i))
        if self.stage == 3:
            for u in self.units:
                for m in u.modules:
                    m.register_forward_pre_hook(functools.partial(self._pre_forward, u))
                    m.register_forward_hook(functools.partial(self._post_forward, u))
            model.register_forward_hook(self._after_forward)
            # a state_dict has the full parameters: gather, copy, free (FSDP's FULL_STATE_DICT)
            pre = lambda module, prefix, keep_vars: self._gather_all()  # noqa: E731
            post = lambda module, sd, prefix, meta: self._full_state_dict(sd)  # noqa: E731
            model.register_state_dict_pre_hook(pre)
            model.register_state_dict_post_hook(post)

    def build_optimizer(self, model, make):
        """The optimizer over this rank's master shards only: its state is 1/N of the model's."""
        return make([u.master for u in self.units])

    def batch(self, data, step):
        if any(True for _ in self.model.buffers()):  # as DDP: rank 0's buffers every step
            broadcast_buffers(self.comm, self.model, 0)
        return read_batch(self, data, step)

    def no_sync(self, model):
        return self._hooks_paused()

    # -- bookkeeping of transient buffers ---------------------------------------------------
    def _track(self, kind: str, nbytes: int):
        self._live[kind] += nbytes
        self._peak[kind] = max(self._peak[kind], self._live[kind])

    # -- zero3: parameters gathered one unit at a time --------------------------------------
    def _prefetch(self, u: Unit | None, phase: str):
        """Start gathering unit u's full parameters (async), if they are not there already."""
        if u is None or u.live:
            return
        u.full.untyped_storage().resize_(u.nbytes)
        u.live = True
        self._track("params", u.nbytes)
        u.gather = self.comm.all_gather_async(u.full, u.shard)
        u.gather_record = {"unit": u.name, "phase": phase, "issued": u.gather.issued}
        self._gathers.append(u.gather_record)

    def _gather(self, u: Unit, phase: str):
        """Unit u's full parameters, now: wait for its prefetch, or gather them."""
        needed = time.perf_counter()
        self._prefetch(u, phase)
        if u.gather is not None:
            u.gather.wait()
            rec = u.gather_record
            rec.update(prefetched=rec["issued"] < needed, blocked_s=u.gather.waited - needed)
            u.gather = None

    def _free(self, u: Unit):
        """Drop unit u's full parameters: only its shard stays on this rank."""
        if not u.live:
            return
        if u.gather is not None:
            u.gather.wait()
            u.gather = None
        u.full.untyped_storage().resize_(0)
        u.live = False
        self._track("params", -u.nbytes)

    def _gather_all(self):
        for u in self.units:
            self._prefetch(u, "state_dict")
        for u in self.units:
            self._gather(u, "state_dict")

    def _full_state_dict(self, sd: dict):
        for k, v in sd.items():  # copies: the gathered buffers are freed below
            sd[k] = v.clone()
        for u in self.units:
            self._free(u)

    def _next(self, u: Unit, step: int) -> Unit | None:
        """The unit forward runs after u (step=+1) or before it (-1): the order the first
        forward recorded, or the registration order while that is still being recorded."""
        order = self._order if u in self._order and self._order_done else self.units
        i = order.index(u) + step
        return order[i] if 0 <= i < len(order) else None

    def _before_forward(self, module, args):
        if _in_backward():
            return
        if self.stage == 1:
            self.attach_gradients()
        self._current = None

    def attach_gradients(self, model=None):
        """zero1: .grad of each parameter is a view into its unit's flat gradient buffer,
        zeroed once the last step's reduce-scatter consumed it (re-attached if someone set
        .grad to None, e.g. model.zero_grad())."""
        for u in self.units:
            if self._grads_stale:
                u.grad_full.zero_()
            for i, p in enumerate(u.params):
                if p.grad is None:
                    p.grad = u.piece(u.grad_full, i).view_as(p)
        self._grads_stale = False

    def _pre_forward(self, u: Unit, module, args):
        if _in_backward():  # a checkpointed unit recomputing its forward
            self._gather(u, "recompute")
            return
        if self._current is u:
            return
        if self._current is not None:
            self._free(self._current)  # its forward is done
        self._current = u
        if not self._order_done and u not in self._order:
            self._order.append(u)
        self._gather(u, "forward")
        self._prefetch(self._next(u, +1), "forward")

    def _post_forward(self, u: Unit, module, args, output):
        if torch.is_grad_enabled():  # backward reaches u through its outputs' gradients
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, u))

    def _after_forward(self, module, args, output):
        if _in_backward():
            return
        if self._current is not None:
            self._free(self._current)
            self._current = None
        self._order_done = True
        if self._order and torch.is_grad_enabled() and any(t.requires_grad
                                                           for t in tensors_in(output)):
            self._prefetch(self._order[-1], "backward")  # backward starts with the last unit

    def _pre_backward(self, u: Unit, grad):
        self._open_backward()
        self._gather(u, "backward")
        self._prefetch(self._next(u, -1), "backward")

    # -- zero2/3: gradients leave during backward -------------------------------------------
    def _open_backward(self):
        if self._bwd_open:
            return
        self._bwd_open = True
        for u in self.units:
            u.waiting = sum(p.requires_grad for p in u.params)
        torch.autograd.Variable._execution_engine.queue_callback(self._close_backward)

    def _grad_ready(self, u: Unit, i: int, p: nn.Parameter):
        """Parameter i of unit u has its gradient: move it into u's flat gradient buffer."""
        self._open_backward()
        if u.grad_full is None:
            u.grad_full = torch.zeros_like(u.full)
            self._track("grads", u.nbytes)
        u.piece(u.grad_full, i).add_(p.grad.reshape(-1))
        p.grad = None
        u.waiting -= 1
        if u.waiting == 0:
            self._unit_backward_done(u)

    def _unit_backward_done(self, u: Unit):
        if self.stage == 3:
            self._free(u)
        if self._sync:
            self._launch_reduce(u)

    def _launch_reduce(self, u: Unit):
        """Start u's reduce-scatter; first finish the one before, freeing its flat gradient."""
        while self._inflight:
            self._finish_reduce(self._inflight.pop(0))
        if u.grad_full is None:  # no gradient reached this unit: it contributes zeros
            u.grad_full = torch.zeros_like(u.full)
            self._track("grads", u.nbytes)
        u.reduce = self.comm.reduce_scatter_async(u.grad_shard, u.grad_full)
        u.reduced = True
        self._inflight.append(u)

    def _finish_reduce(self, u: Unit):
        u.reduce.wait()
        u.reduce = None
        u.grad_shard.div_(self.world)  # the sum over ranks -> the global batch's mean
        u.grad_full = None
        self._track("grads", -u.nbytes)

    def _close_backward(self):
        """End of a backward: units some of whose gradients never came (unused parameters)."""
        for u in self.units:
            if u.waiting > 0:
                u.waiting = 0
                self._unit_backward_done(u)
        if self.stage == 3:
            for u in self.units:  # nothing stays gathered after backward
                self._free(u)
        self._bwd_open = False

    # -- the step ----------------------------------------------------------------------------
    def reduce_gradients(self, model):
        if self.stage == 1:  # one in-place reduce-scatter per unit: shard r gets the mean
            for u in self.units:
                self.comm.reduce_scatter(u.grad_shard, u.grad_full, op="avg")
            self._grads_stale = True
        else:
            for u in self.units:
                if not u.reduced:  # no syncing backward reached it
                    self._launch_reduce(u)
            while self._inflight:
                self._finish_reduce(self._inflight.pop(0))
            for u in self.units:
                u.reduced = False
        for u in self.units:
            u.master.grad = u.grad_shard if not self.offload_to_cpu else None
        # transient buffers of this step: gathered parameters and flat gradients (zero2/3)
        self.comm.note_buffer(self._peak["params"] + self._peak["grads"])

    def step_gradients(self, model) -> list:
        """The gradient shards the step reads (loss scaling unscales and checks these)."""
        return [u.grad_shard for u in self.units]

    def clip_gradients(self, model, max_norm: float) -> float:
        """Clip by the global norm: ‖g‖² = Σ over ranks of Σ over shards (one all-reduce)."""
        sq = torch.zeros((), dtype=torch.float32, device=self.units[0].full.device)
        for u in self.units:
            sq += u.grad_shard.float().pow(2).sum()
        self.comm.all_reduce_async(sq, kind="clip.norm_sq").wait()
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for u in self.units:
            u.grad_shard.mul_(coef.to(u.grad_shard.dtype))
        return float(norm)

    def optimizer_step(self, optimizer):
        if self.offload_to_cpu:  # ZeRO-Offload: the step runs on the CPU
            for u in self.units:
                u.master.grad = u.grad_shard.to("cpu")
        optimizer.step()
        if self.offload_to_cpu:
            for u in self.units:
                u.shard.copy_(u.master.detach(), non_blocking=False)
        if self.stage < 3:  # every rank gets every rank's updated shard (in place)
            pending = [self.comm.all_gather_async(u.full, u.shard) for u in self.units]
            for h in pending:
                h.wait()

    # -- what this rank holds ----------------------------------------------------------------
    def state_bytes(self, model, optimizer) -> dict:
        """Bytes this rank holds, from the tensors themselves (views of a buffer count once):
        params: zero1/2 the flat buffers (padding included), zero3 the shards plus any unit
        still gathered; grads: zero1 the flat gradient buffers, zero2/3 the gradient shards plus
        any flat gradient still alive; optim: the optimizer's state tensors (and, offloaded on
        CUDA, the CPU master shards), under "optim_offloaded" when cfg.offload."""
        params = _storage_bytes([u.full for u in self.units] + self.frozen)
        if self.stage == 3:
            params += _storage_bytes([u.shard for u in self.units])
        grads = _storage_bytes([u.grad_full for u in self.units]
                               + ([u.grad_shard for u in self.units] if self.stage >= 2 else []))
        grads += _storage_bytes([p.grad for p in self.frozen])
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        if self.offload_to_cpu:
            state += [u.master for u in self.units]
        optim = _storage_bytes(state)
        if self.cfg.offload:
            return {"params": params, "grads": grads, "optim": 0, "optim_offloaded": optim}
        return {"params": params, "grads": grads, "optim": optim}

    def step_info(self) -> dict:
        info = {"stage": self.stage, "numel": sum(u.numel for u in self.units),
                "padded": sum(u.padded for u in self.units),
                "shard": sum(u.shard.numel() for u in self.units),
                "units": [[u.name, u.numel, u.padded] for u in self.units],
                "gathered_peak_bytes": self._peak["params"],
                "grad_buffer_peak_bytes": self._peak["grads"],
                "offload": ("cpu" if self.offload_to_cpu else
                            "cpu (marked only: nothing to move on a CPU run)" if self.cfg.offload
                            else "none")}
        if self.stage == 3:
            done = [g for g in self._gathers if "blocked_s" in g]
            info["prefetch"] = {"gathers": len(done),
                                "prefetched": sum(g["prefetched"] for g in done),
                                "blocked_s": sum(g["blocked_s"] for g in done)}
        self._gathers = []
        self._peak = dict(self._live)
        return {"zero": info}

    # -- training checkpoints: each unit's flat shard, as DCP's DTensor slice ----------------------
    def checkpoint_state(self, model, optimizer, for_load: bool = False) -> dict:
        """This rank's shards of each unit's parameters and optimizer state, as DTensor Shard(0)
        slices of the unit's unpadded flat vector (our shard r is DTensor's chunk r: both cut
        ceil(n/N) entries per rank), so DCP can re-cut them for another world size; plus what
        every rank holds whole (LoRA's frozen base, buffers). Views: DCP loads into them."""
        from distlab.checkpoint.state import (flat_shard, materialize_optimizer_state,
                                              persistent_buffers)
        from distlab.checkpoint.store import CheckpointError
        if for_load:
            materialize_optimizer_state(optimizer)  # tensors for DCP to fill
        state = {}
        names = {id(p): n for n, p in model.named_parameters()}
        for u in self.units:
            state[f"model/{u.name}"] = flat_shard(u.master, u.numel, self.rank, self.world)
            for key, v in optimizer.state.get(u.master, {}).items():
                if not torch.is_tensor(v):
                    raise CheckpointError(f"optimizer state {key!r} is {type(v).__name__}, not "
                                          "a tensor: the sharded format holds tensors only")
                state[f"optim/{u.name}/{key}"] = (
                    flat_shard(v, u.numel, self.rank, self.world)
                    if v.shape == u.master.shape else v)  # AdamW's step: the same everywhere
        for p in self.frozen:  # not trained (LoRA's base): the same on every rank
            state[f"frozen/{names[id(p)]}"] = p.detach()
        for name, b in persistent_buffers(model).items():
            state[f"buffer/{name}"] = b
        return state

    def load_checkpoint_state(self, model, optimizer, state: dict) -> None:
        """DCP filled the shards in place: refresh what they feed."""
        for u in self.units:
            if u.master is not u.shard:  # offloaded: the CPU master was loaded
                u.shard.copy_(u.master.detach())
            if self.stage < 3:  # every rank's full parameters from the loaded shards
                self.comm.all_gather(u.full, u.shard)

    def checkpoint_meta(self, model) -> dict:
        """Each unit's parameters (name, shape) in flat order, so load_full can cut the flat
        vectors back into parameters without this strategy."""
        names = {id(p): n for n, p in model.named_parameters()}
        return {"units": [[u.name, [[names[id(p)], list(p.shape)] for p in u.params]]
                          for u in self.units]}


class ZeRO1(ZeRO):
    """P_os: optimizer state sharded; full parameters and gradients on every rank."""
    name = "zero1"
    checkpoint_layout = "ZeRO units: the whole model"

    stage = zero_stage = 1


class ZeRO2(ZeRO):
    """P_os+g: optimizer state and gradients sharded; full parameters on every rank."""
    name = "zero2"
    checkpoint_layout = "ZeRO units: one per block"

    stage = zero_stage = 2


class ZeRO3(ZeRO):
    """P_os+g+p: optimizer state, gradients and parameters sharded."""
    name = "zero3"
    checkpoint_layout = "ZeRO units: one per block"

    stage = zero_stage = 3
