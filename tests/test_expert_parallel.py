"""Mixture of experts (distlab.models.moe) and expert parallelism (dispatch.py).

One process: capacity hands slots out first come, first served, first choices before second
(GShard); a dropped choice's output is zero; the auxiliary loss is E x sum f_i P_i by hand, 1
for a uniform router and more for a skewed one; bad settings are refused with the setting named.

Two ranks (one launch runs every case): a tiny model (Linear -> tanh -> residual MoE ->
Linear, MSE plus the auxiliary loss) trained STEPS SGD steps with its 4 experts spread 2 per
rank, each rank feeding its half of the global batch, against one process on the whole batch
with groups=2 (GShard's groups: each rank's tokens, which expert parallelism routes on their
own, get their own capacity and auxiliary loss). Top-1 and top-2, with no token dropped
(capacity_factor = E) and with half of them dropped (capacity_factor 0.5). The experts'
gradients before reduce_expert_parallel_grads are N times one process's (the combine's
backward sums the ranks' losses), after it equal; each rank's drop counts add up to one
process's; the bytes booked under ep.dispatch and ep.combine are the rows that crossed to the
other rank. A second launch of 4 ranks (one expert each, top-1, capacity_factor 1: some
choices dropped, some splits empty) against one process with groups=4.

The routing of DeepSeek-V3 and DeepSeekMoE in the same launch: dropless (capacity_factor 0),
top-3, a shared expert, the auxiliary-loss-free bias moving after every step on the loads
summed over the ranks (update_expert_bias), the experts as one grouped product where torch has
F.grouped_mm: equal to one process with 0 choices dropped. And a user's own MoE, a
Mixtral-shaped block written below (its own router and SwiGLU experts, its own forward in one
process), under expert_parallel against that forward in one process; a module that does not
keep the contract is refused naming what it lacks.

Tolerance: ATOL = 1e-5 on parameters after STEPS steps and on each step's loss, float32.
Against one process the same rows meet the same experts in the same order (rank 0's rows
first, as one process's group 0), so only the sums that cross ranks change order: the
replicated parameters' gradients, summed per rank then all-reduced, and the loss averaged over
the ranks. A few float32 ulps per step, carried by SGD with momentum. Measured on torch 2.13
CPU with gloo, 4 steps, every case and rank on 2 and 4 ranks (printed by the tests): at most
3.0e-8 on parameters and 1.2e-7 on losses, 83x under ATOL or more; the inputs are seeded, so
the figures repeat. A missing division of the experts' gradients by N, or a missing average of
the router's, is off by far more (checked in test_equal_to_one_process).

The `ep` strategy in the training loop (the GPT with MoE blocks, 2 ranks) against `single` with
moe_groups=2, top-1 and top-2, with and without drops: LOOP_ATOL = 1e-5 after 4 SGD steps, as
tests/test_equivalence.py (the same arithmetic as above through a deeper model; printed).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from api_models import max_diff
from torch import nn

from distlab import run_ranks
from distlab.comm import Comm
from distlab.models.moe import update_expert_bias
from distlab.parallel.expert import (
    MoE,
    expert_parallel,
    expert_parallel_state_dict,
    reduce_expert_parallel_grads,
)

ATOL = LOOP_ATOL = 1e-5
STEPS = 4
WORLD = 2
E, D, H = 4, 8, 16
B, T = 8, 4  # global batch: B rows of T tokens; each rank takes B / WORLD rows
COEF = 0.01
# (top_k, capacity_factor); (3, 0.0): DeepSeek's routing, with the settings of DEEPSEEK
CASES = [(1, float(E)), (2, float(E)), (1, 0.5), (2, 0.5), (3, 0.0)]
GROUPED = "grouped_mm" if hasattr(F, "grouped_mm") else "loop"  # torch 2.6 has none
DEEPSEEK = {(3, 0.0): dict(n_shared=1, bias_rate=0.01, grouped=GROUPED)}
CASE4 = (1, 1.0)  # on 4 ranks, one expert each: some choices dropped, some splits empty


class Net(nn.Module):
    def __init__(self, top_k, capacity_factor, groups=1):
        super().__init__()
        self.inp, self.out = nn.Linear(6, D), nn.Linear(D, 3)
        self.moe = MoE(D, H, E, top_k, capacity_factor, COEF, groups=groups,
                       **DEEPSEEK.get((top_k, capacity_factor), {}))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(h + self.moe(h))  # the residual carries a dropped token


def make(top_k, capacity_factor, groups=1):
    torch.manual_seed(0)
    return Net(top_k, capacity_factor, groups)


def data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, T, 6, generator=g), torch.randn(B, T, 3, generator=g)


def local(t, rank, world=WORLD):
    n = len(t) // world
    return t[rank * n:(rank + 1) * n]


def train(model, x_of, reduce=None, comms=()):
    """STEPS SGD steps; the losses, each step's MoE stats and balancing bias, the gradients of
    the first step (before `reduce`, and after it)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = {"losses": [], "stats": [], "bias": []}
    for step in range(STEPS):
        x, y = x_of(step)
        loss = F.mse_loss(model(x), y) + COEF * model.moe.aux_loss
        loss.backward()
        if step == 0:
            out["raw grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        if reduce is not None:
            reduce(model)
        if step == 0:
            out["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        update_expert_bias([model.moe], comms)
        out["losses"].append(loss.item())
        out["stats"].append(dict(model.moe.last_stats))
        out["bias"].append(model.moe.expert_bias.tolist())
    return out


def single(top_k, capacity_factor, world=WORLD):
    model = make(top_k, capacity_factor, groups=world)
    out = train(model, data)
    out["state"] = model.state_dict()
    return out


def ep(comm, top_k, capacity_factor):
    model = make(top_k, capacity_factor)
    expert_parallel(model.moe, comm)
    out = train(model, lambda s: tuple(local(t, comm.rank, comm.world) for t in data(s)),
                reduce_expert_parallel_grads, [comm])
    out["state"] = expert_parallel_state_dict(model)
    out["local experts"] = sorted(int(k) for k in model.moe.experts)
    return out


def balanced(n):
    """n tokens whose router sends token i to expert i % E (the router is 10 x identity on the
    first E features), so every rank sends each expert n / E rows."""
    x = torch.zeros(n, D)
    x[torch.arange(n), torch.arange(n) % E] = 1.0
    return x


def bytes_case(comm, kind):
    """One forward and backward of an expert-parallel MoE; the bytes booked per kind."""
    torch.manual_seed(1)
    moe = MoE(D, H, E, top_k=1, capacity_factor=float(E))
    if kind == "balanced":
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[:, :E] = 10 * torch.eye(E)
    expert_parallel(moe, comm)
    n = B * T // WORLD
    x = balanced(n) if kind == "balanced" else torch.randn(n, D) + comm.rank  # ranks differ
    x.requires_grad_()
    comm.take_step_stats()
    moe(x).square().sum().backward()
    stats, _ = comm.take_step_stats()
    return {"x": x.detach(), "router": moe.router.weight.detach(),
            "stats": {k: v for k, v in stats.items() if k.startswith("ep.")},
            "kept": moe.last_stats["kept_per_expert"]}


# -- a user's own MoE: a Mixtral-shaped block (Jiang et al. 2024), as a user writes it ---------
class MixtralRouter(nn.Module):
    """A linear gate, softmax, the top 2 renormalised: (weights, ids), each (tokens, 2)."""

    def __init__(self, d, n_experts, top_k=2):
        super().__init__()
        self.gate, self.top_k = nn.Linear(d, n_experts, bias=False), top_k

    def forward(self, x):
        weights, ids = F.softmax(self.gate(x), -1).topk(self.top_k, -1)
        return weights / weights.sum(-1, keepdim=True), ids


class SwiGLU(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtralBlock(nn.Module):
    """The contract of distlab.parallel.expert.user: `router` and `experts`; its own forward
    in one process loops over the experts, as Hugging Face's Mixtral block does."""

    def __init__(self, d, hidden, n_experts):
        super().__init__()
        self.router = MixtralRouter(d, n_experts)
        self.experts = nn.ModuleList(SwiGLU(d, hidden) for _ in range(n_experts))

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        weights, ids = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (ids == e).nonzero(as_tuple=True)
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.view(shape)


class ThreeIdsTwoWeights(nn.Module):
    def forward(self, x):
        return torch.ones(len(x), 2), torch.zeros(len(x), 3, dtype=torch.long)


class NoRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(SwiGLU(D, H) for _ in range(E))


class MixtralNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out, self.moe = nn.Linear(6, D), nn.Linear(D, 3), MixtralBlock(D, H, E)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(h + self.moe(h))


def mixtral():
    torch.manual_seed(0)
    return MixtralBlock(D, H, E)


def train_mixtral(model, x_of, reduce=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = x_of(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if reduce is not None:
            reduce(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def mixtral_single():
    torch.manual_seed(0)
    model = MixtralNet()
    return {"losses": train_mixtral(model, data), "state": model.state_dict()}


def mixtral_ep(comm):
    torch.manual_seed(0)
    model = MixtralNet()
    expert_parallel(model.moe, comm)
    losses = train_mixtral(
        model, lambda s: tuple(local(t, comm.rank, comm.world) for t in data(s)),
        reduce_expert_parallel_grads)
    return {"losses": losses, "state": expert_parallel_state_dict(model),
            "class": type(model.moe).__name__}


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def two_ranks(rank, world, device, log):
    comm = Comm()
    out = {("ep", k, cf): ep(comm, k, cf) for k, cf in CASES}
    out["bytes", "routed"] = bytes_case(comm, "routed")
    out["bytes", "balanced"] = bytes_case(comm, "balanced")
    out["errors"] = {"not divisible": _error(lambda: expert_parallel(MoE(D, H, 3), comm))}
    twice = expert_parallel(MoE(D, H, E), comm)
    out["errors"]["twice"] = _error(lambda: expert_parallel(twice, comm))
    out["errors"]["no ep layer"] = _error(lambda: reduce_expert_parallel_grads(Net(1, 1.0)))
    out["mixtral"] = mixtral_ep(comm)
    out["errors"]["no router"] = _error(lambda: expert_parallel(NoRouter(), comm))
    bad = expert_parallel(mixtral(), comm)
    bad.router = ThreeIdsTwoWeights()
    out["errors"]["bad routing"] = _error(lambda: bad(torch.randn(4, D)))
    return out


def four_ranks(rank, world, device, log):
    return ep(Comm(), *CASE4)


# -- the tests ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched():
    return run_ranks(two_ranks, WORLD, timeout_s=120)


@pytest.fixture(scope="module")
def launched4():
    return run_ranks(four_ranks, 4, timeout_s=120)


def _compare(got, top_k, capacity_factor):
    world = len(got)
    ref = single(top_k, capacity_factor, world)
    losses = [sum(r["losses"][s] for r in got) / world for s in range(STEPS)]
    loss = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
    for r, res in enumerate(got):
        assert res["local experts"] == list(range(r * E // world, (r + 1) * E // world))
        state = max_diff(res["state"], ref["state"])
        print(f"{world} ranks, top-{top_k}, capacity_factor {capacity_factor}, rank {r}: vs one "
              f"process: parameters after {STEPS} steps {state:.1e}, losses {loss:.1e}")
        assert state <= ATOL and loss <= ATOL
        # an expert's gradient arrives summed over the ranks' losses: N x one process's
        # until reduce_expert_parallel_grads divides it; the router's is this rank's share
        for name in res["raw grads"]:
            g, raw, want = res["grads"][name], res["raw grads"][name], ref["grads"][name]
            assert (g - want).abs().max() <= ATOL, name
            if ".experts." in name:
                assert (raw - world * want).abs().max() <= ATOL, name
        off = (res["raw grads"]["moe.router.weight"] - ref["grads"]["moe.router.weight"])
        assert off.abs().max() > 100 * ATOL  # so the check above has teeth
    return ref


@pytest.mark.parametrize("top_k,capacity_factor", CASES)
def test_equal_to_one_process(launched, top_k, capacity_factor):
    _compare([res["ep", top_k, capacity_factor] for res in launched], top_k, capacity_factor)


def test_equal_to_one_process_on_4_ranks(launched4):
    ref = _compare(launched4, *CASE4)
    assert all(st["dropped"] > 0 for st in ref["stats"])  # capacity_factor 1: some dropped
    splits = [st["kept_per_expert"] for res in launched4 for st in res["stats"]]
    print(f"4 ranks: kept rows per expert per rank and step {splits}")
    assert any(0 in s for s in splits)  # a rank sent some rank no row, at least once


@pytest.mark.parametrize("top_k,capacity_factor", CASES)
def test_drops_add_up_to_one_process_on_the_same_groups(launched, top_k, capacity_factor):
    ref = single(top_k, capacity_factor)["stats"]
    n = B * T // WORLD  # tokens per rank: one group
    for s in range(STEPS):
        ranks = [res["ep", top_k, capacity_factor]["stats"][s] for res in launched]
        for st in ranks:
            C = math.ceil(capacity_factor * n * top_k / E) if capacity_factor else n
            assert st["capacity"] == C == ref[s]["capacity"] and st["tokens"] == n
            assert st["kept_per_expert"] == [min(c, C) for c in st["tokens_per_expert"]]
            assert st["dropped"] == n * top_k - sum(st["kept_per_expert"])
        for key in ("tokens_per_expert", "kept_per_expert"):
            assert [sum(c) for c in zip(*(st[key] for st in ranks))] == ref[s][key]
        assert sum(st["dropped"] for st in ranks) == ref[s]["dropped"]
        # at most E x C of n x k choices fit: with capacity_factor 0.5, half are dropped;
        # with 0 (dropless) none
        assert (ref[s]["dropped"] > 0) == (0 < capacity_factor < 1)
    print(f"top-{top_k}, capacity_factor {capacity_factor}: dropped per step "
          f"{[st['dropped'] for st in ref]} of {B * T * top_k} choices")


def _routed_rows(x, router, rank):
    """Rows this rank sends to the other rank and receives from it, by one process's routing."""
    moe = MoE(D, H, E, top_k=1, capacity_factor=float(E))
    with torch.no_grad():
        moe.router.weight.copy_(router)
        moe(x)
    kept = moe.last_stats["kept_per_expert"]
    mine = range(rank * E // WORLD, (rank + 1) * E // WORLD)
    return sum(c for e, c in enumerate(kept) if e not in mine), kept, mine


@pytest.mark.parametrize("kind", ["routed", "balanced"])
def test_bytes_are_the_rows_that_cross(launched, kind):
    row = D * 4  # float32
    sent = []
    for r, res in enumerate(launched):
        case = res["bytes", kind]
        rows, kept, _ = _routed_rows(case["x"], case["router"], r)
        assert case["kept"] == kept
        sent.append(rows * row)
        st = case["stats"]
        print(f"{kind}, rank {r}: ep.dispatch sent {st['ep.dispatch']['bytes_sent']} B "
              f"({rows} rows x {row} B), kernel counted {st['ep.dispatch']['wire_sent']}")
        assert st["ep.dispatch"]["bytes_sent"] == rows * row
        # the gradients travel the same ways: the outputs' towards the experts
        assert st["ep.combine.grad"]["bytes_sent"] == st["ep.dispatch"]["bytes_sent"]
        assert st["ep.dispatch.grad"]["bytes_sent"] == st["ep.combine"]["bytes_sent"]
        assert st["ep.counts"]["bytes_sent"] == (E // WORLD) * 8  # the other rank's counts
    for r, res in enumerate(launched):  # what one rank sends, the other's combine sends back
        assert res["bytes", kind]["stats"]["ep.combine"]["bytes_sent"] == sent[1 - r]
    if kind == "balanced":  # distlab.theory.context_and_experts' formula, each direction
        from distlab.theory.context_and_experts import ep_dispatch_bytes
        want = ep_dispatch_bytes(B * T // WORLD, D, WORLD)
        for res in launched:
            st = res["bytes", kind]["stats"]
            assert 2 * st["ep.dispatch"]["bytes_sent"] == want["forward"]
            assert st["ep.combine"]["bytes_sent"] + st["ep.dispatch"]["bytes_sent"] == \
                want["forward"]
            assert st["ep.combine.grad"]["bytes_sent"] + st["ep.dispatch.grad"]["bytes_sent"] \
                == want["backward"]


def test_a_users_mixtral_block_under_ep_equals_its_own_forward(launched):
    """The Mixtral-shaped block above, its experts spread 2 per rank by expert_parallel, its
    forward replaced by the contract's sum with the rows sent by all-to-all: parameters and
    losses within ATOL of the block's own forward in one process (fp32; the same argument as
    for distlab's MoE: only the sums across ranks change order)."""
    ref = mixtral_single()
    losses = [sum(r["mixtral"]["losses"][s] for r in launched) / WORLD for s in range(STEPS)]
    loss = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
    for r, res in enumerate(launched):
        got = res["mixtral"]
        assert got["class"] == "ExpertParallelMixtralBlock"
        assert got["state"].keys() == ref["state"].keys()
        state = max_diff(got["state"], ref["state"])
        print(f"Mixtral-shaped block under ep, rank {r}: vs its own forward in one process: "
              f"parameters {state:.1e}, losses {loss:.1e}")
        assert state <= ATOL and loss <= ATOL
    torch.manual_seed(0)
    start = MixtralNet().state_dict()
    assert max_diff(ref["state"], start) > 100 * ATOL  # the steps moved the weights


def test_the_balancing_bias_moves_alike_on_every_rank_as_in_one_process(launched):
    """DeepSeek's case: each step the bias moves by bias_rate x sign(mean load - load) of the
    loads summed over the ranks; every rank's bias equals one process's, step by step, and it
    moved (so the loads were summed: one rank's own load gives other signs)."""
    case = (3, 0.0)
    ref = single(*case)
    for res in launched:
        assert res["ep", *case]["bias"] == ref["bias"]
    load = torch.tensor(ref["stats"][0]["tokens_per_expert"], dtype=torch.float64)
    want = 0.01 * torch.sign(load.mean() - load)
    assert torch.allclose(torch.tensor(ref["bias"][0], dtype=torch.float64), want, atol=1e-7)
    assert any(any(b) for b in ref["bias"])
    print(f"bias after each of {STEPS} steps: {ref['bias']}")


def test_errors_name_the_setting(launched):
    m = launched[0]["errors"]
    assert "n_experts=3 is not divisible by the group's 2 ranks" in m["not divisible"]
    assert "already expert-parallel" in m["twice"]
    assert "no expert-parallel MoE layer" in m["no ep layer"]
    assert "top_k=5 needs at least 5 experts" in _error(lambda: MoE(D, H, E, top_k=5))
    assert "top_k=0 must be a positive integer" in _error(lambda: MoE(D, H, E, top_k=0))
    for cf in (-1.0, float("nan")):
        assert "or 0 (dropless" in _error(lambda: MoE(D, H, E, capacity_factor=cf))
    assert "bias_rate=-0.1 must be" in _error(lambda: MoE(D, H, E, bias_rate=-0.1))
    assert "grouped='bmm' is not one of" in _error(lambda: MoE(D, H, E, grouped="bmm"))
    assert "n_shared=-1 must be" in _error(lambda: MoE(D, H, E, n_shared=-1))
    assert "NoRouter does not keep the MoE contract" in m["no router"]
    assert "it lacks a `router`" in m["no router"] and "`experts`" not in m["no router"]
    assert "router returned weights (4, 2) and ids (4, 3)" in m["bad routing"]
    assert "10 tokens do not split into groups=4" in _error(
        lambda: MoE(D, H, E, groups=4)(torch.randn(10, D)))
    assert "needs at least 2 experts" in _error(lambda: MoE(D, H, 1, top_k=2))
    assert _error(lambda: MoE(D, H, E, top_k=2, capacity_factor=0.1)) == "no error"


# -- one process -------------------------------------------------------------------------------
def _pinned(top_k, cf, n=8):
    """A router that sends every token's first choice to expert 0 and its second to expert 1,
    except token 0: first choice expert 1, second expert 0 (features 0 and 1 only)."""
    moe = MoE(D, H, E, top_k=top_k, capacity_factor=cf)
    x = torch.zeros(n, D)
    x[:, 0], x[0, 1] = 1.0, 1.0
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0], moe.router.weight[1, 0], moe.router.weight[1, 1] = 5, 2.5, 5
    return moe, x


def test_capacity_is_first_come_first_served():
    moe, x = _pinned(top_k=1, cf=0.5)  # C = ceil(0.5 x 8 / 4) = 1
    r = moe.route(x)
    assert moe.last_stats["capacity"] == 1
    assert sorted(zip(r.token.tolist(), r.expert.tolist())) == [(0, 1), (1, 0)]
    assert moe.last_stats["dropped"] == 8 - 2
    # top-2, C = ceil(0.5 x 8 x 2 / 4) = 2: token 0's second choice (expert 0) comes after every
    # first choice, so tokens 1 and 2 take expert 0's slots; by token order alone token 0 would
    moe, x = _pinned(top_k=2, cf=0.5)
    r = moe.route(x)
    assert moe.last_stats["capacity"] == 2
    assert sorted(zip(r.token.tolist(), r.expert.tolist())) == [(0, 1), (1, 0), (1, 1), (2, 0)]


@pytest.mark.parametrize("top_k", [1, 2])
def test_a_dropped_token_gets_zero_and_a_kept_one_its_gated_experts(top_k):
    torch.manual_seed(3)
    moe = MoE(D, H, E, top_k=top_k, capacity_factor=0.5)
    x = torch.randn(2, 8, D)
    y = moe(x).view(-1, D)
    r = moe.route(x.view(-1, D))
    xf = x.view(-1, D)
    want = torch.zeros_like(y)
    for t, e, g in zip(r.token.tolist(), r.expert.tolist(), r.gate):
        want[t] += g * moe.experts[e](xf[t])
    assert (y - want).abs().max() <= 1e-6
    dropped = sorted(set(range(16)) - set(r.token.tolist()))
    assert dropped and (y[dropped] == 0).all()
    # gates: top-1 the router's probability, top-2 the two best renormalised to sum 1
    probs = F.softmax(moe.router(xf), -1)
    best = probs.topk(top_k, -1)
    for t, e, g in zip(r.token.tolist(), r.expert.tolist(), r.gate.tolist()):
        want_g = probs[t, e] / (best.values[t].sum() if top_k == 2 else 1)
        assert abs(g - want_g.item()) <= 1e-6


def _aux_by_hand(moe, x, groups=1):
    probs = F.softmax(x @ moe.router.weight.T, -1).view(groups, -1, E)
    f = F.one_hot(probs.argmax(-1), E).double().mean(1)
    return (E * (f * probs.double().mean(1)).sum(-1)).mean().item()


def test_aux_loss_is_switch_by_hand():
    torch.manual_seed(4)
    x = torch.randn(32, D)
    moe = MoE(D, H, E)
    for groups in (1, 4):
        moe.groups = groups
        moe(x)
        assert abs(moe.aux_loss.item() - _aux_by_hand(moe, x, groups)) <= 1e-6
    moe.groups = 1
    moe.aux_loss.backward()  # in the graph: the router learns from it
    assert moe.router.weight.grad.abs().max() > 0
    with torch.no_grad():
        moe.router.weight.zero_()  # uniform router: P_i = 1/E, aux = sum f_i = 1
    moe(x)
    assert abs(moe.aux_loss.item() - 1.0) <= 1e-6
    x[:, 0] = 1.0
    with torch.no_grad():
        moe.router.weight[0, 0] = 3.0  # every token leans towards expert 0
    moe(x)
    skewed = moe.aux_loss.item()
    print(f"aux loss: uniform router 1.0, skewed {skewed:.3f}, by hand "
          f"{_aux_by_hand(moe, x):.3f}")
    assert abs(skewed - _aux_by_hand(moe, x)) <= 1e-6 and skewed > 1.1


# -- the ep strategy in the training loop ------------------------------------------------------
LOOP = dict(steps=4, optimizer="sgd", lr=0.1, global_batch=8, seq_len=16, n_layer=2,
            n_embd=32, n_head=2, mlp_ratio=2, n_experts=4, timeout_s=60)
# DeepSeek's routing in the loop: dropless, top-2 of 4 narrow experts and a shared one, the
# balancing bias and no auxiliary loss
DEEPSEEK_LOOP = dict(top_k=2, capacity_factor=0.0, n_shared_experts=1, expert_hidden=16,
                     expert_bias_rate=0.01, aux_loss_coef=0.0, expert_grouped=GROUPED)
LOOP_CASES = {"top-1": dict(top_k=1, capacity_factor=4.0),
              "top-1 dropping": dict(top_k=1, capacity_factor=0.5), "deepseek": DEEPSEEK_LOOP}


@pytest.fixture(scope="module")
def loop_runs():
    """Every case's `single` (moe_groups=2) in one launch, every case's `ep` in another (each
    config trained in turn: launches cost seconds): {case: (single's result, ep's per rank)}."""
    from distlab import RunConfig
    from distlab.rank.train import train_with_state
    base = {k: RunConfig(**LOOP, **v) for k, v in LOOP_CASES.items()}
    single = run_ranks(train_with_state, 1, [c.replace(moe_groups=2).to_dict()
                                             for c in base.values()], timeout_s=120)[0]
    ep = run_ranks(train_with_state, 2, [c.replace(strategy="ep", world_size=2).to_dict()
                                         for c in base.values()], timeout_s=120)
    return {k: (single[i], [r[i] for r in ep]) for i, k in enumerate(base)}


@pytest.mark.parametrize("case", list(LOOP_CASES))
def test_ep_strategy_follows_single_with_a_group_per_rank(loop_runs, case):
    """`ep` on 2 ranks against `single` with moe_groups=2 (the same tokens per group, so the
    same capacity, drops and balance loss): parameters and the balancing bias within
    LOOP_ATOL after 4 SGD steps. Capacity factor 0.5 keeps at most half of each group's
    tokens: drops are certain. Top-2 with capacity is the dispatch-level tests' (above)."""
    single, results = loop_runs[case]
    for r, res in enumerate(results):
        state = res["state"]
        assert state.keys() == single["state"].keys()
        worst = max((state[k] - single["state"][k]).abs().max().item() for k in state)
        print(f"ep {case}, rank {r}: vs single {worst:.1e}")
        assert worst <= LOOP_ATOL
    bias = [v for k, v in single["state"].items() if k.endswith("expert_bias")]
    assert len(bias) == LOOP["n_layer"]
    assert any(b.abs().max() > 0 for b in bias) == bool(LOOP_CASES[case].get("expert_bias_rate"))


@pytest.mark.parametrize("fields,says", [
    (dict(strategy="ep", world_size=2, n_experts=0), "set n_experts"),
    (dict(strategy="ep", world_size=4, n_experts=6), "divisible by world_size=4"),
    (dict(strategy="tp", world_size=2), "a mixture of experts runs under"),
    (dict(top_k=5), "top_k is at most n_experts"),
    (dict(capacity_factor=-1.0), "capacity_factor=-1.0 must be"),
    (dict(expert_bias_rate=-1e-3), "expert_bias_rate=-0.001 must be"),
    (dict(expert_grouped="bmm"), "expert_grouped"),
    (dict(strategy="allreduce", world_size=2, moe_groups=3), "must be a multiple of the 2"),
])
def test_moe_settings_are_checked_before_anything_starts(fields, says):
    from distlab import RunConfig
    with pytest.raises(ValueError, match=says):
        RunConfig(**{**LOOP, **fields})


def test_capacity_parameters_and_flops_formulas_match_the_module():
    """distlab.theory.context_and_experts against the MoE it describes: capacity per expert,
    parameters in all and per rank under ep, FLOPs per token independent of E."""
    from distlab.theory.context_and_experts import expert_capacity, moe_layer_per_rank, moe_params
    for k, cf, n in ((1, 1.25, 100), (2, 1.0, 64), (1, 0.5, 33)):
        assert MoE(D, H, E, top_k=k, capacity_factor=cf).capacity(n) == \
            expert_capacity(n, E, cf, k)
    moe = MoE(D, H, E)
    assert sum(p.numel() for p in moe.parameters()) == moe_params(D, H, E)["total"]
    local = sum(p.numel() for p in moe.router.parameters()) + sum(
        p.numel() for e in list(moe.experts)[:E // 2] for p in e.parameters())
    assert moe_layer_per_rank(D, H, E, ep=2)["params_per_rank"] == local
    flops = {e: moe_layer_per_rank(D, H, e, ep=1, top_k=1)["train_flops_per_token"] - 6 * D * e
             for e in (4, 8, 64)}
    assert len(set(flops.values())) == 1  # beyond the router, E does not change the work
