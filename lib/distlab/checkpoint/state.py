"""What a rank's checkpointed state is made of, besides the model and optimizer tensors each
strategy hands over (Strategy.checkpoint_state): the random-number states, the loss scaler as
tensors, persistent buffers, and the DTensor view of a flat shard that lets
torch.distributed.checkpoint (DCP) re-cut it for another world size.
"""

from __future__ import annotations

import random

import numpy as np
import torch

def rng_state(device: torch.device) -> dict:
    """Every random-number state a rank may draw from, as tensors and plain numbers."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device):
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


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


def scaler_tensors(scaler) -> dict:
    return {f"scaler/{k}": torch.tensor(v, dtype=torch.float64)
            for k, v in scaler.state_dict().items()}


def persistent_buffers(model) -> dict:
    out = {}
    for mod_name, mod in model.named_modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{name}" if mod_name else name] = b
    return out
