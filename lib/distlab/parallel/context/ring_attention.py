"""Ring attention: causal self-attention over a sequence split across the ranks of a group.

Liu et al. 2023 ("Ring Attention with Blockwise Transformers"). Each rank holds its tokens'
queries, keys and values (distlab.parallel.context.layout says which tokens). The keys and
values travel around the ring: at round i rank r holds the K/V block of rank r-i, sends it on
to r+1 and receives r-i-1's, the exchange started before the block's compute so the two
overlap. Each block is folded into the output with the online softmax (Milakov & Gimelshein
2018; FlashAttention, Dao et al. 2022): a running row maximum m, row sum l and weighted sum
acc, rescaled when m grows, so no rank ever holds a T x T score matrix or another rank's
whole sequence.

Backward (FlashAttention's): with the forward's log-sum-exp per row (lse = m + log l) each
block's probabilities are recomputed, p = exp(s - lse); dV += pᵀ dO, dS = p (dO Vᵀ - D) with
D = rowsum(dO * O), dQ += dS K, dK += dSᵀ Q. The K/V blocks go around the ring again, now
with their partial dK and dV, which arrive back at their owner after a last hop.

Work per round is chunk pairs (layout.chunk_pairs): key chunks later than the query chunk
are skipped, the diagonal ones masked. Each rank's compute seconds and chunk pairs are kept
(`RingStats`), so idle time per rank is measured, like the pipeline bubble.

Bytes: forward (N-1) hops of K and V, booked under "cp.kv"; backward (N-1) hops of K, V and
N of dK, dV ("cp.kv" and "cp.dkv"): per rank 2(N-1)|kv| forward and 2(N-1)|kv| + 2N|kv|
backward, where |kv| is one of this rank's K or V.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from distlab.comm import Comm
from distlab.parallel.context import layout as L


@dataclass
class RingStats:
    """What this rank did in the forwards and backwards it was passed to."""
    pairs_fwd: int = 0  # chunk pairs computed forward
    scores_fwd: int = 0  # q·k products computed forward (a diagonal block's masked ones too)
    compute_s: dict = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})
    # the same, in CPU seconds of this thread: the work itself, also where ranks share a core
    compute_cpu_s: dict = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})
    wait_s: dict = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})


class _Ring:
    """The ring's neighbours and a hop that overlaps with compute."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.next, self.prev = (comm.rank + 1) % comm.world, (comm.rank - 1) % comm.world

    def start(self, tensors: list[torch.Tensor], kind: str):
        """Send tensors to the next rank, receive the previous rank's into new buffers."""
        bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        works = [self.comm.isend(t, self.next, kind=kind) for t in tensors]
        works += [self.comm.irecv(b, self.prev, kind=kind) for b in bufs]
        return works, bufs

    @staticmethod
    def finish(works) -> float:
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        return time.perf_counter() - t0


def _chunk(t: torch.Tensor, slot: int, size: int) -> torch.Tensor:
    return t[..., slot * size:(slot + 1) * size, :]


def _scores(q, k, kind: str, scale: float) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * scale
    if kind == "diagonal":  # the same chunk: key j visible to query i when j <= i
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, layout, stats):
        N, r = comm.world, comm.rank
        size = q.shape[-2] // len(L.chunks_of(r, N, layout))
        scale = 1.0 / math.sqrt(q.shape[-1])
        m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        l_sum = torch.zeros_like(m)
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        ring, kv = _Ring(comm), (k, v)
        for i in range(N):
            hop = ring.start(list(kv), "cp.kv") if i < N - 1 else None
            t0, c0 = time.perf_counter(), time.thread_time()
            for a, b, kind in L.chunk_pairs(r, (r - i) % N, N, layout):
                qa = _chunk(q, a, size)
                s = _scores(qa.float(), _chunk(kv[0], b, size).float(), kind, scale)
                rows = slice(a * size, (a + 1) * size)
                m_new = torch.maximum(m[..., rows], s.amax(-1))
                p = torch.exp(s - m_new.unsqueeze(-1))
                fade = torch.exp(m[..., rows] - m_new)
                l_sum[..., rows] = l_sum[..., rows] * fade + p.sum(-1)
                acc[..., rows, :] = (acc[..., rows, :] * fade.unsqueeze(-1)
                                     + p @ _chunk(kv[1], b, size).float())
                m[..., rows] = m_new
                stats.pairs_fwd += 1
                stats.scores_fwd += s.numel()
            stats.compute_s["forward"] += time.perf_counter() - t0
            stats.compute_cpu_s["forward"] += time.thread_time() - c0
            if hop is not None:
                stats.wait_s["forward"] += ring.finish(hop[0])
                kv = tuple(hop[1])
        # laid out (B, T, H, D) in memory, as PyTorch's kernel returns it: the caller's
        # transpose(1, 2).reshape(B, T, H·D) is then a view, and the output projection saves
        # the same storage for backward instead of a copy of it
        out = (acc / l_sum.unsqueeze(-1)).to(q.dtype)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        lse = m + torch.log(l_sum)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.layout, ctx.stats, ctx.size, ctx.scale = comm, layout, stats, size, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, layout, stats, size, scale = ctx.comm, ctx.layout, ctx.stats, ctx.size, ctx.scale
        N, r = comm.world, comm.rank
        dout = dout.float()
        D = (dout * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        held = [k, v, torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        ring = _Ring(comm)
        for i in range(N):
            kb, vb, dk, dv = held
            hop = ring.start([kb, vb], "cp.kv") if i < N - 1 else None  # overlaps the compute
            t0, c0 = time.perf_counter(), time.thread_time()
            for a, b, kind in L.chunk_pairs(r, (r - i) % N, N, layout):
                rows = slice(a * size, (a + 1) * size)
                qa, ka, va = (_chunk(q, a, size).float(), _chunk(kb, b, size).float(),
                              _chunk(vb, b, size).float())
                p = torch.exp(_scores(qa, ka, kind, scale) - lse[..., rows].unsqueeze(-1))
                do = dout[..., rows, :]
                _chunk(dv, b, size).add_(p.transpose(-2, -1) @ do)
                ds = p * (do @ va.transpose(-2, -1) - D[..., rows].unsqueeze(-1))
                dq[..., rows, :] += (ds @ ka) * scale
                _chunk(dk, b, size).add_((ds.transpose(-2, -1) @ qa) * scale)
            stats.compute_s["backward"] += time.perf_counter() - t0
            stats.compute_cpu_s["backward"] += time.thread_time() - c0
            # the partial dK, dV follow their K, V; after the last round they hop home (on
            # one rank they are home)
            grads = ring.start([dk, dv], "cp.dkv") if N > 1 else ([], [dk, dv])
            stats.wait_s["backward"] += ring.finish((hop[0] if hop else []) + grads[0])
            held = (hop[1] if hop else [None, None]) + grads[1]
        return (dq.to(q.dtype), held[2].to(k.dtype), held[3].to(v.dtype), None, None, None)


def ring_attention(q, k, v, comm: Comm, layout: str = "zigzag",
                   stats: RingStats | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values.
    q, k, v: (B, H, T/N, D), this rank's tokens in `layout`'s order (layout.shard). Returns
    (B, H, T/N, D): the rows of softmax(QKᵀ/√D + causal mask) V for this rank's queries."""
    if q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"q, k, v must have one shape (B, H, T/N, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)} (grouped KV heads: repeat them)")
    pieces = len(L.chunks_of(comm.rank, comm.world, layout))
    if q.shape[-2] % pieces:
        raise ValueError(f"{q.shape[-2]} local tokens do not make {pieces} equal chunks")
    return RingAttention.apply(q, k, v, comm, layout, stats or RingStats())
