"""Long context, measured: what ring attention and Ulysses cost and save on real ranks.

Rank functions (run with distlab.run_ranks) and the table builders the benchmark
(benchmarks/context_parallel.py) and the long-context notebook share:

    attention_pass(rank, world, ...)   one forward and backward of causal attention over a
                                       (B, H, T, D) batch split over the ranks, per method
                                       and layout: the largest difference from one process
                                       (each rank computes the reference itself, same seed),
                                       the chunk pairs, compute and wait seconds per rank,
                                       the bytes booked and the bytes the kernel saw
    activation_bytes(rank, world, ...) the GPT's saved-for-backward bytes per rank for one
                                       forward at each sequence length, under cp over the
                                       ranks (world 1: the whole sequence on one rank)
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from distlab.comm import Comm
from distlab.parallel.context import layout as L
from distlab.parallel.context.api import ContextParallel
from distlab.parallel.context.strategy import attach

METHODS = (("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "contiguous"))


def _batch(B, H, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g) for _ in range(4)]


def _reference(q, k, v, dy):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (y * dy).sum().backward()
    return [y.detach(), q.grad, k.grad, v.grad]


def attention_pass(rank, world, device, log, B=1, H=4, T=1024, D=32, repeats=3):
    """Per (method, layout): max |difference| from one process over output and gradients,
    chunk pairs, the median over `repeats` of compute seconds (CPU seconds of the rank's
    thread, forward + backward: its work, even where ranks share a core) and of wait seconds
    (wall), and the comm stats of that pass."""
    q, k, v, dy = _batch(B, H, T, D)
    ref = _reference(q, k, v, dy)
    out = {}
    for method, layout in METHODS:
        rows = []
        for _ in range(repeats):
            comm = Comm()
            cp = ContextParallel(layout, method, comm=comm)
            ql, kl, vl = (cp.shard(t, dim=2).requires_grad_() for t in (q, k, v))
            comm.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            y = cp.attention(ql, kl, vl)
            (y * cp.shard(dy, dim=2)).sum().backward()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            got = [y.detach(), ql.grad, kl.grad, vl.grad]
            diff = max((g - cp.shard(r, dim=2)).abs().max().item() for g, r in zip(got, ref))
            s, stats = cp.take_stats(), comm.snapshot()
            if method == "ring":  # timed inside its block loops
                compute, wait = sum(s.compute_cpu_s.values()), sum(s.wait_s.values())
            else:  # Ulysses: the pass's CPU time (a blocking all-to-all waits, idle)
                compute, wait = cpu, stats["cp.a2a"]["seconds"]
            rows.append({"diff": diff, "pairs": s.pairs_fwd, "scores": s.scores_fwd,
                         "wall_s": wall,
                         "compute_s": compute, "wait_s": wait, "comm": stats})
        rows.sort(key=lambda r: r["compute_s"])
        mid = rows[len(rows) // 2]
        out[method, layout] = {**mid, "diff": max(r["diff"] for r in rows)}
    return out


def work_table(results: list[dict]) -> list[dict]:
    """Per (method, layout): compute seconds per rank and the slowest rank against the mean
    (measured: CPU seconds, which ranks sharing cores and memory bandwidth make noisy); for
    the ring, the q·k products each rank computed (counted as its blocks ran: the causal
    work itself) with the same ratio, and the chunk-pair formula's; the bytes each rank
    booked under the cp kinds (ring hops, all-to-alls)."""
    world = len(results)
    rows = []
    for method, layout in METHODS:
        per = [r[method, layout] for r in results]
        secs = [p["compute_s"] for p in per]
        row = {"method": method, "layout": layout, "ranks": world,
               "max |diff| vs one process": max(p["diff"] for p in per),
               "compute s per rank": secs,
               "slowest / mean (measured)": max(secs) / (sum(secs) / world),
               "wait s per rank": [p["wait_s"] for p in per],
               "booked": [sum(v["bytes_sent"] for k, v in p["comm"].items()
                              if k.startswith("cp.")) for p in per]}
        if method == "ring":
            pairs = L.causal_work(world, layout)
            scores = [p["scores"] for p in per]  # counted as the blocks ran
            row["chunk pairs per rank"] = [p["pairs"] for p in per]
            row["scores per rank"] = scores
            row["slowest / mean (counted)"] = max(scores) / (sum(scores) / world)
            row["slowest / mean (formula)"] = max(pairs) / (sum(pairs) / world)
        rows.append(row)
    return rows


def activation_bytes(rank, world, device, log, seq_lens=(128, 256, 512), n_layer=2,
                     n_embd=64, n_head=4, attention="ring"):
    """Per sequence length: this rank's saved-for-backward bytes for one forward of the GPT
    (batch 1) with the sequence split over the world (world 1: all of it), and the
    parameter bytes (which do not shrink)."""
    from distlab.memory import ActivationMeter
    from distlab.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                          block_size=max(seq_lens)))
    cp = ContextParallel("zigzag", attention, comm=Comm()) if world > 1 else None
    out = {"params": sum(p.numel() * p.element_size() for p in model.parameters())}
    for T in seq_lens:
        x = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(T))
        if cp is not None:  # the cp strategy's own wiring, at this length
            attach(model, cp, T)
            x = cp.shard(x)
        meter = ActivationMeter(model)
        with meter.measure():
            loss = model(x, x)
        loss.backward()
        model.zero_grad()
        out[T] = meter.bytes
    return out
