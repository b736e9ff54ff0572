"""Resuming a checkpoint under another strategy: the state named one parameter at a time.

Each strategy writes its own layout (Strategy.checkpoint_layout): "replicated" holds the
model's state_dict and the optimizer's state by parameter index; ZeRO's units hold each unit's
flat vector (its parameters side by side, distlab.parallel.zero.optimizer.Unit) and the
optimizer's state cut the same way; FSDP2 holds DTensors by parameter name. They are the same
numbers. The canonical form names them as `single` does:

    {"model": {name: tensor},                  # parameters, frozen ones and buffers
     "optim": {name: {"exp_avg": ..., ...}},   # the optimizer's state of each trained parameter
     "scaler": {...} or None}                  # the loss scaler's numbers

canonical() reads any of these layouts into it, without a process group; a strategy's
load_canonical() takes its own part (a replica all of it, a ZeRO rank its shard of each unit).
Within a layout, DCP re-cuts the shards and each rank reads only its part; across layouts every
rank reads the whole checkpoint, the model and its optimizer state in memory once per rank while
loading: right for the workbook's models, and what torch's own converter
(torch.distributed.checkpoint.format_utils.dcp_to_torch_save, used here) does too.
"""

from __future__ import annotations

import os

from distlab.checkpoint.store import (DCP_DIR, FSDP2, REPLICATED, STATE, cut_unit, dcp_tensors,
                                      family, torch_load)
from distlab.parallel.state import CheckpointError


def canonical(path: str, meta: dict, trainable: list[str]) -> dict:
    """The checkpoint at `path` in the canonical form. `trainable`: the names of the parameters
    the optimizer steps, in the model's order (a replicated checkpoint's optimizer state is by
    index into them)."""
    kind = family(meta["layout"])
    if kind == REPLICATED:
        state = torch_load(os.path.join(path, STATE))
        by_index = state["optimizer"]["state"]
        if by_index and len(by_index) != len(trainable):
            raise CheckpointError(f"{path}: its optimizer holds state for {len(by_index)} "
                                  f"parameters; this model trains {len(trainable)}")
        optim = {trainable[int(i)]: dict(s) for i, s in by_index.items()}
        return {"model": dict(state["model"]), "optim": optim, "scaler": state.get("scaler")}
    if kind is None:
        raise CheckpointError(f"{path}: layout {meta['layout']!r} has no per-parameter reader")
    tensors = dcp_tensors(os.path.join(path, DCP_DIR))
    scaler = {k.split("/", 1)[1]: v.item() for k, v in tensors.items() if k.startswith("scaler/")}
    model = {k.split("/", 1)[1]: v for k, v in tensors.items()
             if k.split("/", 1)[0] in ("model", "frozen", "buffer")}
    if kind == FSDP2:  # get_optimizer_state_dict's {"state": {name: {key: tensor}}}
        optim: dict = {}
        for k, v in tensors.items():
            if k.startswith("optim/state/"):
                name, key = k[len("optim/state/"):].rsplit("/", 1)
                optim.setdefault(name, {})[key] = v
        return {"model": model, "optim": optim, "scaler": scaler or None}
    optim: dict = {name: {} for _, params in meta["units"] for name, _ in params}
    for unit, params in meta["units"]:  # cut each unit's flat vectors into its parameters
        flat = model.pop(unit)
        model.update(cut_unit(flat, params))
        for k, v in tensors.items():
            if k.startswith(f"optim/{unit}/"):
                key = k.rsplit("/", 1)[1]
                cut = (cut_unit(v, params) if v.numel() == flat.numel()
                       else {name: v for name, _ in params})  # AdamW's step: one per unit
                for name, t in cut.items():
                    optim[name][key] = t
    return {"model": model, "optim": optim, "scaler": scaler or None}
