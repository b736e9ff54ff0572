"""Bytes each rank of a `mesh` run sends per step over each of its groups, by formula (fp32,
the ring algorithms distlab.comm books). What tests/test_mesh_nd.py holds the runs to and
notebook 07 sets beside the bytes a run booked.

With s the mesh's sizes, m micro-batches, b = global_batch / (dp_replicate·dp_shard) / m rows
per micro-batch, T_c = seq_len / cp tokens a rank holds of each row, d = n_embd and
S = b·T_c·d·4 (one micro-batch's residual stream on one rank), L_s = n_layer / pp:

    tp   4·L_s·m all-reduces of S, each 2(t-1)/t·S (Shoeybi et al. 2019: f and g, forward and
         backward, around attention and the MLP; 2·L_s·m with experts, which TP leaves whole
         on every tp rank). With sp (Korthikanti et al. 2022) each
         becomes a reduce-scatter and an all-gather of (t-1)/t·S: 4·L_s·m of each, plus one
         all-gather per micro-batch where the sequence is split (the first stage's backward)
         and where it is gathered (the last stage's forward), and per micro-batch one
         all-reduce of the stage's partial-sum gradients (its norms and row-parallel biases,
         6d a layer, 2d more for ln_f)
    cp   per layer and micro-batch, the ring's K/V hops and dK/dV hops
         (distlab.theory.context_and_experts.ring_attention_bytes with h = d/t: a tp rank's
         heads), or Ulysses' eight all-to-alls
    pp   m·S of activations to the next stage, m·S of gradients to the previous one (S/t each
         with sp: the residual stream stays split by sequence between stages)
    dp   ZeRO over N = dp_shard·cp ranks, on units padded to a multiple of N (P = Σ P_u; with
         fsdp_layout="per_param" each parameter's dim 0 padded instead: theory.fsdp_layouts):
           zero1/2  reduce-scatter + all-gather, each (N-1)/N·4P (Rajbhandari et al. 2020)
           zero3    under the loop: two all-gathers (forward, backward) and one
                    reduce-scatter, each (N-1)/N·4P. Under a pipeline each micro-batch
                    gathers every unit for its forward and its backward and reduce-scatters
                    it, except that the unit a forward ends with is still gathered when a
                    backward follows at once on this rank (the pipeline runs the stage's
                    blocks, not the GPT's forward, so the hook that frees the last unit at
                    forward's end never fires): 2m·P - f·P_last gathered, f the schedule's
                    forward-then-backward pairs on this rank
         HSDP: each shard averaged over dp_replicate, 2(R-1)/R·4P/N
         no ZeRO: the dense gradient all-reduced over dp_cp, 2(n-1)/n·4Ψ
    edp  under ep: this rank's experts' gradients all-reduced over the ranks holding them,
         2(E-1)/E·4Ψ_experts (the all-to-alls depend on the routing: tests check them against
         the routed counts). Beside a dense ZeRO the experts have their own over the E ranks
         of edp (distlab.parallel.expert.zero; the dense units above then hold no expert):
         units padded to a multiple of E (zero1 one of all local experts, zero2/3 one per
         expert, P_e in all), a reduce-scatter and an all-gather of (E-1)/E·4P_e each (zero2
         under a pipeline: m reduce-scatters); zero3 gathers each expert for every forward
         and again for its backward (the expert is the module fully_shard wraps, so its
         forward's end frees it and prefetches it back): 2m all-gathers, m reduce-scatters
    moe.load  with the balancing bias (expert_bias_rate): the step's loads, L_s x E counts in
         float64, all-reduced over the ranks that route different tokens (dp_cp, or
         dp_shard x cp then dp_replicate), 2(n-1)/n·8·L_s·E each
"""

from __future__ import annotations

import dataclasses
import functools
import math

from distlab.comm import ring_allreduce_bytes
from distlab.models import GPTConfig
from distlab.parallel.parallelize import (GROUPS, coords_of, ep_groups, order_of, sizes,
                                         used_groups)
from distlab.parallel.pipeline.pp import V_SHAPED, make_schedule, stage_blocks
from distlab.parallel.tensor.tp import plan_table
from distlab.theory.context_and_experts import ring_attention_bytes, ulysses_bytes
from distlab.theory.fsdp_layouts import unit_padded

FP32 = 4


def held_numels(cfg, rank: int) -> dict[str, int]:
    """{parameter name: entries this rank holds} (before ZeRO): its stage's blocks and ends,
    Megatron's split weights divided by tp, under ep only its own experts."""
    return {name: math.prod(shape) for name, shape in held_shapes(cfg, rank).items()}


def held_shapes(cfg, rank: int) -> dict[str, tuple]:
    """{parameter name: the shape this rank holds} (before ZeRO): held_numels' parameters."""
    s = sizes(cfg)
    experts = _local_experts(cfg, s, rank)
    return {name: shape for name, shape in
            stage_shapes(cfg, coords_of(cfg, rank)["pp"], s["pp"], s["tp"]).items()
            if ".experts." not in name
            or int(name.split(".experts.")[1].split(".")[0]) in experts}


def stage_shapes(cfg, stage: int, pp: int, tp: int) -> dict[str, tuple]:
    """{parameter name: shape} a tp rank of pipeline stage `stage` holds of cfg's GPT: the
    stage's blocks (the embeddings on the first, ln_f and the head on the last), a
    column-parallel weight or bias cut on dim 0 by tp, a row-parallel weight on dim 1; every
    expert (the caller keeps its own). `3d`'s and the mesh's count alike."""
    blocks = {f"blocks.{i}." for i in stage_blocks(cfg.n_layer, pp, stage)}
    split = {}  # name -> the dim tp cuts
    for name, style in plan_table(cfg.n_layer, experts=bool(cfg.n_experts)).items():
        if style == "colwise":
            split |= {f"{name}.weight": 0, f"{name}.bias": 0}
        elif style == "rowwise":
            split[f"{name}.weight"] = 1
    out = {}
    gpt = _param_shapes(*dataclasses.astuple(GPTConfig.from_run(cfg, cfg.moe_groups_per_rank)))
    for name, shape in gpt.items():
        top = name.split(".")[0]
        if not (any(name.startswith(b) for b in blocks)
                or (top in ("tok_emb", "pos_emb") and stage == 0)
                or (top in ("ln_f", "head") and stage == pp - 1)):
            continue
        if name in split:
            shape = tuple(n // tp if i == split[name] else n for i, n in enumerate(shape))
        out[name] = tuple(shape)
    return out


@functools.lru_cache(maxsize=16)
def _param_shapes(*gpt_fields) -> dict[str, tuple]:
    """{parameter name: shape} of GPT(GPTConfig(*gpt_fields)), built on the meta device."""
    import torch

    from distlab.models import GPT
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in GPT(GPTConfig(*gpt_fields)).named_parameters()}


def _local_experts(cfg, s: dict, rank: int) -> set[int]:
    if not cfg.n_experts:
        return set()
    if s["ep"] == 1:
        return set(range(cfg.n_experts))
    group = next(g for g in ep_groups(s, order_of(cfg))["ep"] if rank in g)
    per = cfg.n_experts // s["ep"]
    first = group.index(rank) * per
    return set(range(first, first + per))


def _expert_zero(cfg) -> bool:
    """Whether the experts have a ZeRO of their own: over ep, beside a dense ZeRO."""
    s = sizes(cfg)
    return s["ep"] > 1 and "dp_shard_cp" in used_groups(s, cfg.zero_stage)


def zero_units(cfg, rank: int) -> list[tuple[str, list[tuple]]]:
    """ZeRO's units on this rank in forward order, (name, its parameters' shapes): zero1 one
    unit of everything; zero2/3 the embeddings, each block, then ln_f and the head
    (find_units' cut). The experts are not in them when they have their own (expert_units)."""
    held = held_shapes(cfg, rank)
    if _expert_zero(cfg):
        held = {k: v for k, v in held.items() if ".experts." not in k}
    if cfg.zero_stage == 1:
        return [("model", list(held.values()))]
    units: dict[str, list] = {}
    for name, shape in held.items():
        top = name.split(".")[0]
        unit = ("tok_emb+pos_emb" if top in ("tok_emb", "pos_emb") else
                "ln_f+head" if top in ("ln_f", "head") else ".".join(name.split(".")[:2]))
        units.setdefault(unit, []).append(shape)
    order = sorted(units, key=lambda u: (0, 0) if u == "tok_emb+pos_emb" else (
        2, 0) if u == "ln_f+head" else (1, int(u.split(".")[1])))
    return [(u, units[u]) for u in order]


def expert_units(cfg, rank: int) -> list[tuple[str, list[tuple]]]:
    """The experts' own ZeRO units on this rank (distlab.parallel.expert.zero): zero1 one unit
    of every local expert, zero2/3 one per expert."""
    experts: dict[str, list] = {}
    for name, shape in held_shapes(cfg, rank).items():
        if ".experts." in name:
            head, tail = name.split(".experts.")
            experts.setdefault(f"{head}.experts.{tail.split('.')[0]}", []).append(shape)
    if cfg.zero_stage == 1:
        return [("experts", [sh for shapes in experts.values() for sh in shapes])]
    return list(experts.items())


def forward_then_backward(cfg, stage: int) -> int:
    """How many times this stage's schedule runs a backward right after a forward."""
    ops = make_schedule(cfg.schedule, cfg.pp, cfg.microbatches)[stage]
    return sum(a[0] == "F" and b[0] == "B" for a, b in zip(ops, ops[1:]))


def mesh_bytes(cfg, rank: int) -> dict[str, dict[str, float]]:
    """{group kind: {collective kind: bytes `rank` sends per step}} (module docstring)."""
    if (cfg.schedule == "interleaved" and cfg.virtual_stages > 1) or cfg.schedule in V_SHAPED:
        raise NotImplementedError("mesh_bytes models one pipeline chunk per rank")
    s = sizes(cfg)
    c = coords_of(cfg, rank)
    t, cp, p, m = s["tp"], s["cp"], s["pp"], cfg.microbatches
    b = cfg.global_batch // (s["dp_replicate"] * s["dp_shard"]) // m
    S = b * (cfg.seq_len // cp) * cfg.n_embd * FP32
    L = cfg.n_layer // p
    groups = used_groups(s, cfg.zero_stage)
    out: dict[str, dict[str, float]] = {g: {} for g in groups}
    first, last = c["pp"] == 0, c["pp"] == p - 1
    # f and g around attention, and around the MLP unless it is a mixture of experts (TP
    # leaves the experts whole)
    per_block = 2 if cfg.n_experts else 4
    if "tp" in out and not cfg.sp:
        out["tp"]["tp.all_reduce"] = per_block * L * m * 2 * (t - 1) * S / t
    elif "tp" in out:
        d = cfg.n_embd
        out["tp"] = {"sp.all_gather": (4 * L + first + last) * m * (t - 1) * S / t,
                     "sp.reduce_scatter": 4 * L * m * (t - 1) * S / t,
                     "sp.grad_all_reduce": m * ring_allreduce_bytes(
                         FP32 * (6 * d * L + 2 * d * last), t)}
    if "cp" in out:
        h = cfg.n_embd // t
        if cfg.cp_attention == "ring":
            kv = b * (cfg.seq_len // cp) * h * FP32
            ring = ring_attention_bytes(b, cfg.seq_len, h, cp)
            out["cp"]["cp.kv"] = L * m * (ring["forward"] + ring["backward"] - 2 * cp * kv)
            out["cp"]["cp.dkv"] = L * m * 2 * cp * kv
        else:
            u = ulysses_bytes(b, cfg.seq_len, h, cp)
            out["cp"]["cp.a2a"] = L * m * (u["forward"] + u["backward"])
    if "pp" in out:
        boundary = S // t if cfg.sp else S
        if not last:
            out["pp"]["pp_send_act"] = m * boundary
        if not first:
            out["pp"]["pp_send_grad"] = m * boundary
    held = held_numels(cfg, rank)
    experts = sum(n for k, n in held.items() if ".experts." in k) if s["ep"] > 1 else 0
    if "dp_shard_cp" in out:
        N = s["dp_shard"] * cp
        layout = cfg.fsdp_layout if cfg.zero_stage == 3 else "flat"
        units = [(u, unit_padded(shapes, N, layout)) for u, shapes in zero_units(cfg, rank)]
        P = sum(n for _, n in units)
        one = (N - 1) * FP32 / N
        if cfg.zero_stage < 3:
            rs = P * (m if cfg.zero_stage == 2 and p > 1 else 1)
            out["dp_shard_cp"] = {"reduce_scatter": one * rs, "all_gather": one * P}
        elif p == 1:
            out["dp_shard_cp"] = {"all_gather": 2 * one * P, "reduce_scatter": one * P}
        else:
            kept = forward_then_backward(cfg, c["pp"]) * units[-1][1]
            out["dp_shard_cp"] = {"all_gather": one * (2 * m * P - kept),
                                  "reduce_scatter": one * m * P}
        if "dp_replicate" in out:
            out["dp_replicate"]["all_reduce"] = ring_allreduce_bytes(FP32 * P / N,
                                                                     s["dp_replicate"])
    if "dp_cp" in out:
        n = s["dp_replicate"] * s["dp_shard"] * cp
        out["dp_cp"]["all_reduce"] = ring_allreduce_bytes(FP32 * (sum(held.values()) - experts), n)
    if cfg.n_experts and cfg.expert_bias_rate:  # the experts' loads, float64, summed
        for g in ("dp_cp", "dp_shard_cp", "dp_replicate"):  # Strategy.routing_comms' order
            if g in out:
                out[g]["moe.load"] = ring_allreduce_bytes(
                    8 * L * cfg.n_experts, math.prod(s[d] for d in GROUPS[g]))
    if "edp" in out:
        E = s["dp_replicate"] * s["dp_shard"] * cp // s["ep"]
        if not _expert_zero(cfg):
            out["edp"]["all_reduce"] = ring_allreduce_bytes(FP32 * experts, E)
        elif E > 1:  # a group of one sends nothing
            P = sum(unit_padded(shapes, E, "flat") for _, shapes in expert_units(cfg, rank))
            one, mm = (E - 1) * FP32 / E, m if p > 1 else 1
            out["edp"] = ({"all_gather": 2 * mm * one * P, "reduce_scatter": mm * one * P}
                          if cfg.zero_stage == 3 else
                          {"reduce_scatter": one * P * (mm if cfg.zero_stage == 2 else 1),
                           "all_gather": one * P})
    return out
