"""torch's own ZeRO-1 and FSDP2: the references `zero1` and `zero3` (distlab.parallel.zero.stages) are
checked against.

`zero1-torch`: torch.distributed.optim.ZeroRedundancyOptimizer over torch's DDP model. DDP
all-reduces the full gradients during backward (through the same counting comm hook as
`ddp-torch`, so Comm books 2(N-1)/N·4Ψ per step); ZeroRedundancyOptimizer gives each rank whole
parameter tensors, assigned greedily by size (so the partition is only about 1/N), steps only
those, then every rank broadcasts its updated partition to the others:

    DDP all-reduce (Ψ, every rank gets the full mean gradient) ──► step own partition
        ──► N broadcasts (one per owner)

Those broadcasts are issued inside torch and bypass Comm; step_info()["zero1_torch"] gives the
partition sizes and the bytes a pipelined chain broadcast of each partition moves per rank (the
convention Comm.broadcast books). So torch's ZeRO-1 moves about 3(N-1)/N·4Ψ per rank per step,
where distlab's `zero1` (reduce-scatter + all-gather) moves 2(N-1)/N·4Ψ, DDP's volume: the
all-reduce already delivers every rank the full gradient, of which it then uses 1/N.

`fsdp-torch`: FSDP2, `fully_shard` on each block (each ModuleList item, as distlab's units) and
then on the root (which takes the embeddings, final norm and head) over a 1-D device mesh of all
ranks. Parameters become DTensors sharded on dim 0; each group's parameters are all-gathered
before its forward and again before its backward (the root's stay gathered between forward and
backward: FSDP2 does not reshard the root after forward), and gradients are reduce-scattered
per group. RunConfig.precision bf16/fp16 sets MixedPrecisionPolicy(param_dtype=that,
reduce_dtype=float32); cfg.offload sets CPUOffloadPolicy(pin_memory=False) (pinned memory needs
an accelerator). Its collectives are torch's own, not counted by Comm.

HSDP (RunConfig.shard_ranks = g, fewer than the world): the mesh is 2-D, world/g replicas ×
g shards (init_device_mesh((world // g, g), ("replicate", "shard"))), so each group of g
consecutive ranks (a node, when a node holds g ranks) shards the model among itself and the
groups replicate it: the all-gathers and reduce-scatters stay inside a group, and only the
gradient shards' all-reduce crosses between groups, 2(n−1)/n × S/g per rank, n = world/g (Zhao
et al. 2023, "PyTorch FSDP", Section 3.2.2, hybrid sharding): that formula is
distlab.theory.comm_bytes.hsdp_link_bytes, over FSDP2's padded shards (fsdp2_shard_bytes).

Memory for both comes from local tensors: a DTensor counts its local shard (`to_local()`).
With FSDP2's CPU offload, sharded parameters, gradients and optimizer state all live on the CPU:
they are reported as params_offloaded / grads_offloaded / optim_offloaded.

Model state dicts: FSDP2's are DTensors; a state-dict hook replaces each by its full tensor (an
all-gather on every rank), so `train_with_state` compares plain tensors with `single`'s.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from distlab.parallel.base import Strategy
from distlab.parallel.data_parallel.ddp_torch import TorchDDP
from distlab.parallel.state import persistent_buffers
from distlab.parallel.zero.stages import find_units
from distlab.units import dtype_of, tensor_bytes



def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    return sum(tensor_bytes(t) for t in tensors)


def local_state_bytes(model, optim_state: dict) -> dict:
    """Bytes of this rank's parameters, gradients and optimizer state, DTensors by local shard."""
    params = list(model.parameters())
    state = [v for s in optim_state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": _bytes(params), "grads": _bytes(p.grad for p in params),
            "optim": _bytes(state)}


def chain_broadcast_bytes(sizes: list[int], rank: int) -> tuple[int, int]:
    """(sent, received) by `rank` when every rank src broadcasts sizes[src] bytes along the
    chain src -> src+1 -> ...: everyone but the chain's last sends, everyone but src receives."""
    n = len(sizes)
    sent = sum(s for src, s in enumerate(sizes) if (rank - src) % n < n - 1)
    recv = sum(s for src, s in enumerate(sizes) if (rank - src) % n > 0)
    return sent, recv


class TorchZeRO1(TorchDDP):
    """torch DDP + ZeroRedundancyOptimizer (wrap, no_sync, the counting hook: TorchDDP's)."""
    name = "zero1-torch"
    replicated = False  # torch DDP's model, but the optimizer state is partitioned
    knobs = frozenset()  # nor TorchDDP's knobs (bucket_mb, compress): tested for ddp-torch only
    supports = Strategy.supports  # not TorchDDP's extras: written and tested for ddp-torch only
    checkpoint_layout = "ZeroRedundancyOptimizer, consolidated"
    loads_canonical = False  # its optimizer's state is partitioned: not written for it

    def build_optimizer(self, model, make):
        probe = make([torch.nn.Parameter(torch.zeros(1))])  # RunConfig's class and settings
        # imported here: torch.distributed.optim takes ~0.2 s, which every RunConfig (reading
        # every strategy's knobs) would otherwise pay
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(
            [p for p in model.parameters() if p.requires_grad], optimizer_class=type(probe),
            process_group=self.comm.group, lr=probe.defaults["lr"],
            weight_decay=probe.defaults["weight_decay"])
        local = sum(p.numel() * p.element_size()
                    for g in optimizer.optim.param_groups for p in g["params"])
        device = next(model.parameters()).device
        sizes = torch.zeros(self.world, dtype=torch.int64, device=device)
        self.comm.all_gather(sizes, torch.tensor([local], device=device))  # setup traffic
        self.partition_bytes = sizes.tolist()
        return optimizer

    def state_bytes(self, model, optimizer) -> dict:
        return local_state_bytes(model, optimizer.optim.state)  # the local optimizer's state

    def checkpoint_state(self, model, optimizer, for_load: bool = False) -> dict:
        """The full format from rank 0: consolidate_state_dict gathers every rank's partition
        of the optimizer state there first (a collective: every rank calls it)."""
        optimizer.consolidate_state_dict(to=0)
        return super().checkpoint_state(model, optimizer) if self.rank == 0 else {}

    def step_info(self) -> dict:
        info = super().step_info()
        sent, recv = chain_broadcast_bytes(self.partition_bytes, self.rank)
        info["zero1_torch"] = {"partition_bytes": self.partition_bytes,
                               "broadcast_modeled": {"bytes_sent": sent, "bytes_recv": recv}}
        return info


class TorchFSDP(Strategy):
    """FSDP2: fully_shard per block, then the root (HSDP with shard_ranks)."""
    name = "fsdp-torch"
    books_all_traffic = False  # torch sends bytes of its own
    knobs = frozenset({"shard_ranks"})
    supports = Strategy.supports | {"offload"}
    checkpoint_layout = "FSDP2 DTensors"
    checkpoint_format = "sharded"

    @classmethod
    def check_config(cls, cfg):
        g = cfg.shard_ranks
        if not isinstance(g, int) or g < 0 or (g and cfg.world_size % g):
            raise ValueError(f"shard_ranks={g!r} must be 0 (shard over all {cfg.world_size} "
                             f"ranks) or divide world_size={cfg.world_size} (HSDP: shard inside "
                             "groups of that many ranks, replicate across the groups)")

    def wrap(self, model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                            OffloadPolicy, fully_shard)

        device = next(model.parameters()).device
        with torch.no_grad():  # every rank starts from rank 0's weights
            self.comm.broadcast_tensors(
                [t.data for t in list(model.parameters()) + list(model.buffers())], src=0)
        g = self.cfg.shard_ranks or self.world
        mesh = (init_device_mesh(device.type, (self.world // g, g),
                                 mesh_dim_names=("replicate", "shard"))  # HSDP
                if g < self.world else init_device_mesh(device.type, (self.world,)))
        dtype = None if self.cfg.precision == "fp32" else dtype_of(self.cfg.precision)
        kwargs = {"mesh": mesh,
                  "mp_policy": (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
                                if dtype else MixedPrecisionPolicy()),
                  "offload_policy": (CPUOffloadPolicy(pin_memory=False) if self.cfg.offload
                                     else OffloadPolicy())}
        for name, modules in find_units(model):
            if len(modules) == 1 and name.rsplit(".", 1)[-1].isdigit():  # a ModuleList item
                fully_shard(modules[0], **kwargs)
        fully_shard(model, **kwargs)
        hook = lambda module, sd, prefix, meta: _full_tensors(sd)  # noqa: E731
        model.register_state_dict_post_hook(hook)
        return model

    def no_sync(self, model):
        @contextlib.contextmanager
        def local_accumulation():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return local_accumulation()

    def reduce_gradients(self, model):
        """Nothing: FSDP reduce-scattered every group's gradients during backward."""

    def clip_gradients(self, model, max_norm: float) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # a DTensor: the global norm
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def state_bytes(self, model, optimizer) -> dict:
        b = local_state_bytes(model, optimizer.state)
        if self.cfg.offload:  # CPUOffloadPolicy: shards, gradients and the step on the CPU
            return {**{k: 0 for k in b}, **{f"{k}_offloaded": v for k, v in b.items()}}
        return b

    # -- training checkpoints: FSDP2's DTensors as they are ------------------------------------
    def checkpoint_state(self, model, optimizer, for_load: bool = False) -> dict:
        """FSDP2's DTensor parameters and get_optimizer_state_dict's DTensor state (for_load:
        torch creates the optimizer state to fill)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = {f"model/{n}": p.detach() for n, p in model.named_parameters()}
        state.update({f"buffer/{n}": b for n, b in persistent_buffers(model).items()})
        if optimizer.state or for_load:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        return state

    def load_checkpoint_state(self, model, optimizer, state: dict) -> None:
        if "optim" in state:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
            set_optimizer_state_dict(model, optimizer, state["optim"])


def _full_tensors(sd: dict):
    for k, v in sd.items():
        if hasattr(v, "full_tensor"):
            sd[k] = _whole(v)


def _whole(v) -> torch.Tensor:
    """A DTensor parameter's whole tensor. Over gloo, with c10d's all_gather on each sharded
    mesh dimension: DTensor.full_tensor() gathers with functional collectives, which crashed the
    rank (SIGSEGV in the collective's wait) over gloo with CUDA tensors (two ranks sharing one
    H200, torch 2.11, 2026-11-26), where c10d's all_gather works. NCCL keeps full_tensor()."""
    mesh = v.device_mesh
    shards = [(i, p.dim) for i, p in enumerate(v.placements) if p.is_shard()]
    if (len(shards) > 1 or any(p.is_partial() for p in v.placements)
            or dist.get_backend(mesh.get_group(0)) != "gloo"):
        return v.full_tensor()
    t = v.to_local()
    for mesh_dim, dim in shards:
        t = _gather_chunks(t, dim, v.shape[dim], mesh.get_group(mesh_dim))
    return t


def _gather_chunks(local: torch.Tensor, dim: int, length: int, group) -> torch.Tensor:
    """The whole tensor from each rank's torch.chunk piece along `dim` (FSDP2's Shard(dim):
    pieces of ceil(length / n), the last ones shorter or empty), padded to equal sizes for the
    all_gather and trimmed after."""
    n = dist.get_world_size(group)
    chunk = -(-length // n)
    sizes = [max(0, min(chunk, length - r * chunk)) for r in range(n)]
    pad = list(local.shape)
    pad[dim] = chunk - local.shape[dim]
    padded = torch.cat([local, local.new_zeros(pad)], dim) if pad[dim] else local.contiguous()
    pieces = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([p.narrow(dim, 0, k) for p, k in zip(pieces, sizes)], dim)


def fsdp2_shard_bytes(shapes, shard_ranks: int, element_bytes: int = 4) -> int:
    """Bytes of one rank's gradient shards under FSDP2 sharding over `shard_ranks` ranks: each
    parameter cut on dim 0, padded up to a multiple of the ranks (what its reduce-scatter
    returns, and HSDP's all-reduce then sends)."""
    return sum(-(-(s[0] if s else 1) // shard_ranks) * math.prod(s[1:])
               for s in shapes) * element_bytes
