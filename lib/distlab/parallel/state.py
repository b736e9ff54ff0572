"""The strategy side of training checkpoints: what a strategy uses to hand its state to
distlab.checkpoint (Strategy.checkpoint_state). The optimizer's state made before a load, the
DTensor view of a flat shard that lets torch.distributed.checkpoint (DCP) re-cut it for another
world size, the persistent buffers, and the error both sides raise. distlab.checkpoint reads
these; nothing here imports it.
"""

from __future__ import annotations

import torch


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt, or written by an incompatible run."""


def materialize_optimizer_state(optimizer):
    """Create the optimizer's state tensors (AdamW's moments) so a checkpoint can be loaded
    into them in place: one step with zero gradients at lr 0, which leaves every parameter
    bitwise unchanged (p·(1 - 0·wd) and p - 0·m/(√v+ε) are p). torch's
    torch.distributed.checkpoint.state_dict does the same (_init_optim_state)."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads, lrs = [p.grad for p in params], [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for p, grad in zip(params, grads):
        p.grad = grad
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


# -- the sharded state: what each rank hands DCP ---------------------------------------------
_MESHES: dict = {}


def _mesh(device: torch.device, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    key = (device.type, world)
    if key not in _MESHES:  # 1-D over every rank: it reuses the default process group
        _MESHES[key] = init_device_mesh(device.type, (world,))
    return _MESHES[key]


def flat_shard(t: torch.Tensor, numel: int, rank: int, world: int):
    """Rank r's shard of a unit's padded flat vector as a DTensor piece of the unpadded one:
    entries [r·S, r·S + valid) of `numel`, S = ceil(numel / N), DTensor's own Shard(0) cut.
    (The mesh is the tensor's device's: ZeRO-Offload keeps the optimizer's shards on the CPU.)"""
    from torch.distributed.tensor import DTensor, Shard
    mesh = _mesh(t.device, world)
    S = t.numel()
    valid = max(0, min(S, numel - rank * S))
    return DTensor.from_local(t.detach()[:valid], mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([numel]), stride=(1,))


def persistent_buffers(model) -> dict:
    out = {}
    for mod_name, mod in model.named_modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{name}" if mod_name else name] = b
    return out
