"""Exercise: a ZeRO-1 optimizer step (Rajbhandari et al. 2020, P_os).

    def zero1_step(flat_param, flat_grad, momentum, rank, world, lr, mu, all_gather):
        # flat_param, flat_grad: the whole model flattened (P values, P divisible by world);
        # flat_grad is already the mean over the ranks. momentum: this rank's optimizer state,
        # P/world values: only for its shard. Step SGD with momentum (m = mu*m + g;
        # p = p - lr*m) on this rank's shard, then give every rank every shard:
        # all_gather(out, shard) writes each rank's shard, in rank order, into out.

Every rank keeps the optimizer state of 1/N of the parameters and updates only those; one
all-gather, (N-1)/N of the parameters per rank, brings the updated values everywhere.

The check: 4 ranks, 4 steps on P = 1024 values with gradients drawn per step (the same on
every rank, as after an all-reduce); the parameters against one process stepping SGD with
momentum on the whole vector (tolerance 1e-6, float32: the same arithmetic), and the bytes
each all-gather moved against (N-1)/N of the parameters.
"""

from __future__ import annotations

import torch

from distlab.exercises.harness import load, run_exercise

WORLD, P, STEPS, LR, MU = 4, 1024, 4, 0.1, 0.9


def zero1_step(flat_param, flat_grad, momentum, rank, world, lr, mu, all_gather):
    size = flat_param.numel() // world
    mine = slice(rank * size, (rank + 1) * size)
    momentum.mul_(mu).add_(flat_grad[mine])
    all_gather(flat_param, flat_param[mine] - lr * momentum)


reference = zero1_step


def _grad(step: int) -> torch.Tensor:
    return torch.randn(P, generator=torch.Generator().manual_seed(step))


def _start() -> torch.Tensor:
    return torch.randn(P, generator=torch.Generator().manual_seed(99))


def on_rank(rank, world, device, log, name, source):
    import torch.distributed as dist
    fn = load(name, source)
    moved = []

    def all_gather(out, shard):
        shard = shard.detach().contiguous()
        if shard.numel() * world != out.numel():
            raise ValueError(f"all_gather: a shard of {shard.numel()} values for an output of "
                             f"{out.numel()}: each rank gives P/world of them")
        gathered = (dist.all_gather_into_tensor if hasattr(dist, "all_gather_into_tensor")
                    else dist._all_gather_base)
        gathered(out, shard)
        moved.append((world - 1) * shard.numel() * 4)

    param, momentum = _start(), torch.zeros(P // world)
    ref, ref_m = _start(), torch.zeros(P)
    for step in range(STEPS):
        fn(param, _grad(step), momentum, rank, world, LR, MU, all_gather)
        ref_m = MU * ref_m + _grad(step)
        ref = ref - LR * ref_m
    problems = []
    diff = (param - ref).abs().max().item()
    if diff > 1e-6:
        wrong = ((param - ref).abs().view(world, -1).amax(1) > 1e-6).nonzero().flatten()
        problems.append(f"after {STEPS} steps the parameters are off by up to {diff:.3g}; "
                        f"wrong shards: {wrong.tolist()}")
    if len(moved) != STEPS:
        problems.append(f"{len(moved)} all-gathers in {STEPS} steps: one per step")
    return {"problems": problems,
            "facts": [f"after {STEPS} steps every rank's parameters equal one process's SGD "
                      f"with momentum (max |diff| {diff:.1e})",
                      f"optimizer state on each rank: {P // world} of {P} values (1/N); each "
                      f"step's all-gather sent {moved[0] if moved else 0:,} B = (N-1)/N of "
                      f"{P * 4:,} B"]}


def check(fn, timeout_s: float = 20.0):
    return run_exercise("ZeRO-1 step", on_rank, fn, WORLD, timeout_s=timeout_s)
