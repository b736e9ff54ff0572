"""Bytes each rank sends per step, by formula: what a notebook sets beside the bytes a run
booked and the kernel counted. Every figure is for fp32 (4 bytes a value) and the ring
algorithms distlab.comm books (an all-reduce 2(N-1)/N·S, a reduce-scatter or all-gather
(N-1)/N·S per rank).

    comm_formula(strategy, n, model_bytes)  DDP, ZeRO-1/2/3 and FSDP: Rajbhandari et al. 2020
    megatron_bytes(cfg)                     tensor (and sequence) parallel: Shoeybi et al. 2019,
                                            Korthikanti et al. 2022
    predicted_bytes(cfg, rank)              `3d`: per group (dp, tp, pp) of the mesh
    messages_per_step, link_seconds         the α-β model's message counts and time on a link
    hsdp_link_bytes(shard_bytes, g, n)      HSDP: what crosses from one node per step
    all_reduce_link_bytes(S, g, n)          flat ring and hierarchical all-reduce: the same
"""

from __future__ import annotations

import math

from distlab.comm import ring_allreduce_bytes
from distlab.config import RunConfig
from distlab.parallel.mesh import KINDS, coords
from distlab.parallel.pipeline.pp import V_SHAPED

FP32 = 4


# -- data parallel and ZeRO ----------------------------------------------------------------------
def comm_formula(strategy: str, n: int, model_bytes: float) -> dict:
    """Bytes each rank sends per step by collective kind, by formula, for a model of
    `model_bytes` bytes (4Ψ in fp32) on n ranks, one micro-batch (Rajbhandari et al. 2020,
    Section 7; distlab.parallel.zero.stages's docstring):

        ddp          all-reduce            2(N-1)/N · 4Ψ
        zero1/zero2  reduce-scatter         (N-1)/N · 4Ψ   + all-gather (N-1)/N · 4Ψ
        zero3, FSDP  all-gather (fwd + bwd) 2(N-1)/N · 4Ψ  + reduce-scatter (N-1)/N · 4Ψ
        zero1-torch  DDP's all-reduce + one broadcast of each rank's partition ((N-1)/N · 4Ψ
                     if the partitions were equal)"""
    one = (n - 1) / n * model_bytes
    if strategy == "ddp":
        return {"all_reduce": ring_allreduce_bytes(model_bytes, n)}
    if strategy in ("zero1", "zero2"):
        return {"reduce_scatter": one, "all_gather": one}
    if strategy in ("zero3", "fsdp-torch"):
        return {"all_gather": 2 * one, "reduce_scatter": one}
    if strategy == "zero1-torch":
        return {"all_reduce": ring_allreduce_bytes(model_bytes, n), "broadcast": one}
    raise ValueError(f"no formula for {strategy!r}")


# -- tensor parallel -------------------------------------------------------------------------------
def megatron_bytes(cfg: RunConfig) -> dict[str, tuple[int, float]]:
    """{comm kind: (calls, bytes sent per rank)} of one training step of `tp` on cfg's GPT, as
    the ring moves them (distlab.comm), with S = B·T·d·4 (the residual stream of the whole
    global batch in fp32), t = tp, L = layers (tests/test_tensor_parallel.py derives them):

    without sp: 4L all-reduces (forward: g after attn.o and mlp.proj; backward: f before q/k/v
                and mlp.fc), each 2(t-1)/t·S.
    with sp:    4L reduce-scatters and 4L+2 all-gathers, each (t-1)/t·S, plus one all-reduce
                of the sequence-parallel gradients ((2·2d + 2d)·L + 2d floats)."""
    t, L, d = cfg.tp, cfg.n_layer, cfg.n_embd
    S = cfg.global_batch * cfg.seq_len * d * FP32
    if not cfg.sp:
        return {"tp.all_reduce": (4 * L, 4 * L * 2 * (t - 1) * S / t)}
    sp_grads = ((2 * 2 * d + 2 * d) * L + 2 * d) * FP32
    return {"sp.all_gather": (4 * L + 2, (4 * L + 2) * (t - 1) * S / t),
            "sp.reduce_scatter": (4 * L, 4 * L * (t - 1) * S / t),
            "sp.grad_all_reduce": (1, 2 * (t - 1) * sp_grads / t)}


# -- the 3D mesh -----------------------------------------------------------------------------------
def micro_batch_bytes(cfg: RunConfig) -> int:
    """S = (B/dp/m)·T·h·4: one micro-batch's hidden states on one dp replica."""
    return cfg.global_batch // cfg.dp_degree // cfg.microbatches * cfg.seq_len * cfg.n_embd * FP32


def predicted_bytes(cfg: RunConfig, rank: int) -> dict[str, dict[str, int]]:
    """{group kind: {collective kind: bytes sent per step}} of `rank` (module docstring).
    One chunk per rank (gpipe, 1f1b, naive): interleaved's v chunks add boundaries."""
    if (cfg.schedule == "interleaved" and cfg.virtual_stages > 1) or cfg.schedule in V_SHAPED:
        raise NotImplementedError("predicted_bytes models one pipeline chunk per rank")
    dp, t, p, m = cfg.dp_degree, cfg.tp, cfg.pp, cfg.microbatches
    S, c = micro_batch_bytes(cfg), coords(rank, dp, t, p, cfg.mesh_order)
    out = {k: {} for k in KINDS}
    if t > 1:
        out["tp"]["tp.all_reduce"] = 4 * (cfg.n_layer // p) * m * 2 * (t - 1) * S // t
    if c["pp"] < p - 1:
        out["pp"]["pp_send_act"] = m * S
    if c["pp"] > 0:
        out["pp"]["pp_send_grad"] = m * S
    if dp > 1:
        P = math.ceil(rank_numel(cfg, rank) / dp) * dp
        out["dp"] = {"reduce_scatter": (dp - 1) * FP32 * P // dp,
                     "all_gather": (dp - 1) * FP32 * P // dp}
    return out


def rank_numel(cfg: RunConfig, rank: int) -> int:
    """Parameters `rank` holds in `3d`: its pipeline stage's blocks (plus the embeddings on
    the first stage, ln_f and the head on the last), with the column/row-split weights of
    Megatron's plan divided by tp. Counted from the model's shapes (built on the meta device)."""
    from distlab.theory.mesh_bytes import stage_shapes  # the mesh's count (its pp stage)
    c = coords(rank, cfg.dp_degree, cfg.tp, cfg.pp, cfg.mesh_order)
    return sum(math.prod(s) for s in stage_shapes(cfg, c["pp"], cfg.pp, cfg.tp).values())


def messages_per_step(cfg: RunConfig, rank: int) -> dict[str, int]:
    """Messages per step a rank sends over each group kind in the ring model: a ring
    all-reduce over n ranks is 2(n-1) messages, a reduce-scatter or all-gather n-1, a send 1."""
    dp, t, p, m = cfg.dp_degree, cfg.tp, cfg.pp, cfg.microbatches
    c = coords(rank, dp, t, p, cfg.mesh_order)
    return {"tp": 4 * (cfg.n_layer // p) * m * 2 * (t - 1),
            "pp": m * ((c["pp"] < p - 1) + (c["pp"] > 0)),
            "dp": 2 * (dp - 1)}


def link_seconds(nbytes: float, messages: int, link) -> float:
    """α-β: messages·α + bytes/β on one link (distlab.comm.Link)."""
    return messages * link.alpha_s + nbytes / link.bandwidth_Bps


def hsdp_link_bytes(shard_bytes: float, ranks_per_node: int, nodes: int) -> float:
    """Bytes one node sends to the others per step under HSDP (shard inside a node, replicate
    across; Zhao et al. 2023, Section 3.2.2): each of its g ranks all-reduces its gradient
    shards with the ranks holding the same shard on the n nodes, a ring's 2(n-1)/n of them;
    the all-gathers and reduce-scatters stay inside the node."""
    return ranks_per_node * 2 * (nodes - 1) / nodes * shard_bytes


def all_reduce_link_bytes(nbytes: float, ranks_per_node: int, nodes: int) -> dict[str, float]:
    """Bytes one node sends across its link in one all-reduce of `nbytes`, per algorithm: the
    flat ring over all N = g·n ranks crosses it on its one edge out of the node with 2(N-1)/N
    of the tensor (Patarasuk & Yuan 2009); the hierarchical all-reduce (reduce-scatter inside
    the node, all-reduce across, all-gather inside) sends 2(n-1)/n of it from the node's g
    ranks together, whether as g rings or through one leader."""
    N, n = ranks_per_node * nodes, nodes
    return {"flat ring": 2 * (N - 1) / N * nbytes,
            "hierarchical": 2 * (n - 1) / n * nbytes,
            "hierarchical, one flow": 2 * (n - 1) / n * nbytes}
