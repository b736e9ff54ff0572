"""The routing of today's MoE models in one process (distlab.models.moe): dropless, the
experts as one grouped product, the auxiliary-loss-free bias, shared and fine-grained experts,
and their formulas (distlab.theory.context_and_experts). The same on real ranks is
tests/test_expert_parallel.py's (one launch).

Tolerances: the grouped product against the loop, 1e-6 in float32: the same products summed in
the same order by another kernel (measured 0.0 on torch 2.13's CPU kernel; a kernel may block
its sums differently, a few ulps of values of order 1). Outputs against a sum written by hand,
1e-6 as well: one index_add against a Python loop, the same terms in another order.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from distlab.models.moe import MoE, max_violation, update_expert_bias
from distlab.theory.context_and_experts import fine_grained, moe_active, moe_params

D, H, E = 8, 16, 4
TOL = 1e-6


def _by_hand(moe, x):
    """sum over each token's top-k (by probability + bias) of gate x expert, plus the shared
    experts: the definition, token by token."""
    probs = F.softmax(moe.router(x), -1)
    out = torch.zeros_like(x)
    for t in range(len(x)):
        chosen = (probs[t] + moe.expert_bias).topk(moe.top_k).indices
        gates = probs[t, chosen] / (probs[t, chosen].sum() if moe.top_k > 1 else 1)
        for e, g in zip(chosen.tolist(), gates):
            out[t] += g * moe.experts[e](x[t])
        for s in moe.shared:
            out[t] += s(x[t])
    return out


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no F.grouped_mm")
def test_the_grouped_product_computes_what_the_loop_computes():
    """Uneven batches, one expert with none: outputs and every gradient alike."""
    got = {}
    for grouped in ("loop", "grouped_mm"):
        torch.manual_seed(0)
        moe = MoE(D, H, E, top_k=2, capacity_factor=0, grouped=grouped, bias_rate=1e-3)
        with torch.no_grad():
            moe.expert_bias[3] = -10.0  # expert 3 is never chosen
        x = torch.randn(40, D, requires_grad=True)
        moe(x).pow(2).sum().backward()
        got[grouped] = [x.grad] + [p.grad for p in moe.parameters()]
        counts = moe.last_stats["kept_per_expert"]
    assert counts[3] == 0 and len(set(counts[:3])) > 1  # empty and uneven
    worst = max((a - b).abs().max().item() for a, b in zip(*got.values())
                if a is not None and b is not None)
    print(f"grouped_mm against the loop: {worst:.1e} (counts {counts})")
    assert worst <= TOL


@pytest.mark.parametrize("top_k,n_shared", [(1, 0), (3, 1)])
def test_dropless_sends_every_choice_to_its_experts(top_k, n_shared):
    torch.manual_seed(1)
    moe = MoE(D, H, E, top_k=top_k, capacity_factor=0, n_shared=n_shared)
    with torch.no_grad():  # a skewed router: every token's first choice is expert 0
        moe.router.weight[0] = 0.0
        moe.router.weight[0, 0] = 10.0
    x = torch.randn(64, D)
    x[:, 0] = x[:, 0].abs() + 1
    y = moe(x)
    st = moe.last_stats
    assert st["dropped"] == 0 and st["kept_per_expert"] == st["tokens_per_expert"]
    assert sum(st["tokens_per_expert"]) == 64 * top_k
    assert max(st["tokens_per_expert"]) > 64 * top_k / E * 1.25  # a capacity of 1.25 would drop
    assert (y - _by_hand(moe, x)).abs().max() <= TOL


def test_the_bias_chooses_the_experts_and_the_probability_weighs_them():
    torch.manual_seed(2)
    moe = MoE(D, H, E, top_k=2, capacity_factor=0, bias_rate=0.1)
    x = torch.randn(32, D)
    before = moe.route(x)
    with torch.no_grad():
        moe.expert_bias[:] = torch.tensor([1.0, 1.0, 0.0, 0.0])  # larger than any gap
    after = moe.route(x)
    assert sorted(set(after.expert.tolist())) == [0, 1] != sorted(set(before.expert.tolist()))
    probs = F.softmax(moe.router(x), -1)
    for t, e, g in zip(after.token.tolist(), after.expert.tolist(), after.gate.tolist()):
        assert abs(g - (probs[t, e] / probs[t, :2].sum()).item()) <= TOL
    assert (moe(x) - _by_hand(moe, x)).abs().max() <= TOL


def test_the_bias_moves_against_the_load_of_the_training_forwards():
    """b_i += u sign(mean - load_i) over every training forward since the last update; an
    evaluation forward does not count; with no bias_rate nothing is kept."""
    torch.manual_seed(3)
    moe = MoE(D, H, E, top_k=1, capacity_factor=0, bias_rate=1e-3)
    x1, x2 = torch.randn(16, D), torch.randn(24, D)
    moe(x1)
    load = torch.tensor(moe.last_stats["tokens_per_expert"])
    moe(x2)
    load += torch.tensor(moe.last_stats["tokens_per_expert"])
    moe.eval()
    moe(torch.randn(50, D))  # evaluation: not the step's load
    moe.train()
    assert moe.load.tolist() == load.tolist()
    update_expert_bias([moe])
    want = 1e-3 * torch.sign(load.double().mean() - load.double())
    assert torch.allclose(moe.expert_bias.double(), want) and moe.load is None
    assert moe.expert_bias.abs().sum() > 0
    update_expert_bias([moe])  # no forward since: nothing to move
    assert torch.allclose(moe.expert_bias.double(), want)
    plain = MoE(D, H, E)
    plain(x1)
    assert plain.load is None and "expert_bias" in plain.state_dict()


def test_max_violation_is_the_busiest_over_the_mean_minus_one():
    assert max_violation([10, 10, 10, 10]) == 0
    assert math.isclose(max_violation([30, 10, 0, 0]), 30 / 10 - 1)


@pytest.mark.parametrize("n_experts,top_k,n_shared,hidden", [(4, 1, 0, 16), (16, 4, 1, 4)],
                         ids=["switch", "deepseekmoe"])
def test_parameters_and_flops_per_token_match_the_formulas(n_experts, top_k, n_shared, hidden):
    """Parameters of the module against moe_params; FLOPs per token counted by PyTorch's
    FlopCounterMode, dropless, against moe_active's two per weight met."""
    moe = MoE(D, hidden, n_experts, top_k=top_k, capacity_factor=0, n_shared=n_shared)
    p = moe_params(D, hidden, n_experts, n_shared)
    assert sum(q.numel() for q in moe.parameters()) == p["total"]
    assert sum(q.numel() for q in moe.shared.parameters()) == p["shared"]
    x = torch.randn(64, D)
    with FlopCounterMode(display=False) as counter:
        moe(x)
    assert counter.get_total_flops() / 64 == moe_active(D, hidden, n_experts, top_k,
                                                        n_shared)["forward_flops"]


def test_fine_grained_experts_keep_the_weights_and_multiply_the_choices():
    """DeepSeekMoE's segmentation, m = 4: 4 experts of width 16, top-1, against 16 of width 4,
    top-4: the matrices' weights in all and per token are equal (the biases and router are
    not); the combinations grow from 4 to C(16, 4) = 1820."""
    fg = fine_grained(D, H, E, 1, m=4)
    assert (fg["n_experts"], fg["top_k"], fg["hidden"]) == (16, 4, 4)
    assert (fg["coarse_combinations"], fg["combinations"]) == (4, 1820)
    coarse, fine = MoE(D, H, E, top_k=1), MoE(D, fg["hidden"], 16, top_k=4)

    def weights(m):
        return sum(q.numel() for n, q in m.named_parameters() if n.endswith("fc1.weight")
                   or n.endswith("fc2.weight"))
    assert weights(coarse) == weights(fine)
    assert moe_active(D, H, E, 1)["forward_flops"] - 2 * D * E == \
        moe_active(D, 4, 16, 4)["forward_flops"] - 2 * D * 16
    with pytest.raises(ValueError, match="does not split into m=3"):
        fine_grained(D, H, E, 1, m=3)


@pytest.mark.parametrize("kw", [dict(n_experts=4), dict(n_experts=8, top_k=2, expert_hidden=16,
                                                       n_shared_experts=2)])
def test_the_gpt_parameter_formula_counts_experts_shared_and_narrow(kw):
    """gpt_param_count (the loop's GPT, by formula) against the module: routed experts of
    expert_hidden width, the shared ones, the routers."""
    from distlab.models import GPT, GPTConfig, gpt_param_count
    c = GPTConfig(n_layer=2, n_embd=32, n_head=2, **kw)
    assert gpt_param_count(c) == GPT(c).num_params()
