"""Exercise: ring all-reduce from point-to-point messages (Patarasuk & Yuan 2009; Baidu's
ring all-reduce, which Horovod and NCCL made the default).

    def ring_all_reduce(x, rank, world, exchange):
        # x: this rank's 1-D tensor (its length divides by world). Return the sum over the
        # ranks (in x, or a new tensor). exchange(send_t, to, recv_t, frm) sends send_t to
        # rank `to` while receiving recv_t from rank `frm`, and returns recv_t.

Cut x into `world` chunks. Reduce-scatter: in world-1 steps each rank sends one chunk to its
right neighbour and adds the chunk arriving from its left, so that each rank ends with one
chunk summed over every rank. All-gather: world-1 more steps pass the summed chunks around.
Each rank sends 2(N-1)/N of x: the bandwidth-optimal volume, whatever N.

The check: 4 ranks, x of 4096 float32 drawn per rank; the result against the sum over every
rank (computed on each rank from the same seeds; tolerance 1e-5: float32 sums in another
order), and the bytes each rank sent against 2(N-1)/N·|x| exactly.
"""

from __future__ import annotations

import torch

from distlab.exercises.harness import load, run_exercise

WORLD, N_ELEMS = 4, 4096


def ring_all_reduce(x, rank, world, exchange):
    chunks = list(x.chunk(world))  # views into x: updating them updates x
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):  # reduce-scatter: chunk (rank+1) % world ends summed here
        send, recv = (rank - step) % world, (rank - step - 1) % world
        chunks[recv] += exchange(chunks[send], right, torch.empty_like(chunks[recv]), left)
    for step in range(world - 1):  # all-gather: the summed chunks go around once
        send, recv = (rank - step + 1) % world, (rank - step) % world
        chunks[recv].copy_(exchange(chunks[send], right, torch.empty_like(chunks[recv]), left))
    return x


reference = ring_all_reduce


def _x(rank: int) -> torch.Tensor:
    return torch.randn(N_ELEMS, generator=torch.Generator().manual_seed(100 + rank))


def on_rank(rank, world, device, log, name, source):
    import torch.distributed as dist
    fn = load(name, source)
    sent = [0]

    def exchange(send_t, to, recv_t, frm):
        send_t = send_t.contiguous()
        works = [dist.isend(send_t, to), dist.irecv(recv_t, frm)]
        for w in works:
            w.wait()
        sent[0] += send_t.numel() * send_t.element_size()
        return recv_t

    got = fn(_x(rank).clone(), rank, world, exchange)
    want = sum(_x(r) for r in range(world))
    problems = []
    if not torch.is_tensor(got) or got.shape != want.shape:
        problems.append(f"returned {type(got).__name__} "
                        f"{tuple(got.shape) if torch.is_tensor(got) else ''}: return the summed "
                        f"tensor, shape {tuple(want.shape)}")
    else:
        diff = (got - want).abs().max().item()
        if diff > 1e-5:
            wrong = (got - want).abs().view(world, -1).amax(1) > 1e-5
            problems.append(f"the sum is off by up to {diff:.3g}; wrong chunks: "
                            f"{wrong.nonzero().flatten().tolist()} of {world}")
    formula = 2 * (world - 1) * N_ELEMS * 4 // world
    if sent[0] != formula:
        problems.append(f"sent {sent[0]:,} B; the ring sends 2(N-1)/N of x = {formula:,} B")
    return {"problems": problems,
            "facts": [f"every rank holds the sum of {world} ranks' tensors (max |diff| "
                      f"{(got - want).abs().max().item():.1e})",
                      f"each rank sent {sent[0]:,} B = 2(N-1)/N of its {N_ELEMS * 4:,} B"]}


def check(fn, timeout_s: float = 20.0):
    return run_exercise("ring all-reduce", on_rank, fn, WORLD, timeout_s=timeout_s)
