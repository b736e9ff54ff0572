"""Any elementwise torch optimizer over a distlab.fully_shard model: FSDP2's habit

    distlab.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)   # after sharding, as with FSDP2
    loss.backward(); opt.step(); opt.zero_grad()

trains the shards, exactly as distlab.ZeroOptimizer over the same parameters does.

**The mechanism.** At construction each parameter group's sharded parameters are replaced by
their units' master shards (one flat (S,) tensor per unit: the same tensors a ZeroOptimizer's
inner optimizer steps), so the optimizer's state is this rank's 1/N, its state_dict is this
rank's shard, and an lr schedule over its param_groups works as usual. Before each step() a
hook finishes the gradients' reduce-scatters and gives each master its gradient shard as
.grad; after it the updated shard is what the next forward gathers. The optimizer's
zero_grad() (set_to_none, its default) empties those .grad; the next backward sees that and
starts the shards from zero, so gradients accumulate across backwards exactly when torch's
would.

Why not DTensor parameters, as FSDP2 has: distlab keeps the ZeRO paper's flat units (one
all-gather per unit, a parameter's entries may straddle two ranks' shards), and a DTensor
placement cannot describe a piece of a flattened parameter (Shard(0) cuts each parameter by
rows). So the model's own parameters keep .grad None; distlab.grad_shard(p) is this rank's
piece and distlab.full_grad(p) the whole mean gradient (a collective, as FSDP2's
p.grad.full_tensor()).

**Only elementwise optimizers.** Stepping a flat shard computes what stepping whole tensors
does only when the update of each entry depends on that entry alone: SGD, Adam, AdamW,
Adagrad, Adamax, NAdam, RAdam, RMSprop, Rprop, ASGD, Adadelta (and their subclasses). Any
other class (LBFGS's global dot products, Adafactor's row and column statistics, Muon's
matrix updates) would step wrong in silence over flat shards, so its construction raises.

Installed the first time fully_shard shards a model: torch.optim.Optimizer.add_param_group is
wrapped (every optimizer's constructor calls it for each group); groups holding no
fully_shard parameter pass through unchanged.
"""

from __future__ import annotations

import torch

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
               torch.optim.Rprop, torch.optim.ASGD, torch.optim.Adadelta)

_TORCH_ADD_PARAM_GROUP = torch.optim.Optimizer.add_param_group


def install() -> None:
    """Wrap torch.optim.Optimizer.add_param_group (once)."""
    if torch.optim.Optimizer.add_param_group is _TORCH_ADD_PARAM_GROUP:
        torch.optim.Optimizer.add_param_group = add_param_group


def add_param_group(self, param_group: dict) -> None:
    """torch's add_param_group; then a group of a fully_shard model's parameters steps its
    units' shards instead."""
    _TORCH_ADD_PARAM_GROUP(self, param_group)
    from distlab.parallel.zero.optimizer import ZeroOptimizer  # it adopts the units itself
    if not isinstance(self, ZeroOptimizer):
        bind_group(self, self.param_groups[-1])


def bind_group(optimizer, group: dict) -> None:
    held = [p for p in group["params"] if getattr(p, "_distlab_fsdp", None) is not None]
    if not held:
        return
    name = type(optimizer).__name__
    if not isinstance(optimizer, ELEMENTWISE):
        raise TypeError(
            f"{name} over a model distlab.fully_shard sharded: its parameters are stepped as "
            "flat shards (pieces of several parameters side by side), which only an "
            "elementwise optimizer (SGD, Adam, AdamW, Adagrad, Adamax, NAdam, RAdam, RMSprop, "
            f"Rprop, ASGD, Adadelta) steps as it would whole tensors; {name} is not known to "
            "be one. Use one of those, or train this model without fully_shard")
    fsdp = held[0]._distlab_fsdp
    if any(p._distlab_fsdp is not fsdp for p in held):
        raise ValueError(f"a parameter group of {name} holds parameters of two models "
                         "distlab.fully_shard sharded: build one optimizer per model")
    units = fsdp.adopt(optimizer, held)
    ids = {id(p) for p in held}
    group["params"] = [p for p in group["params"] if id(p) not in ids] + [u.master
                                                                          for u in units]
    if not getattr(optimizer, "_distlab_bound", None):
        optimizer._distlab_bound = fsdp
        optimizer.register_step_pre_hook(_before_step)
        optimizer.register_step_post_hook(_after_step)


def _before_step(optimizer, args, kwargs) -> None:
    """The mean gradient's shard as each master's .grad (the reduce-scatters finished)."""
    fsdp = optimizer._distlab_bound
    fsdp.reduce_gradients()
    for u in fsdp.units:
        if u.master.grad is None or u.master.grad.data_ptr() != u.grad_shard.data_ptr():
            u.master.grad = u.grad_shard.to(u.master.device)  # offload: the CPU master's copy


def _after_step(optimizer, args, kwargs) -> None:
    fsdp = optimizer._distlab_bound
    with torch.no_grad():
        for u in fsdp.units:
            if u.master.data_ptr() != u.shard.data_ptr():  # offloaded: back from the CPU
                u.shard.copy_(u.master.detach())
    fsdp.stepped_by_plain = True  # the next backward checks whether zero_grad() ran


def forget_zeroed(fsdp) -> None:
    """Start of a backward after a plain optimizer's step: a unit whose master .grad the
    optimizer's zero_grad() emptied starts its gradient from zero (torch's semantics: no
    zero_grad(), the gradients accumulate)."""
    if not getattr(fsdp, "stepped_by_plain", False):
        return
    fsdp.stepped_by_plain = False
    for u in fsdp.units:
        g = u.master.grad
        emptied = g is None or (g.data_ptr() != u.grad_shard.data_ptr() and not g.any())
        if emptied:  # (an offloaded master's .grad is a copy: zeroed in place, not None)
            fsdp.zero_unit_grad(u, drop_loose=False)
