"""Exercise: DDP's bucket hook (Li et al. 2020, "PyTorch Distributed", Section 3.2.3).

    def bucket_hook(grads, world, all_reduce):
        # grads: one bucket's gradients (a list of tensors), ready as backward produced them.
        # Make each the mean over the ranks, in place. all_reduce(t) sums t over the ranks
        # in place; every call is one collective on the wire.

DDP groups gradients into buckets and launches one all-reduce per bucket as soon as its last
gradient is in, while backward still runs for the layers before it: few, large collectives
that overlap with compute. One all-reduce per gradient would pay a latency per tensor.

The check: 2 ranks, a 4-layer MLP, each rank its half of the global batch; the hook is called
by gradient hooks during backward, once per bucket (2 buckets). The gradients after backward
against one process's on the whole batch (tolerance 1e-6: float32, only the summation order
differs), the number of all-reduces against the number of buckets, and their bytes against
2(N-1)/N of the gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distlab.exercises.harness import load, run_exercise

WORLD, ROWS = 2, 8


def bucket_hook(grads, world, all_reduce):
    flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for the whole bucket
    all_reduce(flat)
    flat /= world
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


reference = bucket_hook


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 2, generator=g)


def _buckets(model) -> list[list[nn.Parameter]]:
    """Parameters in reverse order (the order backward produces them), two buckets."""
    params = list(model.parameters())[::-1]
    half = len(params) // 2
    return [params[:half], params[half:]]


def on_rank(rank, world, device, log, name, source):
    import torch.distributed as dist
    fn = load(name, source)
    model, calls = _model(), []
    buckets = _buckets(model)
    pending = [set(id(p) for p in b) for b in buckets]

    def all_reduce(t):
        calls.append(t.numel() * t.element_size())
        dist.all_reduce(t)

    def ready(p):  # a gradient is in: when its bucket's last one is, the hook runs
        for k, b in enumerate(buckets):
            if id(p) in pending[k]:
                pending[k].discard(id(p))
                if not pending[k]:
                    fn([q.grad for q in b], world, all_reduce)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(ready)
    x, y = _batch()
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    F.mse_loss(model(x[rows]), y[rows]).backward()

    ref = _model()
    F.mse_loss(ref(x), y).backward()
    problems = []
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(),
                                                                    ref.parameters()))
    if diff > 1e-6:
        problems.append(f"gradients differ from one process's by up to {diff:.3g} (a sum not "
                        "divided by the ranks, or a bucket not reduced?)")
    if len(calls) != len(buckets):
        problems.append(f"{len(calls)} all-reduces for {len(buckets)} buckets: reduce each "
                        "bucket in one collective (flatten it)")
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    if sum(calls) != grad_bytes:
        problems.append(f"all-reduced {sum(calls):,} B of gradients; they are {grad_bytes:,} B")
    return {"problems": problems,
            "facts": [f"gradients equal one process's on the whole batch (max |diff| "
                      f"{diff:.1e})",
                      f"{len(calls)} all-reduces, one per bucket, {sum(calls):,} B in all: "
                      f"each rank sent 2(N-1)/N of them, {2 * (world - 1) * sum(calls) // world:,}"
                      " B on a ring"]}


def check(fn, timeout_s: float = 20.0):
    return run_exercise("DDP bucket hook", on_rank, fn, WORLD, timeout_s=timeout_s)
