"""Zero-bubble pipelining: backward split into B (the input's gradient) and W (the weights'),
and the ZB-H1 and ZBV schedules (Qi et al. 2024) and DualPipeV (DeepSeek-AI 2025) made from
it, as data and in one process. The runs on real ranks, equal to `single`, are in
tests/test_pipeline.py's launches ("pp zb1p", "pp zbv", "pp dualpipev").

Tolerances: the split computes each weight gradient as the same matmul autograd runs
(grad_outᵀ · input over all rows), so one process agrees with torch's own backward to fp32
round-off of a sum reordered by the reshape: atol 1e-6 on gradients of order 1e-2.
"""

import pytest
import torch

from distlab.models.gpt import GPT, GPTConfig
from distlab.parallel.pipeline.pp import bubble_formula, in_flight, make_schedule, simulate
from distlab.parallel.pipeline.split_backward import WeightGradStore, split_weight_gradients

CASES = [(2, 2), (2, 4), (3, 4), (3, 6), (4, 4), (4, 8), (4, 12), (6, 12), (8, 16)]


@pytest.mark.parametrize("p,m", CASES)
def test_zb1p_runs_each_op_once_in_order(p, m):
    for ops in make_schedule("zb1p", p, m):
        assert sorted(ops) == sorted((op, i, 0) for op in "FBW" for i in range(m))
        for i in range(m):
            assert ops.index(("F", i, 0)) < ops.index(("B", i, 0)) < ops.index(("W", i, 0))


@pytest.mark.parametrize("p,m", CASES)
def test_zb1p_bubble_is_the_formula_and_a_third_of_1f1b(p, m):
    """With F = B = W (the paper's setting), the simulated idle time per rank is
    (p-1)(F+B-2W) with B the whole backward: p - 1 units, against 1F1B's 3(p - 1)."""
    zb = simulate(make_schedule("zb1p", p, m), p, tf=1, tb=1, tw=1)
    total = max(e[4] for r in zb for e in r)
    assert total == 3 * m + (p - 1)
    assert 1 - 3 * m / total == pytest.approx(bubble_formula("zb1p", p, m, tf=1, tb=1, tw=1))
    one_f = simulate(make_schedule("1f1b", p, m), p, tf=1, tb=1, tw=1)
    assert max(e[4] for r in one_f for e in r) - 3 * m == 3 * (total - 3 * m)


@pytest.mark.parametrize("p,m", CASES)
def test_zb1p_holds_what_1f1b_holds(p, m):
    """Micro-batches between their F and their W (all they hold until then): at most p on any
    rank, 1F1B's p between F and backward."""
    ranks = make_schedule("zb1p", p, m)
    assert max(in_flight(ops, until="W") for ops in ranks) <= p
    assert max(in_flight(ops) for ops in ranks) == max(in_flight(ops) for ops in
                                                       make_schedule("1f1b", p, m))


ZBV_CASES = [(p, m) for p in (2, 3, 4, 5, 8, 10) for m in (2 * p, 2 * p + 1, 3 * p, 4 * p)]


@pytest.mark.parametrize("p,m", ZBV_CASES)
def test_zbv_runs_both_chunks_and_its_bubble_is_the_vs_fill(p, m):
    """Every (micro-batch, chunk) once, F before B before W; with F = B = W per chunk and
    m >= 2p the idle per rank is the V's fill, p - 1 chunk forwards, and the bubble at most
    half of 1F1B's at the same p and m (1F1B's stage is two chunks: F = 2, backward = 4)."""
    ranks = make_schedule("zbv", p, m, 2)
    for ops in ranks:
        assert sorted(ops) == sorted((op, i, c) for op in "FBW" for i in range(m)
                                     for c in range(2))
        for i in range(m):
            for c in range(2):
                assert ops.index(("F", i, c)) < ops.index(("B", i, c)) < ops.index(("W", i, c))
    timeline = simulate(ranks, p, 2, tf=1, tb=1, tw=1, kind="zbv")
    total = max(e[4] for r in timeline for e in r)
    assert total == 6 * m + (p - 1)
    zbv = 1 - 6 * m / total
    assert zbv == pytest.approx(bubble_formula("zbv", p, m, tf=1, tb=1, tw=1))
    assert zbv <= bubble_formula("1f1b", p, m) / 2
    # what a rank holds: at most 2p + 2 chunks between F and W, one micro-batch more than
    # 1F1B's p stages (each chunk is half a stage)
    assert max(in_flight(ops, until="W") for ops in ranks) <= 2 * p + 2


@pytest.mark.parametrize("p,m", [(5, 6), (8, 9), (4, 4)])
def test_zbv_with_fewer_than_2p_micro_batches_still_runs_every_op(p, m):
    ranks = make_schedule("zbv", p, m, 2)
    timeline = simulate(ranks, p, 2, tf=1, tb=1, tw=1, kind="zbv")
    assert sum(len(r) for r in timeline) == 6 * m * p


def test_zbv_places_the_v():
    from distlab.parallel.pipeline.pp import rank_stages, stage_rank
    assert [rank_stages(r, 4, 2, "zbv") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_rank(s, 4, "zbv") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


DUALPIPE_CASES = [(p, m) for p in (2, 3, 4, 5, 8) for m in (2 * p, 2 * p + 1, 3 * p, 5 * p + 3)]
OP_TIMES = [(1, 1, 1), (1, 2, 1), (1, 1.5, 0.7), (2, 1, 0.5), (1, 1, 0.2)]


@pytest.mark.parametrize("p,m", DUALPIPE_CASES)
def test_dualpipev_runs_every_op_and_stays_within_the_tables_bubble(p, m):
    """Every (micro-batch, chunk) once, F before B before W; chunks held until W at most 2p + 1
    (DeepSeek-AI's table: PP + 1 activations with PP = 2p stages); with F = B = W the idle per
    rank is p - 1 units, and for every op-time mix the simulated bubble never exceeds the
    table's (PP/2-1)(F&B+B-3W), a bound for this order."""
    ranks = make_schedule("dualpipev", p, m, 2)
    for ops in ranks:
        assert sorted(ops) == sorted((op, i, c) for op in "FBW" for i in range(m) for c in (0, 1))
        for i in range(m):
            for c in (0, 1):
                assert ops.index(("F", i, c)) < ops.index(("B", i, c)) < ops.index(("W", i, c))
        assert in_flight(ops, until="W") <= 2 * p + 1
    timeline = simulate(ranks, p, 2, tf=1, tb=1, tw=1, kind="dualpipev")
    total = max(e[4] for r in timeline for e in r)
    assert total - 6 * m == p - 1
    for tf, tb, tw in OP_TIMES:
        timeline = simulate(ranks, p, 2, tf=tf, tb=tb, tw=tw, kind="dualpipev")
        total = max(e[4] for r in timeline for e in r)
        busy = 2 * m * (tf + tb + tw)
        assert 1 - busy / total <= bubble_formula("dualpipev", p, m, tf=tf, tb=tb, tw=tw) + 1e-9


def test_dualpipev_needs_2p_micro_batches():
    with pytest.raises(ValueError, match="microbatches"):
        make_schedule("dualpipev", 4, 7, 2)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 8), (4, 13), (8, 16)])
def test_dualpipev_is_torchs_order(p, m):
    """Ours, written from the DualPipe repository's description, runs the ops torch's
    ScheduleDualPipeV lists for each rank, in the same order (its overlapped F&B read as the
    forward then the whole backward, a whole backward as B then its W)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "ScheduleDualPipeV"):
        pytest.skip(f"torch {torch.__version__} has no ScheduleDualPipeV")
    from types import SimpleNamespace
    from distlab.parallel.pipeline.pp import rank_stages
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "BW"}

    def ours(action, held):
        if action.sub_actions:
            return [op for a in action.sub_actions for op in ours(a, held)]
        op, c = kinds[action.computation_type.name], held.index(action.stage_index)
        return [("B", action.microbatch_index, c), ("W", action.microbatch_index, c)] \
            if op == "BW" else [(op, action.microbatch_index, c)]

    mine = make_schedule("dualpipev", p, m, 2)
    for r in range(p):
        fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m)  # all the method reads
        actions = schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, r)
        held = rank_stages(r, p, 2, "dualpipev")
        assert [op for a in actions if a is not None for op in ours(a, held)] == mine[r], r


def test_the_formula_moves_with_the_op_times():
    # W as costly as B: ZB-H1's idle is (p-1)·F; with W free it is 1F1B's
    assert bubble_formula("zb1p", 4, 8, of="ideal", tf=1, tb=1, tw=1) == pytest.approx(3 / 24)
    assert bubble_formula("zb1p", 4, 8, of="ideal", tf=1, tb=2, tw=0) == pytest.approx(
        bubble_formula("1f1b", 4, 8, of="ideal"))


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def test_split_backward_gives_torch_backwards_gradients():
    x = torch.randint(0, 64, (4, 17))
    ref = _model()
    ref(x[:, :-1], x[:, 1:]).backward()
    model, store = _model(), WeightGradStore()
    linears = split_weight_gradients(model, store)
    assert len(linears) == 2 * 6 + 1  # q, k, v, o, fc, proj per block, and the head
    with store.collecting("mb0"):
        model(x[:, :-1], x[:, 1:]).backward()
    # after B: the linear weights wait for W, everything else has its gradient
    assert all(m.weight.grad is None for m in linears)
    assert all(m.bias.grad is not None for m in linears if m.bias is not None)
    assert store.pending_bytes() > 0
    store.run("mb0")
    assert store.pending_bytes() == 0
    worst = max((a.grad - b.grad).abs().max().item()
                for a, b in zip(model.parameters(), ref.parameters()))
    assert worst <= 1e-6, worst


def test_two_micro_batches_accumulate_and_a_second_b_before_w_is_refused():
    xs = torch.randint(0, 64, (2, 4, 17))
    ref = _model()
    for x in xs:
        ref(x[:, :-1], x[:, 1:]).backward()
    model, store = _model(), WeightGradStore()
    split_weight_gradients(model, store)
    for i, x in enumerate(xs):  # B, B, then W, W: the order a schedule may choose
        with store.collecting(i):
            model(x[:, :-1], x[:, 1:]).backward()
    with pytest.raises(RuntimeError, match="still pending"):
        with store.collecting(0):
            pass
    store.run(1)
    store.run(0)
    worst = max((a.grad - b.grad).abs().max().item()
                for a, b in zip(model.parameters(), ref.parameters()))
    assert worst <= 1e-6, worst


def test_outside_a_collecting_block_the_gradient_is_whole():
    """A backward that is no pipeline's B (a user's own, an eval's) gets every gradient at once."""
    x = torch.randint(0, 64, (4, 17))
    ref, model = _model(), _model()
    split_weight_gradients(model, WeightGradStore())
    ref(x[:, :-1], x[:, 1:]).backward()
    model(x[:, :-1], x[:, 1:]).backward()
    assert all(torch.allclose(a.grad, b.grad, atol=1e-6)
               for a, b in zip(model.parameters(), ref.parameters()))


def test_weights_get_their_gradient_under_saved_tensors_hooks():
    """The pipeline counts stashed bytes with saved_tensors_hooks; W must still reach the
    Parameter's .grad (a saved-and-unpacked weight is another tensor there)."""
    x = torch.randint(0, 64, (4, 17))
    ref, model, store = _model(), _model(), WeightGradStore()
    split_weight_gradients(model, store)
    ref(x[:, :-1], x[:, 1:]).backward()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
        loss = model(x[:, :-1], x[:, 1:])
    with store.collecting(0):
        loss.backward()
    store.run(0)
    assert all(p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-6)
               for p, q in zip(model.parameters(), ref.parameters()))
