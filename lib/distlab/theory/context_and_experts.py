"""The fourth and fifth dimensions by formula: context parallelism (cp) and expert parallelism
(ep), beside data, tensor and pipeline parallelism. Bytes per rank; every function here is
checked against what the ranks measure (tests/test_context_and_experts_theory.py).

Sources:
  Liu et al. 2023, "Ring Attention with Blockwise Transformers": K/V blocks around a ring of
      N ranks, N-1 hops forward; with the backward of FlashAttention (Dao et al. 2022) the
      blocks go around again with their partial dK, dV, which take one more hop home.
  Jacobs et al. 2023, "DeepSpeed Ulysses": all-to-all of q, k, v to a head split and of the
      output back, each (N-1)/N of the tensor per rank; the same four backward.
  Fedus et al. 2021, "Switch Transformers" (Section 2.2): expert capacity = tokens per batch /
      number of experts x capacity factor; the auxiliary loss E x sum_i f_i P_i.
  Lepikhin et al. 2020, "GShard": top-2 routing, groups (capacity per group), experts spread
      over the devices with all-to-all dispatch and combine.
  Dai et al. 2024, "DeepSeekMoE": fine-grained experts (each expert split into m narrower ones,
      m times as many chosen: the same parameters and FLOPs, far more combinations) and shared
      experts every token passes through.
  The Ultra-Scale Playbook (Tazi et al., Hugging Face 2025), "Context parallelism" and "Expert
      parallelism": the same accounting, and activations per rank falling as 1/cp while the
      model states do not; experts per rank falling as 1/ep while the FLOPs per token follow
      the k active experts, not E.

Notation: b micro-batch rows, s sequence length, h hidden size, N ranks of the cp or ep
group, B bytes per element, E experts, k experts per token, f the expert MLP's width ratio.
"""

from __future__ import annotations

import math


def ring_attention_bytes(b: int, s: int, h: int, n: int, elem: int = 4) -> dict:
    """One attention layer, bytes one rank sends: forward (N-1) hops of its K and V blocks
    (b x s/N x h each); backward (N-1) hops of K and V again and N of dK and dV."""
    kv = b * (s // n) * h * elem
    return {"forward": 2 * (n - 1) * kv, "backward": 2 * (n - 1) * kv + 2 * n * kv if n > 1
            else 0}


def ulysses_bytes(b: int, s: int, h: int, n: int, elem: int = 4) -> dict:
    """One attention layer, bytes one rank sends: four all-to-alls each way (q, k, v to the
    head split, the output back), each (N-1)/N of a b x s/N x h tensor."""
    per = (n - 1) * (b * (s // n) * h * elem) // n
    return {"forward": 4 * per, "backward": 4 * per}


def cp_activation_fraction(n: int) -> float:
    """Activations per rank under cp over N ranks, against one rank holding the sequence: every
    activation is per token, so 1/N (the Playbook's point). Ring attention keeps no s x s
    matrix, so the attention term does not come back."""
    return 1.0 / n


def expert_capacity(tokens: int, n_experts: int, capacity_factor: float, top_k: int = 1) -> int:
    """Switch's capacity per expert and group, each token taking k slots (GShard's top-2)."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def ep_dispatch_bytes(tokens: int, h: int, n: int, top_k: int = 1, elem: int = 4) -> dict:
    """One MoE layer, bytes one rank sends when its `tokens` route evenly over the experts of
    N ranks and none is dropped: dispatch and combine forward, each (N-1)/N of tokens x k
    rows of h; the same two backward (the gradients go back the way the rows came)."""
    per = (n - 1) * tokens * top_k * h * elem // n
    return {"forward": 2 * per, "backward": 2 * per}


def ep_dispatch_ceiling(tokens: int, n_experts: int, n: int, top_k: int,
                        capacity_factor: float, row_bytes: int) -> int:
    """The most bytes one rank's dispatch can send for one MoE layer, whatever the router
    does: with a capacity, at most C rows to each of the E - E/N experts on other ranks (and
    no more than its tokens x k choices): the ceiling a fixed-shape dispatch relies on;
    dropless (capacity_factor 0), every choice to a remote expert."""
    choices = tokens * top_k
    if capacity_factor:
        remote = n_experts - n_experts // n
        choices = min(choices, remote * expert_capacity(tokens, n_experts, capacity_factor,
                                                        top_k))
    return choices * row_bytes


def moe_params(h: int, hidden: int, n_experts: int, n_shared: int = 0) -> dict:
    """One MoE layer's parameters: E routed and n_shared shared expert MLPs (Linear
    h->hidden, Linear hidden->h, with biases) and a router (h x E, no bias)."""
    expert = (h * hidden + hidden) + (hidden * h + h)
    return {"total": (n_experts + n_shared) * expert + h * n_experts, "expert": expert,
            "router": h * n_experts, "shared": n_shared * expert}


def moe_active(h: int, hidden: int, n_experts: int, top_k: int, n_shared: int = 0) -> dict:
    """What one token meets in one MoE layer, none dropped: the router, its k routed experts
    and the shared ones. `params` counts their parameters (biases too); `forward_flops` two
    per weight of a matrix product (Kaplan et al. 2020), what a FLOP counter of matmuls sees."""
    p = moe_params(h, hidden, n_experts, n_shared)
    return {"params": p["router"] + (top_k + n_shared) * p["expert"],
            "forward_flops": 2 * (h * n_experts + (top_k + n_shared) * 2 * h * hidden)}


def fine_grained(h: int, hidden: int, n_experts: int, top_k: int, m: int) -> dict:
    """DeepSeekMoE's segmentation: each of E experts of width `hidden` split into m of width
    hidden/m, m*k of the m*E chosen. The weights in all and per token stay (the biases and the
    router's h x E grow); the choices a token can make grow from C(E, k) to C(mE, mk)."""
    if hidden % m:
        raise ValueError(f"fine_grained: hidden={hidden} does not split into m={m} experts")
    return {"n_experts": m * n_experts, "top_k": m * top_k, "hidden": hidden // m,
            "combinations": math.comb(m * n_experts, m * top_k),
            "coarse_combinations": math.comb(n_experts, top_k)}


def moe_layer_per_rank(h: int, hidden: int, n_experts: int, ep: int, top_k: int = 1) -> dict:
    """What ep changes for one MoE layer: parameters held per rank (E/ep experts, the router
    whole) and matmul FLOPs per token forward and backward (6 x the weights the token meets,
    Kaplan et al. 2020's 6N: the router and k experts), which do not depend on E or ep."""
    p = moe_params(h, hidden, n_experts)
    matmul = h * n_experts + top_k * 2 * h * hidden  # the router's and k experts' weights
    return {"params_per_rank": p["expert"] * n_experts // ep + p["router"],
            "train_flops_per_token": 6 * matmul}
