"""The parallelism planner (distlab.theory.plan) on worked examples: published figures and the
interview questions the workbook answers (notebook 07); its context- and expert-parallel
dimensions against their formulas (distlab.theory.context_and_experts).

Assumptions throughout (each test names its own on top):
  - mixed-precision Adam, 16 bytes per parameter (ZeRO paper), 2-byte activations and
    gradients on the wire; Korthikanti et al.'s activation formulas; GB = 1e9 bytes.
  - A100 80 GB, 8 per node, NVLink 3 (300 GB/s per direction) inside a node, InfiniBand HDR
    (25 GB/s per GPU) between nodes, bf16 peak 312 TFLOP/s (NVIDIA datasheets); the whole
    80 GB usable unless a test says otherwise.
  - data-parallel communication fully exposed (dp_overlap=0), tensor- and pipeline-parallel
    communication exposed; ZeRO-2/3 not combined with pipeline parallelism (DeepSpeed).
  - "mfu" is the fraction of peak the GPUs reach on the model's own FLOPs; recomputation,
    the pipeline bubble and exposed communication come on top of it.
"""


import pytest

from distlab.theory.context_and_experts import ep_dispatch_bytes, ring_attention_bytes
from distlab.theory.estimate import (MIXED_ADAM, korthikanti_layer_activation_bytes,
                                     zero_model_states)
from distlab.theory.plan import (A100_BF16_FLOPS, DAY, GPT3_175B, RECOMPUTE, Cluster, Model,
                                 best, cp_comm_time, evaluate, max_micro_batch, memory_per_gpu,
                                 plan, recompute_overhead, table, training_time)
from distlab.units import GB

A100 = dict(gpus_per_node=8, memory=80 * GB)


# -- training time: 6ND ------------------------------------------------------------------------
def test_gpt3_training_time_narayanan():
    """Narayanan et al. 2021, Section 5.1: GPT-3 (175B) on 300B tokens, 1024 A100s at an
    achieved 140 TFLOP/s per GPU: "about 34 days". Their estimate is 8·T·P/(n·X): they count
    full activation recomputation (an extra forward), so 8 FLOPs per parameter per token.
    The plain 6ND count at the same 140 TFLOP/s gives 25.4 days: 34 days is 6ND only at
    105 TFLOP/s of model FLOPs (MFU 105/312 = 0.34). At MFU 0.5 (156 TFLOP/s) 6ND gives 22.8."""
    N, D, n = 175e9, 300e9, 1024
    assert training_time(N, D, n, 140e12, 1.0, flops_per_param_token=8) / DAY == \
        pytest.approx(33.9, abs=0.05)
    assert training_time(N, D, n, 140e12, 1.0) / DAY == pytest.approx(25.4, abs=0.05)
    assert training_time(N, D, n, 312e12, 140 / 312 * 6 / 8) / DAY == pytest.approx(33.9, abs=0.05)
    assert training_time(N, D, n, 312e12, 0.5) / DAY == pytest.approx(22.8, abs=0.05)


def test_training_time_is_6nd_over_throughput():
    assert training_time(1e9, 1e12, 8, 1e14, 0.5) == pytest.approx(6e21 / (8 * 1e14 * 0.5))


# -- GPT-3 175B: Megatron's layout ---------------------------------------------------------------
def test_gpt3_175b_needs_tensor_and_pipeline_parallelism():
    """Narayanan et al. 2021 train GPT models of 145.6B-1T parameters with t = 8 (a whole
    DGX A100 node) and p >= 8 on 1536+ A100 80 GB GPUs. GPT-3 shape (96 layers, h = 12288,
    96 heads, s = 2048, V = 51200), batch 1536 sequences (theirs for GPT-3), 1536 GPUs, MFU 0.5.
    Checks: with no ZeRO (Megatron's PTD-P) no layout with t·p = 1 fits (2.8 TB of model states
    per GPU); t = 8, p = 8 (dp = 24) fits; the planner's fastest layout uses t = 8 and
    t·p >= 64. ZeRO-3 over all 1536 GPUs with full recomputation does fit in memory, and ranks
    far behind: 3 gathers of 350 GB of bf16 weights per step over 25 GB/s links."""
    c = Cluster(gpus=1536, **A100)
    rows = plan(GPT3_175B, c, 1536, mfu=0.5, fits_only=False)
    assert not [r for r in rows if r.tp * r.pp == 1 and r.zero == 0 and r.fits]
    r88 = [r for r in rows if (r.tp, r.pp) == (8, 8) and r.zero == 0 and r.fits]
    assert r88 and r88[0].dp == 24
    fit = [r for r in rows if r.fits]
    assert fit[0].tp == 8 and fit[0].tp * fit[0].pp >= 64
    z3 = [r for r in fit if r.tp * r.pp == 1]
    assert z3 and all(r.zero == 3 and r.recompute == "full" for r in z3)
    assert z3[0].step_s > 3 * fit[0].step_s
    # t = 8, p = 8, b = 1, selective, stage 0: 43.75 GB of states + 10.3 GB of activations
    r = evaluate(GPT3_175B, c, 1536, 24, 8, 8, 0, 1, "selective", 0.5)
    assert r.states / GB == pytest.approx(16 * GPT3_175B.params / 64 / 1e9)
    assert r.activations / GB == pytest.approx(34 * 2048 * 12288 / 8 * 12 * 8 / 1e9)


# -- 512 GPUs: "start with DP=64, PP=8, TP=1; add TP if needed" ----------------------------------
@pytest.mark.parametrize("name,model,fits", [
    ("13B", Model(40, 5120, 40), True),
    ("70B", Model(80, 8192, 64), False),
    ("175B", GPT3_175B, False),
])
def test_512_gpus_dp64_pp8_tp1(name, model, fits):
    """The interview question ("512 GPUs: DP=64, PP=8, TP=1?") names no model: checked for three GPT
    shapes (s = 2048, V = 51200), global batch 512 sequences, micro-batch 1, no recomputation,
    no ZeRO. DP=64, PP=8, TP=1 fits a 13B model (26 GB of states + 48 GB of activations); at
    70B the states alone are 130 GB per GPU and at 175B 349 GB."""
    c = Cluster(gpus=512, **A100)
    r = evaluate(model, c, 512, 64, 1, 8, 0, 1, "none", 0.5)
    assert r.fits is fits


def test_512_gpus_adding_tp_splits_activations_not_model_states():
    """The question's "add TP if needed: DP=64, PP=4, TP=2" keeps t·p = 8, so the model states
    per GPU do not change at all; what halves is the activation memory (sequence parallelism
    splits every activation t ways, and 1F1B's first stage holds p micro-batches of L/p layers,
    L layers' worth whatever p is). So adding TP is needed when activations, not states, are
    what overflow: a 70B-class model (80 layers, h = 8192, 64 heads) with ZeRO-1 and no
    recomputation needs 187 GB at TP=1 and 110 GB at TP=2, fitting at TP=4 (72 GB), or at TP=1
    with selective recomputation. At 175B even ZeRO-1's 91 GB of states overflow with t·p = 8:
    the data-parallel degree has to drop below 64."""
    c = Cluster(gpus=512, **A100)
    m = Model(80, 8192, 64)
    a = evaluate(m, c, 512, 64, 1, 8, 1, 1, "none", 0.5)
    b = evaluate(m, c, 512, 64, 2, 4, 1, 1, "none", 0.5)
    d = evaluate(m, c, 512, 64, 4, 2, 1, 1, "none", 0.5)
    assert a.states == pytest.approx(b.states) == pytest.approx(d.states)
    assert b.activations == pytest.approx(a.activations / 2)
    assert (a.fits, b.fits, d.fits) == (False, False, True)
    assert evaluate(m, c, 512, 64, 1, 8, 1, 1, "full", 0.5).fits
    for t, p in ((1, 8), (2, 4), (4, 2), (8, 1)):
        for z in (0, 1):
            assert not any(evaluate(GPT3_175B, c, 512, 64, t, p, z, 1, rc, 0.5).fits
                           for rc in RECOMPUTE)
    top = best(GPT3_175B, c, 512, 0.5)
    assert top.dp < 64 and top.tp * top.pp > 8


# -- 70B on 8 GPUs ------------------------------------------------------------------------------
def test_70b_on_8_gpus():
    """The question's "70B model, 8 GPUs -> FSDP stores ~9B params per GPU": 70B/8 = 8.75B
    parameters, but with mixed-precision Adam that is 140 GB of model states per GPU: 1.12 TB
    in all against 8 × 80 = 640 GB. Plain DP (1.12 TB per GPU) does not fit; neither does
    ZeRO-3/FSDP, TP = 8, nor any other layout. With the optimizer state offloaded to CPU
    memory (ZeRO-Offload) ZeRO-3 keeps 4 bytes per parameter / 8 = 35 GB on each GPU and fits.
    Shape: 80 layers, h = 8192, 64 heads, s = 4096, Ψ = 70e9; global batch 64 sequences.
    (Offload is costed in memory only: its PCIe traffic and CPU optimizer step are not timed.)"""
    m = Model(80, 8192, 64, 4096, 32000, n_params=70e9)
    c = Cluster(gpus=8, **A100)
    ddp = evaluate(m, c, 64, 8, 1, 1, 0, 1, "full", 0.5)
    assert ddp.states / GB == pytest.approx(1120) and not ddp.fits
    assert evaluate(m, c, 64, 8, 1, 1, 3, 1, "full", 0.5).states / GB == pytest.approx(140)
    assert plan(m, c, 64, 0.5, zero23_with_pp=True) == []
    off = plan(m, c, 64, 0.5, zero_stages=(3,), offload=("optim",))
    z3 = [r for r in off if r.dp == 8]
    assert z3 and z3[0].states / GB == pytest.approx(35)


# -- 8× A100 80 GB, a "60 GB model": DDP vs FSDP -------------------------------------------------
def test_8xa100_60gb_model_ddp_vs_fsdp():
    """The question: 8 A100 80 GB, a model whose states take 60 GB; DDP leaves 20 GB per GPU
    for activations, FSDP (ZeRO-3) shards the states to 7.5 GB. Reading "60 GB" as mixed-Adam
    model states: Ψ = 3.75B at 16 bytes; shape 18 layers, h = 4096, 32 heads, s = 2048.
    Largest micro-batch per GPU (Korthikanti activations, 18 layers):
        recompute   none  selective  full
        DDP            1          3    15
        FSDP           4         14    57
    With selective recomputation FSDP's 14 sequences per GPU are the question's 229K tokens
    per step (8 × 14 × 2048); DDP's 3 are 49K (the question says 4 and 65K).
    But tokens per step is not throughput: with gradient accumulation DDP runs the same global
    batch at the same FLOP rate. At batch 512 and MFU 0.5 the planner has DDP at least as fast
    as FSDP (FSDP gathers the weights again for every micro-batch), not 3.5× slower."""
    m = Model(18, 4096, 32, 2048, 50257, n_params=3.75e9)
    c = Cluster(gpus=8, **A100)
    assert memory_per_gpu(m, c, 8, 1, 1, 0, 1, "none", 1)[0] / GB == pytest.approx(60)
    got = {z: [max_micro_batch(m, c, 8, 1, 1, z, rc) for rc in RECOMPUTE] for z in (0, 3)}
    assert got == {0: [1, 3, 15], 3: [4, 14, 57]}
    assert 8 * got[3][1] * m.seq == 229376
    ddp = best(m, c, 512, 0.5, zero_stages=(0,))
    fsdp = [r for r in plan(m, c, 512, 0.5, zero_stages=(3,)) if r.tp * r.pp == 1][0]
    assert (ddp.dp, ddp.tp, ddp.pp) == (8, 1, 1)
    assert ddp.tokens_per_s >= fsdp.tokens_per_s
    assert ddp.tokens_per_s / fsdp.tokens_per_s < 1.5


# -- mechanics ----------------------------------------------------------------------------------
def test_plan_sorted_fitting_and_partitions_the_cluster():
    c = Cluster(gpus=64, **A100)
    m = Model(32, 4096, 32)
    rows = plan(m, c, 256, 0.5)
    assert rows and all(r.fits and r.dp * r.tp * r.pp == 64 for r in rows)
    assert all(r.tp <= 8 and m.n_layer % r.pp == 0 for r in rows)
    assert [r.step_s for r in rows] == sorted(r.step_s for r in rows)
    r = rows[0]
    assert r.step_s == pytest.approx(r.compute_s + r.bubble_s + r.dp_comm_s + r.tp_comm_s
                                     + r.pp_comm_s)
    assert r.tokens_per_s == pytest.approx(256 * 2048 / r.step_s)
    assert 0 < r.mfu <= 0.5
    assert "tok/s" in table(rows, 3)


def test_bubble_and_recompute_overheads():
    """Bubble (p-1)/(m+p-1) of the total; full recomputation +1/3 of the compute."""
    c = Cluster(gpus=64, **A100)
    m = Model(32, 4096, 32)
    r = evaluate(m, c, 256, 8, 1, 8, 1, 1, "full", 0.5)  # m = 32 micro-batches, p = 8
    ideal = training_time(m.params, 256 * 2048, 64, c.peak_flops, 0.5)
    assert r.compute_s == pytest.approx(ideal * 4 / 3)
    assert r.bubble_s / (r.compute_s + r.bubble_s) == pytest.approx(7 / (32 + 7))
    assert evaluate(m, c, 256, 8, 1, 8, 1, 3, "none", 0.5) is None  # 32 rows don't split by 3


def test_zero_bubble_schedules_are_priced_and_chosen_for_a_deep_pipeline():
    """With F = B = W, ZB-H1's bubble is a third of 1F1B's and ZBV's a sixth (m >= 2p), the
    simulated timelines' figures (tests/test_zero_bubble.py); ZB-H1 holds 1F1B's activations
    and ZBV one micro-batch more. A deep pipeline with few micro-batches per step is where
    the schedule matters: there the planner, offered them, picks a zero-bubble one, and the
    step it prices is shorter by the bubble it removed."""
    c = Cluster(gpus=64, **A100)
    m = Model(32, 4096, 32)
    rows = {sc: evaluate(m, c, 128, 8, 1, 8, 1, 1, "full", 0.5, schedule=sc)
            for sc in ("1f1b", "zb1p", "zbv", "dualpipev")}  # p = 8, 16 micro-batches: m = 2p
    assert rows["zb1p"].bubble_s == pytest.approx(rows["1f1b"].bubble_s / 3)
    assert rows["zbv"].bubble_s == pytest.approx(rows["1f1b"].bubble_s / 6)
    # DualPipeV idles as ZBV (its simulated order: p - 1 units) and holds 2p + 1 chunks, not
    # 2p + 2
    assert rows["dualpipev"].bubble_s == pytest.approx(rows["zbv"].bubble_s)
    assert rows["zb1p"].activations == rows["1f1b"].activations < rows["dualpipev"].activations \
        < rows["zbv"].activations
    for sc in ("zbv", "dualpipev"):  # m < 2p
        assert evaluate(m, c, 64, 8, 1, 8, 1, 1, "full", 0.5, schedule=sc) is None
    only = best(m, c, 128, 0.5, micro_batches=[1], schedules=("1f1b",))
    offered = best(m, c, 128, 0.5, micro_batches=[1], schedules=("1f1b", "zb1p", "zbv"))
    assert only.schedule == "1f1b" and only.pp > 1
    assert offered.schedule in ("zb1p", "zbv") and offered.step_s < only.step_s
    # with one stage there is nothing to schedule: pp = 1 rows come once, as the first
    flat = plan(m, Cluster(gpus=8, **A100), 64, 0.5, schedules=("1f1b", "zb1p"))
    assert all(r.schedule == "1f1b" for r in flat if r.pp == 1)
    with pytest.raises(ValueError, match="prices"):
        evaluate(m, c, 128, 8, 1, 8, 1, 1, "full", 0.5, schedule="dualpipe")


# -- recomputation overheads against Korthikanti et al. 2022 -----------------------------------
# Shapes from Korthikanti et al. 2022, Table 3: GPT-3 175B and MT-NLG 530B, s = 2048, V = 51200.
MT_NLG_530B = Model(105, 20480, 128, 2048, 51200)


@pytest.mark.parametrize("model,paper", [(GPT3_175B, 0.027), (MT_NLG_530B, 0.016)])
def test_selective_recompute_overhead_korthikanti(model, paper):
    """Korthikanti et al. 2022, Section 5: selective recomputation costs 2.7% extra FLOPs for
    GPT-3 175B and 1.6% for MT-NLG 530B (their hardware FLOPs, Appendix A, 72Bslh²(1 + s/(3h)
    + V/(12hl)), over their model FLOPs, 72Bslh²(1 + s/(6h) + V/(12hl))). The formula gives
    2.69% and 1.64%; the paper prints one decimal of a percent, so the tolerance is half of
    its last digit, 0.05 percentage point."""
    assert recompute_overhead(model, "selective") == pytest.approx(paper, abs=0.0005)


@pytest.mark.parametrize("model", [GPT3_175B, MT_NLG_530B])
def test_full_recompute_overhead_against_korthikanti_formula(model):
    """Full recomputation adds one forward: the planner's +1/3 (Narayanan et al.'s 8ND over
    6ND). Korthikanti et al.'s exact count, 96Bslh²(1 + s/(6h) + V/(16hl)) over
    72Bslh²(1 + s/(6h) + V/(12hl)), is 33.2% for GPT-3 and 33.3% for MT-NLG: 1/3 less the
    logit layer's forward, which is not recomputed (2BshV, V/(36hl) of the model FLOPs:
    0.12 and 0.06 percentage point), so 1/3 is within 0.2 point. Their measured 36-39%
    (Table 4) is time, not FLOPs."""
    s, h, n, v = model.seq, model.hidden, model.n_layer, model.vocab
    paper = 4 / 3 * (1 + s / (6 * h) + v / (16 * h * n)) / (1 + s / (6 * h) + v / (12 * h * n)) - 1
    assert recompute_overhead(model, "full") == pytest.approx(paper, abs=0.002)
    assert recompute_overhead(model, "none") == 0.0
    with pytest.raises(ValueError):
        recompute_overhead(model, "partial")


# -- the fourth and fifth dimensions: context and expert parallelism ---------------------------
LLAMA8B_256K = Model(32, 4096, 32, seq=262144, vocab=128256, n_params=8.0e9)


def test_a_256k_token_sequence_fits_no_3d_layout_and_fits_with_context_parallelism():
    """An 8B model on 64 A100s (80 GB), 8 sequences of 256k tokens per step: every dp x tp x
    pp layout, ZeRO stage, micro-batch and recomputation overflows (activations grow with s);
    splitting the sequence over cp ranks fits. The question "how do you train on 128k-token
    sequences?" at twice the length."""
    cluster = Cluster(gpus=64)
    assert best(LLAMA8B_256K, cluster, global_batch=8) is None
    row = best(LLAMA8B_256K, cluster, global_batch=8, cps=(1, 2, 4, 8, 16))
    assert row is not None and row.cp > 1 and row.fits
    assert row.dp * row.tp * row.pp * row.cp == 64
    assert row.cp_comm_s > 0  # the ring's traffic is in the step


def test_context_parallel_memory_is_the_layer_formula_at_s_over_cp():
    """Activations per GPU under cp are Korthikanti's per-layer bytes at s/cp; the model
    states are those of ZeRO over dp·cp replicas (cp ranks hold the same parameters)."""
    m, c = LLAMA8B_256K, Cluster(gpus=64)
    for cp in (1, 2, 8):
        states, acts = memory_per_gpu(m, c, 64 // (8 * cp), 8, 1, 2, 1, "selective", 1, cp=cp)
        layer = korthikanti_layer_activation_bytes(m.seq // cp, 1, m.hidden, m.heads, 8, True,
                                                   "selective")
        assert acts == layer * m.n_layer
        assert states == zero_model_states(m.params / 8, 8, 2, MIXED_ADAM).device


def test_context_parallel_time_is_the_ring_formula():
    m, c = LLAMA8B_256K, Cluster(gpus=64)
    ring = ring_attention_bytes(1, m.seq, m.hidden // 8, 4, 2)
    link = c.intra if 8 * 4 <= c.gpus_per_node else c.inter
    per_layer = (3 + 4) * link.alpha_s + (ring["forward"] + ring["backward"]) / link.bandwidth_Bps
    assert cp_comm_time(m, c, 8, 1, 4, 1, 1) == pytest.approx(m.n_layer * per_layer)


MOE = Model(32, 4096, 32, seq=4096, vocab=32000, experts=8, top_k=2, capacity_factor=1.25)


def test_a_mixture_of_experts_counts_every_expert_but_computes_with_k():
    """Parameters: each MLP (8h²) replaced by E of them; FLOPs per token follow the k
    experts a token meets (Fedus et al. 2021); a dense model is unchanged."""
    mlp = MOE.n_layer * 8 * MOE.hidden ** 2
    assert MOE.params == pytest.approx(MOE.dense_params + 7 * mlp)
    assert MOE.active_params == pytest.approx(MOE.dense_params + mlp)
    dense = Model(32, 4096, 32, seq=4096, vocab=32000)
    assert dense.params == dense.active_params == MOE.dense_params
    r = evaluate(MOE, Cluster(gpus=64), 512, 16, 2, 2, 1, 1, "none", 0.5, ep=4)
    assert r.compute_s == pytest.approx(training_time(MOE.active_params, 512 * 4096, 64,
                                                      A100_BF16_FLOPS, 0.5))


def test_expert_parallelism_shards_the_experts_and_pays_all_to_alls():
    c = Cluster(gpus=64)
    by_ep = {ep: evaluate(MOE, c, 512, 16, 2, 2, 1, 1, "none", 0.5, ep=ep) for ep in (1, 4, 8)}
    assert by_ep[1].states > by_ep[4].states > by_ep[8].states  # E/ep experts per GPU
    assert by_ep[1].ep_comm_s == 0 < by_ep[4].ep_comm_s
    a2a = ep_dispatch_bytes(int(1 * 4096 * 1.25), 4096 // 2, 4, 2, 2)
    link = c.intra  # tp x ep = 8 GPUs: one node
    assert by_ep[4].ep_comm_s == pytest.approx(by_ep[4].micro_batches * 16 * (
        4 * 3 * link.alpha_s + (a2a["forward"] + a2a["backward"]) / link.bandwidth_Bps))
    across = evaluate(MOE, c, 512, 16, 2, 2, 1, 1, "none", 0.5, ep=8)  # 16 GPUs: two nodes
    assert across.ep_comm_s > by_ep[4].ep_comm_s * 5  # InfiniBand's 25 GB/s, not NVLink's
    assert plan(MOE, c, 512, eps=(1, 2, 4, 8))[0].fits


def test_tp_split_across_nodes_is_priced_on_the_inter_node_link_and_fp32_doubles_the_bytes():
    """evaluate() prices TP over the node link while tp fits in a node, else over the network
    (notebook 17 runs tp=2 with one rank per node); value_bytes=4 (fp32) sends twice bf16's."""
    from distlab.comm import Link, ring_allreduce_time
    model = Model(4, 128, 4, seq=64, vocab=65)
    fast = Link("fast", 0.0, 1e9, "test")
    slow = Link("slow", 0.0, 12.5e6, "test")
    rows = {g: evaluate(model, Cluster(2, gpus_per_node=g, intra=fast, inter=slow), 16,
                          1, 2, 1, 0, 16, "none", mfu=0.5) for g in (1, 2)}
    msg = 16 * 64 * 128 * 2  # one micro-batch's residual stream, bf16
    assert rows[1].tp_comm_s == pytest.approx(16 * ring_allreduce_time(msg, 2, slow))
    assert rows[2].tp_comm_s == pytest.approx(16 * ring_allreduce_time(msg, 2, fast))
    fp32 = evaluate(model, Cluster(2, gpus_per_node=1, intra=fast, inter=slow), 16, 2, 1, 1,
                      0, 8, "none", mfu=0.5, value_bytes=4)
    bf16 = evaluate(model, Cluster(2, gpus_per_node=1, intra=fast, inter=slow), 16, 2, 1, 1,
                      0, 8, "none", mfu=0.5)
    assert fp32.dp_comm_s == pytest.approx(2 * bf16.dp_comm_s)


def test_every_layout_the_planner_ranks_for_a_small_model_can_run_on_the_mesh():
    """The planner and the runtime agree: each row plan() ranks for a small GPT on 1 to 8
    GPUs (dp x tp x pp x cp, every ZeRO stage, micro-batch and recomputation, fitting or not)
    is a RunConfig the mesh accepts (its checks are the runtime's: a refused config would say
    why). tests/test_mesh.py trains such compositions against one process, a mixture of
    experts over ep with ZeRO among them (the experts' own shards over edp)."""
    from distlab import RunConfig
    from distlab.theory.plan import Cluster, plan
    from distlab.theory.plan_runs import label, model_of, run_config
    base = RunConfig(optimizer="sgd", global_batch=8, seq_len=32, n_layer=4, n_embd=32,
                     n_head=4, steps=4)
    for experts in (0, 4):
        cfg = base.replace(n_experts=experts)
        model, ranked, refused = model_of(cfg), 0, []
        for gpus in range(1, 9):
            for row in plan(model, Cluster(gpus=gpus, memory=80 * GB), cfg.global_batch,
                            cps=(1, 2, 4), eps=(1, 2, 4), sequence_parallel=False,
                            fits_only=False):
                ranked += 1
                try:
                    run = run_config(row, cfg)
                except ValueError as e:
                    refused.append((row, str(e)))
                    continue
                assert run.world_size == gpus and run.dp_degree == row.dp, label(row)
        assert ranked > 900  # the search was not empty: 984 dense rows, 1,464 with experts
        assert refused == [], refused[:3]


def test_a_zero_bubble_row_runs_as_a_pipeline_alone_and_a_mixed_one_is_refused():
    """A row the planner prices under zb1p, zbv or dualpipev becomes a `pp` run with that
    schedule when the pipeline is the only degree (what RunConfig accepts for them); with
    data or tensor parallelism beside it, run_config refuses it naming the schedule."""
    from distlab import RunConfig
    from distlab.theory.plan import Cluster, plan
    from distlab.theory.plan_runs import model_of, run_config
    cfg = RunConfig(optimizer="sgd", global_batch=16, seq_len=32, n_layer=8, n_embd=32,
                    n_head=4, steps=4)
    for sc in ("zb1p", "zbv", "dualpipev"):
        rows = [r for r in plan(model_of(cfg), Cluster(gpus=4, memory=80 * GB), 16,
                                schedules=(sc,), fits_only=False, sequence_parallel=False)
                if r.pp > 1]
        alone = [r for r in rows if r.dp == r.tp == r.cp == r.ep == 1]
        assert alone and len(alone) < len(rows), sc
        for r in alone:
            run = run_config(r, cfg)
            assert (run.strategy, run.schedule, run.pp, run.world_size) == ("pp", sc, r.pp, r.pp)
        with pytest.raises(ValueError, match=sc):
            run_config(next(r for r in rows if r not in alone), cfg)


def test_fp8_gathers_one_byte_a_parameter_and_computes_at_the_fp8_peak():
    """FP8 (gather_bytes=1, the FP8 peak): ZeRO-3's two all-gathers of a micro-batch move half
    the bf16 bytes, the reduce-scatter the same; every other stage and the memory unchanged;
    the compute twice as fast at H100's FP8 peak (1979 against 989 dense TFLOP/s)."""
    from distlab.comm import ring_allreduce_time
    from distlab.theory.plan import H100_BF16_FLOPS, H100_FP8_FLOPS, dp_comm_time, evaluate
    m = Model(18, 4096, 32, 2048, 50257, n_params=3.75e9)
    c = Cluster(gpus=8, **A100)
    link, n = c.intra, m.params
    bf16, fp8 = (dp_comm_time(m, c, 8, 1, 1, 3, 4, 2, gather_bytes=g) for g in (None, 1))
    assert bf16 == pytest.approx(4 * 1.5 * ring_allreduce_time(2 * n, 8, link))
    assert fp8 == pytest.approx(4 * 0.5 * (2 * ring_allreduce_time(n, 8, link)
                                           + ring_allreduce_time(2 * n, 8, link)))
    assert fp8 < bf16
    assert dp_comm_time(m, c, 8, 1, 1, 1, 4, 2, gather_bytes=1) == dp_comm_time(
        m, c, 8, 1, 1, 1, 4, 2)  # ZeRO-1 gathers no parameters per micro-batch
    h100 = dict(A100, peak_flops=H100_BF16_FLOPS)
    rows = {name: evaluate(m, Cluster(gpus=8, **{**h100, **extra}), 512, 8, 1, 1, 3, 4,
                           "selective", 0.5, **kw)
            for name, extra, kw in (("bf16", {}, {}),
                                    ("fp8", {"peak_flops": H100_FP8_FLOPS}, {"gather_bytes": 1}))}
    assert rows["fp8"].compute_s == pytest.approx(rows["bf16"].compute_s * 989 / 1979)
    assert rows["fp8"].dp_comm_s < rows["bf16"].dp_comm_s
    assert rows["fp8"].memory == rows["bf16"].memory
