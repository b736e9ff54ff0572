"""Checkpoints of the strategies that split the model (tp, pp, 3d, mesh): a replica's full
format (distlab.checkpoint's "replicated" layout, which ddp reads as its own) gathered from
pipeline stages, tensor-parallel blocks and ZeRO shards, and each rank's part cut back out of any
checkpoint named per parameter (distlab.checkpoint.reshard).

Saving (collectives: every rank calls it): ZeRO's optimizer shards are all-gathered over its
group and cut per parameter (ZeRO.local_canonical); tp's blocks are gathered over tp
(tensor.parallelize.full_state_dict, for the weights and for AdamW's moments alike); the stages'
dicts over pp (all_gather_object). Loading: each rank keeps the tensors its stage holds, cuts its
tp block of each (tensor.parallelize.local_block), and ZeRO takes its shard of those.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def single_order(cfg) -> list[str]:
    """The names of the parameters `single`'s optimizer steps, in its order: the unsplit GPT's,
    built without memory (the meta device)."""
    from distlab.models.gpt import GPT, GPTConfig
    with torch.device("meta"):
        whole = GPT(GPTConfig.from_run(cfg, moe_groups=cfg.moe_groups_per_rank))
    return [n for n, p in whole.named_parameters() if p.requires_grad]


def replica_format(stage: dict, optimizer, order: list[str], pp_comm=None) -> dict:
    """A replica's full format from each stage's {"model": {name: tensor}, "optim": {name:
    {key: tensor}}} of whole tensors, gathered over pp_comm when given and merged; the
    optimizer's state by index into `order` (single's trainable parameters), in one group with
    this optimizer's settings."""
    parts = [stage]
    if pp_comm is not None:
        parts = [None] * pp_comm.world
        dist.all_gather_object(parts, stage, group=pp_comm.group)
    merged = {k: v for part in parts for k, v in part["model"].items()}
    optim = {k: v for part in parts for k, v in part["optim"].items()}
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    group["params"] = list(range(len(order)))
    return {"model": merged,
            "optimizer": {"state": {i: optim[n] for i, n in enumerate(order)} if optim else {},
                          "param_groups": [group]}}


def composed_state(model, optimizer, order: list[str], tp_s=None, pp_s=None,
                   dp_s=None) -> dict:
    """This rank's model and optimizer gathered whole (ZeRO over dp_s, tp's blocks, the
    stages over pp_s) into a replica's full format, the state by index into `order`."""
    from distlab.parallel.tensor.parallelize import full_state_dict
    if dp_s is not None:
        local = dp_s.local_canonical(model, optimizer)
    else:
        names = {id(p): n for n, p in model.named_parameters()}
        local = {"model": dict(model.state_dict()),
                 "optim": {names[id(p)]: dict(s) for p, s in optimizer.state.items()}}
    if tp_s is not None:
        params = dict(model.named_parameters())
        keys = {k for s in local["optim"].values() for k in s}
        moments = {k for k in keys  # shaped like their parameters (AdamW's step is not)
                   if all(s[k].shape == params[n].shape for n, s in local["optim"].items())}
        whole = {k: full_state_dict(model, {n: s[k] for n, s in local["optim"].items()})
                 for k in sorted(moments)}
        local = {"model": full_state_dict(model, local["model"]),
                 "optim": {n: {k: whole[k][n] if k in moments else v for k, v in s.items()}
                           for n, s in local["optim"].items()}}
    return replica_format(local, optimizer, order, pp_s.comm if pp_s is not None else None)


def composed_load(strategy, model, optimizer, state: dict, dp_s=None) -> None:
    """This rank's part of a checkpoint named per parameter: the tensors its stage holds, its
    tp block of each, then ZeRO's shard of those (dp_s) or all of them."""
    from distlab.parallel.base import Strategy
    from distlab.parallel.tensor.parallelize import local_block
    mine = set(model.state_dict())
    local = {"model": {n: local_block(model, n, t) for n, t in state["model"].items()
                       if n in mine},
             "optim": {n: {k: local_block(model, n, v) if v.dim() else v for k, v in s.items()}
                       for n, s in state["optim"].items() if n in mine}}
    if dp_s is not None:
        dp_s.load_canonical(model, optimizer, local)
    else:
        Strategy.load_canonical(strategy, model, optimizer, local)


def from_replica(state: dict, order: list[str]) -> dict:
    """A replica's full format (state.pt) named per parameter, its state by index into
    `order`."""
    return {"model": state["model"],
            "optim": {order[int(i)]: s for i, s in state["optimizer"]["state"].items()}}


class ComposedCheckpoints:
    """Strategy methods for checkpoints of a model split by pipeline stages (pp_s), tensor
    parallelism (tp_s) and ZeRO (dp_s), any of them None: put before Strategy in the bases.
    Single's parameter order comes from the unsplit GPT; a strategy whose rank holds every
    parameter (tp, any model) takes Strategy's, from its own model."""
    checkpoint_layout = "replicated"  # ddp reads it as its own; the others per parameter
    loads_canonical = True  # and this strategy reads any of theirs
    tp_s = pp_s = dp_s = None

    def trainable_order(self, model) -> list[str]:
        return single_order(self.cfg)

    def checkpoint_state(self, model, optimizer, for_load: bool = False) -> dict:
        return composed_state(model, optimizer, self.trainable_order(model), self.tp_s,
                              self.pp_s, self.dp_s)

    def load_checkpoint_state(self, model, optimizer, state: dict) -> None:
        self.load_canonical(model, optimizer,
                            from_replica(state, self.trainable_order(model)))

    def load_canonical(self, model, optimizer, state: dict) -> None:
        composed_load(self, model, optimizer, state, self.dp_s)
