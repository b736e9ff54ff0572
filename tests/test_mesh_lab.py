"""The numbers distlab.lab.parallelism_3d computes for the 3D notebook, without launching anything: the
valid layouts of a world size, the parameters a rank holds, the bytes-per-group formula, the
traffic matrix's attribution, the α-β placement and the planner's per-layout ranking.
(The same formulas against a real world-8 `3d` run: tests/test_mesh.py,
test_group_table_matches_formula.)"""

from types import SimpleNamespace

import pytest
import torch

from distlab import RunConfig
from distlab.comm import LINKS
from distlab.lab.parallelism_3d import (
    best_per_layout,
    group_rows,
    layout_rank,
    measured_bytes,
    mesh_config,
    placement_seconds,
    traffic_matrix,
    valid_layouts,
    zero1_optim_rows,
)
from distlab.theory.comm_bytes import messages_per_step, predicted_bytes, rank_numel
from distlab.models import GPT, GPTConfig
from distlab.parallel.mesh import KINDS
from distlab.parallel.tensor.tp import plan_table
from distlab.theory.plan import GPT3_175B, IB_HDR, Cluster, plan

BASE = RunConfig(optimizer="sgd", lr=0.1, steps=2, global_batch=16, seq_len=16, n_layer=4,
                 n_embd=32, n_head=4)
CFG = mesh_config(BASE, 2, 2, 2, microbatches=2, schedule="1f1b")


def test_valid_layouts_world8():
    """World 8, B=16, m=2, 1F1B: every (dp, tp, pp) with dp·tp·pp = 8 except tp = 8 (4 heads),
    pp = 8 (4 layers) and pp = 4 with m = 2 < pp (1F1B needs m >= pp)."""
    got = valid_layouts(BASE, 8, 2, "1f1b")
    assert set(got) == {(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 2, 2), (1, 4, 2)}
    assert got[0] == (8, 1, 1)  # most data parallelism first
    # with m = 4, each dp replica's rows must split into 4: dp = 8 leaves 2 rows
    assert (8, 1, 1) not in valid_layouts(BASE, 8, 4, "gpipe")
    assert (2, 1, 4) in valid_layouts(BASE, 8, 4, "gpipe")


def test_rank_numel_partitions_the_model():
    """Over one dp replica, the ranks hold every tp-split weight once and every replicated one
    (LayerNorms, row-parallel biases, embeddings, head) tp times: the count test_mesh checks
    against ZeRO's own flat buffers."""
    with torch.device("meta"):  # shapes only
        full = dict(GPT(GPTConfig.from_run(CFG)).named_parameters())
    split = set()
    for name, style in plan_table(CFG.n_layer).items():
        if style == "colwise":
            split |= {f"{name}.weight", f"{name}.bias"}
        elif style == "rowwise":
            split.add(f"{name}.weight")
    n_split = sum(p.numel() for k, p in full.items() if k in split)
    n_rep = sum(p.numel() for k, p in full.items() if k not in split)
    replica0 = [r for r in range(8) if (r // CFG.tp) % CFG.dp_degree == 0]
    assert sum(rank_numel(CFG, r) for r in replica0) == n_split + CFG.tp * n_rep
    one = mesh_config(BASE, 1, 1, 1)
    assert rank_numel(one, 0) == sum(p.numel() for p in full.values())


def test_predicted_bytes_by_hand():
    """B=16, dp=2, m=2: S = 4 rows·16·32·4 = 8192 B. tp: 4·2 blocks·2 micro-batches all-reduces
    of 2·(1/2)·S = 131072 B. pp: stage 0 sends 2·S of activations, stage 1 2·S of gradients.
    dp: reduce-scatter and all-gather, each (1/2)·4·P, P = Ψ_r rounded up to even."""
    S = 8192
    r0, r4 = predicted_bytes(CFG, 0), predicted_bytes(CFG, 4)
    assert r0["tp"] == r4["tp"] == {"tp.all_reduce": 16 * S}
    assert r0["pp"] == {"pp_send_act": 2 * S} and r4["pp"] == {"pp_send_grad": 2 * S}
    P = -(-rank_numel(CFG, 0) // 2) * 2
    assert r0["dp"] == {"reduce_scatter": 2 * P, "all_gather": 2 * P}
    # a dimension of 1 moves nothing over its group
    flat = predicted_bytes(mesh_config(BASE, 8, 1, 1), 0)
    assert flat["tp"] == flat["pp"] == {} and set(flat["dp"]) == {"reduce_scatter", "all_gather"}


def _events(cfg, steps=2, bump=None):
    """Step events as a `3d` run would log them, with the formula's bytes (bump: one rank's
    tp bytes changed at step 1)."""
    out = []
    for step in range(steps):
        for r in range(cfg.world_size):
            comm = {k: {c: {"calls": 1, "bytes_sent": b, "bytes_recv": 0, "seconds": 0.0}
                        for c, b in v.items()} for k, v in predicted_bytes(cfg, r).items()}
            if bump is not None and step == 1 and r == bump:
                comm["tp"]["tp.all_reduce"]["bytes_sent"] += 4
            out.append({"rank": r, "step": step, "mesh": {"comm": comm}})
    return out


def test_group_rows_and_traffic_matrix():
    rows = group_rows(CFG, _events(CFG))
    assert len(rows) == 12 and [r["kind"] for r in rows] == ["tp"] * 4 + ["dp"] * 4 + ["pp"] * 4
    assert all(r["measured"] == r["predicted"] > 0 for r in rows)
    M, K = traffic_matrix(CFG, _events(CFG))
    per_rank = measured_bytes(_events(CFG))
    for r in range(8):  # every byte a rank sent lands in exactly one cell of its row
        assert sum(M[r]) == sum(v["bytes_sent"] for g in per_rank[r].values() for v in g.values())
    # Megatron order: tp peers are r^1, dp peers r^2, pp peers r^4 (2x2x2)
    assert K[0][1] == "tp" and K[0][2] == "dp" and K[0][4] == "pp" and M[0][3] == M[0][0] == 0
    assert M[0][4] == predicted_bytes(CFG, 0)["pp"]["pp_send_act"]  # activations go forward
    assert M[4][0] == predicted_bytes(CFG, 4)["pp"]["pp_send_grad"]  # gradients go back
    with pytest.raises(ValueError, match="rank 3"):
        measured_bytes(_events(CFG, bump=3))


def test_zero1_optim_rows():
    """AdamW over ZeRO-1's shard: exp_avg and exp_avg_sq of P/dp floats plus a 4-byte step."""
    ev = [{"rank": r, "step": 0, "zero": {"numel": rank_numel(CFG, r)},
           "memory": {"optim": 8 * -(-rank_numel(CFG, r) // 2) + 4}} for r in range(8)]
    run = SimpleNamespace(cfg=CFG, history=lambda kind: ev)
    rows = zero1_optim_rows(run)
    assert all(r["measured"] == r["formula"] for r in rows)
    assert all(r["formula"] - 4 == pytest.approx((r["unsharded"] - 4) / 2, abs=4) for r in rows)


def test_tp_on_nvlink_beats_tp_on_infiniband():
    """Same bytes, two placements: tp's 4·L_s·m all-reduces per step are the most messages and
    (at real sizes) the most bytes, so the fast link belongs to tp."""
    nv = LINKS["NVLink 3 (A100)"]
    assert messages_per_step(CFG, 0) == {"tp": 32, "pp": 2, "dp": 2}
    b = {k: sum(predicted_bytes(CFG, 0)[k].values()) for k in KINDS}
    a = placement_seconds(CFG, 0, b, {"tp": nv, "pp": IB_HDR, "dp": IB_HDR})
    swapped = placement_seconds(CFG, 0, b, {"tp": IB_HDR, "pp": nv, "dp": IB_HDR})
    assert sum(a.values()) < sum(swapped.values())


def test_best_per_layout_ranks_distinct_layouts():
    rows = plan(GPT3_175B, Cluster(gpus=4096), 1536, 0.5)
    best = best_per_layout(rows)
    assert len({(r.dp, r.tp, r.pp) for r in best}) == len(best)
    assert [r.step_s for r in best] == sorted(r.step_s for r in best)
    rank, row = layout_rank(rows, 64, 8, 8)
    assert row is not None and (row.dp, row.tp, row.pp) == (64, 8, 8)
    assert best[rank - 1] is row
    assert layout_rank(rows, 4096, 1, 1) == (None, None)  # pure DP: 2.8 TB of states per GPU
