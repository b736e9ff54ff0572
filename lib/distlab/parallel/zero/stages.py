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

**One implementation.** The units, the gradient path (zero1's in-place reduce-scatter, the
zero2/3 hooks below) and the step are distlab.parallel.zero.optimizer's ShardedGradients and
ZeroOptimizer, the public `distlab.ZeroOptimizer`: `build_optimizer` makes one over one
parameter group per unit. zero3's sharded parameters, gathered around each unit's forward and
backward, are distlab.parallel.zero.fsdp's, the public `distlab.fully_shard`: `wrap` calls it
with find_units' cut, and the ZeroOptimizer over its parameters steps its shards. This strategy
adds what needs the loop: the units' cut, the replicated rest (frozen parameters, buffers),
the step's bookkeeping and checkpoints.

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
compute needed them) and the seconds the compute was blocked waiting for them, split into the
gathers issued only when needed and the prefetches that arrived late (with the longest wait).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distlab.parallel.base import Strategy
from distlab.parallel.data_parallel.allreduce import broadcast_buffers, read_batch
from distlab.parallel.data_parallel.syncbn import attach_comm
from distlab.parallel.zero.fsdp import FullyShard, MixedPrecisionPolicy, find_units, fully_shard
from distlab.parallel.zero.optimizer import Unit, ZeroOptimizer, padded_size  # noqa: F401 (tests)
from distlab.parallel.state import (CheckpointError, flat_shard, materialize_optimizer_state,
                                     persistent_buffers)
from distlab.units import dtype_of, storage_bytes




def units_bytes(units, stage: int, optimizer_state: dict, extra_state=()) -> dict:
    """Bytes a rank holds for ZeRO units, from the tensors themselves (views of one buffer
    count once): params, the flat buffers (and zero3's shards); grads, the flat gradient
    buffers (and zero2/3's gradient shards); optim, the optimizer's state tensors (and
    `extra_state`, e.g. offloaded CPU masters)."""
    params = storage_bytes([u.full for u in units])
    if stage == 3:
        params += storage_bytes([u.shard for u in units])
    grads = storage_bytes([u.grad_full for u in units]
                           + ([u.grad_shard for u in units] if stage >= 2 else []))
    state = [v for s in optimizer_state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": params, "grads": grads,
            "optim": storage_bytes(state + list(extra_state))}


def units_of(cfg, model):
    """zero3's units: RunConfig.fsdp_units (names), else the model's own declaration (an
    `fsdp_units` attribute: what fully_shard's units takes, as tp_plan declares a TP plan),
    else None: fully_shard's default cut, the repeated blocks."""
    if cfg.fsdp_units:
        return [n.strip() for n in cfg.fsdp_units.split(",") if n.strip()]
    return getattr(model, "fsdp_units", None)


def mixed_precision_policy(cfg) -> MixedPrecisionPolicy:
    """RunConfig's param_dtype and reduce_dtype as fully_shard's policy (fp32: no cast)."""
    param = None if cfg.param_dtype == "fp32" else dtype_of(cfg.param_dtype)  # fp32: no cast
    reduce = dtype_of(cfg.reduce_dtype) if cfg.reduce_dtype else param
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce,
                                fp8_weights=cfg.fp8_all_gather)


# -- the strategy ------------------------------------------------------------------------------
class ZeRO(Strategy):
    """ZeRO stage `stage` (1, 2 or 3); see the module docstring. ZeRO1/ZeRO2/ZeRO3 below."""
    supports = Strategy.supports | {"lora", "eval", "offload", "fp8"}
    checkpoint_format = "sharded"

    stage = 0

    @classmethod
    def mesh_preset(cls, cfg):  # ZeRO over every rank
        return {"dp_shard": cfg.world_size, "zero_stage": cls.stage}

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        self.units: list[Unit] = []  # the optimizer's (build_optimizer)
        self.optimizer: ZeroOptimizer | None = None
        self.grads = None  # the gradient path: the ZeroOptimizer's units (or per_param's state)
        self.frozen: list[nn.Parameter] = []  # requires_grad=False: replicated, not sharded
        self.fsdp: FullyShard | None = None  # zero3: distlab.fully_shard's state on the model
        # trainable parameters another sharding owns (the mesh's experts over ep): in no
        # unit, not broadcast; set before wrap
        self.ignored: list[nn.Parameter] = []

    # -- setup -----------------------------------------------------------------------------
    def wrap(self, model):
        """Decide the units and make the replicated part (frozen parameters, buffers) rank 0's.
        zero1/2: build_optimizer flattens the units (ZeroOptimizer); zero3: distlab.fully_shard
        flattens and shards them now (find_units' cut) and gathers them around their use."""
        device = next(model.parameters()).device
        self.offload_to_cpu = self.cfg.offload and device.type == "cuda"
        self.frozen = [p for p in model.parameters() if not p.requires_grad]
        self.model = model
        ignored = {id(p) for p in self.ignored}
        if self.stage == 3:
            fully_shard(model, units=units_of(self.cfg, model), offload=self.offload_to_cpu,
                        comm=self.comm, mp_policy=mixed_precision_policy(self.cfg),
                        prefetch=self.cfg.fsdp_prefetch, ignored_params=self.ignored)
            self.fsdp = model._distlab_fsdp
            self._groups = [({"params": u.params, "name": u.name}, u.modules)
                            for u in self.fsdp.units]
            return model
        specs = ([("model", [model])] if self.stage == 1 else find_units(model))
        owned, self._groups = set(ignored), []
        for name, modules in specs:
            # a weight two modules of the unit share (a head tied to the embedding) once
            params = list({id(p): p for m in modules for p in m.parameters()
                           if p.requires_grad and id(p) not in owned}.values())
            owned |= {id(p) for p in params}
            if params:  # one parameter group per unit: the optimizer flattens each
                self._groups.append(({"params": params, "name": name}, modules))
        loose = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
        if loose:
            raise ValueError(f"zero{self.stage}: parameters {loose} belong to no unit (the root "
                             "module's own parameters); put them in a submodule")
        with torch.no_grad():
            self.comm.broadcast_tensors([p.data for p in self.frozen], src=0)
        broadcast_buffers(self.comm, model, 0)
        attach_comm(model, self.comm)  # SyncBatchNorm shares statistics over these ranks
        return model

    def build_optimizer(self, model, make):
        """ZeroOptimizer over one parameter group per unit, stepping `make`'s optimizer (the
        run's) over this rank's shards only: its state is 1/N of the model's. zero3: over the
        units fully_shard made (the stage follows from them)."""
        groups = [g for g, _ in self._groups]
        inner = lambda groups, **defaults: make(groups)  # noqa: E731 (RunConfig's settings)
        stage = None if self.stage == 3 else self.stage
        opt = ZeroOptimizer(groups, inner, stage=stage, offload=self.offload_to_cpu and
                            stage is not None, comm=self.comm)
        for units, (g, modules) in zip(opt._group_units, self._groups):
            if len(units) > 1:
                raise ValueError(f"unit {g['name']}: parameters of several dtypes "
                                 f"{sorted(str(u.full.dtype) for u in units)}")
            units[0].modules = modules
        self.optimizer, self.units, self.grads = opt, opt.units, opt.grads
        return opt

    def batch(self, data, step):
        if any(True for _ in self.model.buffers()):  # as DDP: rank 0's buffers every step
            broadcast_buffers(self.comm, self.model, 0)
        return read_batch(self, data, step)

    def no_sync(self, model):
        return self.grads.no_sync()

    # -- the step: the optimizer's ------------------------------------------------------------
    def reduce_gradients(self, model):
        """Each unit's gradient shard: the global batch's mean (ZeroOptimizer)."""
        self.grads.reduce_gradients()
        # transient buffers of this step: gathered parameters and flat gradients (zero2/3)
        gathered = self.fsdp.peak["params"] if self.fsdp is not None else 0
        self.comm.note_buffer(gathered + self.grads.grad_bytes_peak)

    def step_gradients(self, model) -> list:
        """The gradient shards the step reads (loss scaling unscales and checks these)."""
        return self.grads.gradient_shards()

    def clip_gradients(self, model, max_norm: float) -> float:
        """Clip by the global norm: ‖g‖² = Σ over ranks of Σ over shards (one all-reduce)."""
        return float(self.grads.clip_grad_norm_(max_norm))

    # -- what this rank holds ----------------------------------------------------------------
    def state_bytes(self, model, optimizer) -> dict:
        """Bytes this rank holds, from the tensors themselves (views of a buffer count once):
        params: zero1/2 the flat buffers (padding included), zero3 the shards plus any unit
        still gathered; grads: zero1 the flat gradient buffers, zero2/3 the gradient shards plus
        any flat gradient still alive; optim: the optimizer's state tensors (and, offloaded on
        CUDA, the CPU master shards), under "optim_offloaded" when cfg.offload."""
        held = units_bytes(self.units, self.stage, optimizer.state,
                           extra_state=[u.master for u in self.units] if self.offload_to_cpu
                           else [])
        params = held["params"] + storage_bytes(self.frozen)
        grads = held["grads"] + storage_bytes([p.grad for p in self.frozen])
        optim = held["optim"]
        if self.cfg.offload:
            return {"params": params, "grads": grads, "optim": 0, "optim_offloaded": optim}
        return {"params": params, "grads": grads, "optim": optim}

    def between_steps(self, model) -> None:
        if self.fsdp is not None:
            self.fsdp.prefetch_forward()

    def step_info(self) -> dict:
        grads, fsdp = self.grads, self.fsdp
        info = {"stage": self.stage, "numel": sum(u.numel for u in self.units),
                "padded": sum(u.padded for u in self.units),
                "shard": sum(u.padded for u in self.units) // self.world,  # P_u = N·S_u
                "units": [[u.name, u.numel, u.padded] for u in self.units],
                "gathered_peak_bytes": fsdp.peak["params"] if fsdp is not None else 0,
                "grad_buffer_peak_bytes": grads.grad_bytes_peak,
                "offload": ("cpu" if self.offload_to_cpu else
                            "cpu (marked only: nothing to move on a CPU run)" if self.cfg.offload
                            else "none")}
        if hasattr(fsdp, "take_copy_seconds"):  # per_param: its copies in and out, this step
            info["layout"], info["copy_s"] = fsdp.layout, fsdp.take_copy_seconds()
        if fsdp is not None:
            done = [g for g in fsdp.gathers if "blocked_s" in g]
            late = [g["blocked_s"] for g in done if g["prefetched"]]
            info["prefetch"] = {"gathers": len(done),
                                "prefetched": sum(g["prefetched"] for g in done),
                                "blocked_s": sum(g["blocked_s"] for g in done),
                                # the split: gathers issued only when needed (the step's
                                # first), and prefetches that had not arrived in time
                                "blocked_unprefetched_s": sum(g["blocked_s"] for g in done
                                                              if not g["prefetched"]),
                                "blocked_prefetched_s": sum(late),
                                "blocked_prefetched_max_s": max(late, default=0.0),
                                # forward's, backward's (and recomputes') blocked time
                                "blocked_by_phase_s": {
                                    ph: sum(g["blocked_s"] for g in done if g["phase"] == ph)
                                    for ph in sorted({g["phase"] for g in done})},
                                # per gather, in issue order: when this rank issued it, needed
                                # it and had it (perf_counter, one clock for every process on
                                # this machine: ranks' records can be set side by side)
                                "timed": [[g["issued"], g["needed"], g["waited"]]
                                          for g in done]}
            fsdp.gathers = [g for g in fsdp.gathers if "blocked_s" not in g]  # in flight
            fsdp.peak = dict(fsdp.live)
        grads.grad_bytes_peak = grads.grad_bytes_live
        return {"zero": info}

    # -- training checkpoints: each unit's flat shard, as DCP's DTensor slice -------------------
    def checkpoint_state(self, model, optimizer, for_load: bool = False) -> dict:
        """This rank's shards of each unit's parameters and optimizer state, as DTensor Shard(0)
        slices of the unit's unpadded flat vector (our shard r is DTensor's chunk r: both cut
        ceil(n/N) entries per rank), so DCP can re-cut them for another world size; plus what
        every rank holds whole (LoRA's frozen base, buffers). Views: DCP loads into them."""
        if for_load:
            materialize_optimizer_state(optimizer)  # tensors for DCP to fill
            optimizer.zero_grad()  # that step's (zero) gradients are not the next step's
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
            if u.master.data_ptr() != u.shard.data_ptr():  # offloaded: the CPU master was loaded
                u.shard.copy_(u.master.detach())
            if self.stage < 3:  # every rank's full parameters from the loaded shards
                self.comm.all_gather(u.full, u.shard)

    loads_canonical = True  # a replicated or FSDP2 checkpoint too (distlab.checkpoint.reshard)

    def load_canonical(self, model, optimizer, state: dict) -> None:
        """A checkpoint of another layout, per parameter: each unit's parameters (and their
        optimizer state) side by side, padded as the unit is, and this rank's block of that."""
        materialize_optimizer_state(optimizer)
        optimizer.zero_grad()  # that step's (zero) gradients are not the next step's
        names = {id(p): n for n, p in model.named_parameters()}
        for u in self.units:
            order = [names[id(p)] for p in u.params]
            S = u.master.numel()

            def block(tensors):  # this rank's S entries of the unit's padded flat vector
                flat = torch.cat([t.reshape(-1) for t in tensors])
                flat = torch.nn.functional.pad(flat, (0, S * self.world - flat.numel()))
                return flat[self.rank * S:(self.rank + 1) * S]
            with torch.no_grad():
                u.master.copy_(block([state["model"][n] for n in order]))
                for key, v in optimizer.state.get(u.master, {}).items():
                    saved = [state["optim"][n][key] for n in order]
                    v.copy_(block(saved) if v.shape == u.master.shape else saved[0])
        with torch.no_grad():
            for p in self.frozen:
                p.copy_(state["model"][names[id(p)]])
            for name, b in persistent_buffers(model).items():
                b.copy_(state["model"][name])
        self.load_checkpoint_state(model, optimizer, {})

    def local_canonical(self, model, optimizer) -> dict:
        """This rank's parameters and their optimizer state named per parameter, each whole
        over the ZeRO group (the state's shards all-gathered: a collective), in the shapes this
        rank's model gives them (a tensor-parallel block under 3d). zero1/2: the parameters
        are whole on every rank already."""
        names = {id(p): n for n, p in model.named_parameters()}
        optim: dict = {}
        for u in self.units:
            for key, v in optimizer.state.get(u.master, {}).items():
                if v.shape != u.master.shape:  # AdamW's step: one per unit
                    for p in u.params:
                        optim.setdefault(names[id(p)], {})[key] = v.clone()
                    continue
                flat = self.comm.all_gather(v.new_empty(v.numel() * self.world), v.contiguous(),
                                            kind="checkpoint")
                offset = 0
                for p in u.params:
                    optim.setdefault(names[id(p)], {})[key] = (
                        flat[offset: offset + p.numel()].view(p.shape).clone())
                    offset += p.numel()
        return {"model": dict(model.state_dict()), "optim": optim}

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
    """P_os+g+p: optimizer state, gradients and parameters sharded. cfg.fsdp_layout picks
    fully_shard's layout: "flat" (the units above) or "per_param" (FSDP2's DTensor shards,
    distlab.parallel.zero.per_param: the run's torch optimizer steps them directly)."""
    name = "zero3"
    knobs = frozenset({"param_dtype", "reduce_dtype", "fsdp_units", "fsdp_prefetch",
                       "fsdp_layout", "fp8_all_gather"})
    checkpoint_layout = "ZeRO units: one per block"

    stage = zero_stage = 3

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.fsdp_layout != "per_param":
            return
        for field, value in (("fp8_all_gather", cfg.fp8_all_gather), ("offload", cfg.offload),
                             ("checkpoint_every", cfg.checkpoint_every),
                             ("resume_from", cfg.resume_from)):
            if value:
                raise ValueError(f"{field}={value!r} with fsdp_layout='per_param': written for "
                                 "the flat units only; use fsdp_layout='flat'")

    @property
    def per_param(self) -> bool:
        return self.cfg.fsdp_layout == "per_param"

    def wrap(self, model):
        if not self.per_param:
            return super().wrap(model)
        self.offload_to_cpu, self.frozen, self.model = False, [], model  # frozen: sharded too
        fully_shard(model, units=units_of(self.cfg, model), comm=self.comm,
                    mp_policy=mixed_precision_policy(self.cfg),
                    prefetch=self.cfg.fsdp_prefetch, layout="per_param")
        self.fsdp = model._distlab_fsdp
        return model

    def build_optimizer(self, model, make):
        """per_param: the run's optimizer over the DTensor shards (its state is theirs: 1/N)."""
        if not self.per_param:
            return super().build_optimizer(model, make)
        self.optimizer = make([p for p in model.parameters() if p.requires_grad])
        self.units, self.grads = self.fsdp.units, self.fsdp
        return self.optimizer

    def state_bytes(self, model, optimizer) -> dict:
        if not self.per_param:
            return super().state_bytes(model, optimizer)
        return self.fsdp.local_bytes(optimizer)

    def full_state_dict(self, model) -> dict:
        """per_param: state_dict() is the shards; their whole tensors are gathered here."""
        return self.fsdp.full_state_dict() if self.per_param else super().full_state_dict(model)
