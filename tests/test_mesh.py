"""The 3D mesh (distlab.parallel.mesh): groups as the Megatron layout says, and `3d`
(tp x pp x ZeRO-1 over dp) follows `single` step for step, moving the bytes the formulas say.

Launches (2): one `single` run (world 1) and ONE world-8 launch (dp=tp=pp=2) that builds a Mesh
and returns its groups, then trains `3d` (distlab.lab.parallelism_3d.mesh_ranks).

Tolerance: atol=1e-5 on every (gathered) parameter after 10 SGD steps in float32, and on the
loss. 3d computes `single`'s sums split into tp partial sums, m micro-batch means and dp
averages: only the summation order differs (~1e-7 relative per step). A lost micro-batch,
an unaveraged dp gradient or a doubled bias moves parameters by >1e-3.

Bytes per step and rank, with S = (global_batch/dp/m)·T·d·4 (one micro-batch's residual stream),
L_s = n_layer/pp blocks per stage, m micro-batches, Ψ_r this rank's parameters, P = Ψ_r padded
to a multiple of dp:
  tp group: 4·L_s·m all-reduces ("tp.all_reduce"), each 2(t-1)/t·S sent
  pp group: stage 0 sends m·S activations, stage 1 sends m·S gradients (pp=2)
  dp group: ZeRO-1 reduce-scatter and all-gather, each (dp-1)/dp·4·P sent
"""

import json
import os

import pytest
import torch

from distlab import RunConfig, run_ranks
from distlab.lab.parallelism_3d import mesh_ranks
from distlab.parallel.mesh import coords, layout, rank_of, table
from distlab.parallel.tensor.tp import plan_table
from distlab.rank.train import train_with_state

ATOL = 1e-5
DP, TP, PP, M = 2, 2, 2, 2
BASE = RunConfig(steps=10, optimizer="sgd", lr=0.1, global_batch=8, seq_len=16, n_layer=2 * PP,
                 n_embd=32, n_head=4, mlp_ratio=4, timeout_s=60)
CFG = BASE.replace(strategy="3d", world_size=DP * TP * PP, tp=TP, pp=PP, microbatches=M,
                   schedule="1f1b")
# the other rank order (dp fastest: a dp group on consecutive ranks, tp groups strided by dp),
# trained in the same launch
DP_FIRST = CFG.replace(mesh_order="dp-tp-pp")


def test_layout_formula():
    for r in range(8):
        c = coords(r, DP, TP, PP)
        assert rank_of(c["pp"], c["dp"], c["tp"], DP, TP) == r
    lay = layout(DP, TP, PP)
    assert lay["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert len(table(DP, TP, PP)) == 12
    for kind in ("tp", "dp", "pp"):  # each kind partitions the world
        assert sorted(r for g in lay[kind] for r in g) == list(range(8))
    other = layout(DP, TP, PP, "dp-tp-pp")
    assert other["dp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert other["tp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(other["pp"]) == lay["pp"]  # the same groups (created in another order)
    for r in range(8):
        c = coords(r, DP, TP, PP, "dp-tp-pp")
        assert rank_of(c["pp"], c["dp"], c["tp"], DP, TP, PP, "dp-tp-pp") == r


def _step_events(run_dir, rank):
    with open(os.path.join(run_dir, f"rank{rank}.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["kind"] == "step"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    single = run_ranks(train_with_state, 1, [BASE.to_dict()], timeout_s=60,
                       run_dir=str(tmp_path_factory.mktemp("single")))[0][0]
    run_dir = str(tmp_path_factory.mktemp("mesh"))
    ranks = run_ranks(mesh_ranks, 8, (DP, TP, PP), [CFG.to_dict(), DP_FIRST.to_dict()],
                      timeout_s=60, run_dir=run_dir, wall_timeout_s=300)
    events = [_step_events(run_dir, r) for r in range(8)]
    # CFG's steps, then DP_FIRST's
    return single, ranks, [e[:CFG.steps] for e in events], [e[CFG.steps:] for e in events]


def test_groups_at_world8(runs):
    _, ranks, _, _ = runs
    for r, out in enumerate(ranks):
        c = {"pp": r // (DP * TP), "dp": (r // TP) % DP, "tp": r % TP}
        assert out["rank"] == r and out["coords"] == c
        assert out["peers"]["tp"] == [c["pp"] * DP * TP + c["dp"] * TP + t for t in range(TP)]
        assert out["peers"]["dp"] == [c["pp"] * DP * TP + d * TP + c["tp"] for d in range(DP)]
        assert out["peers"]["pp"] == [p * DP * TP + c["dp"] * TP + c["tp"] for p in range(PP)]
        assert out["world"] == {"tp": TP, "dp": DP, "pp": PP}
        assert out["group_rank"] == c  # place in each group = coordinate


def test_3d_matches_single(runs):
    single, ranks, _, _ = runs
    for out in ranks:
        state = out["runs"][0]["state"]
        assert state.keys() == single["state"].keys()
        for k, v in single["state"].items():
            torch.testing.assert_close(state[k], v, atol=ATOL, rtol=0, msg=k)
    # the loss lives on the last stage; the dp replicas' means average to single's
    last = [o["runs"][0]["losses"] for o in ranks if o["coords"]["pp"] == PP - 1
            and o["coords"]["tp"] == 0]
    mean = torch.tensor(last).mean(0)
    torch.testing.assert_close(mean, torch.tensor(single["losses"]), atol=ATOL, rtol=0)


def test_3d_bytes_per_group(runs):
    single, ranks, events, _ = runs
    S = CFG.global_batch // DP // M * CFG.seq_len * CFG.n_embd * 4
    Ls = CFG.n_layer // PP
    sharded = set()
    for name, style in plan_table(CFG.n_layer).items():
        if style in ("colwise", "rowwise"):
            sharded.add(f"{name}.weight")
            if style == "colwise":
                sharded.add(f"{name}.bias")
    full = single["state"]
    n_sharded = sum(full[k].numel() for k in sharded)
    n_rep = sum(v.numel() for k, v in full.items() if k not in sharded and "mask" not in k)
    numel_dp0 = 0
    for r, evs in enumerate(events):
        c = ranks[r]["coords"]
        assert len(evs) == CFG.steps
        for e in evs:
            comm = e["mesh"]["comm"]
            tp = comm["tp"]["tp.all_reduce"]
            assert tp["calls"] == 4 * Ls * M
            assert tp["bytes_sent"] == 4 * Ls * M * 2 * (TP - 1) * S // TP
            pp = comm["pp"]
            kind = "pp_send_act" if c["pp"] == 0 else "pp_send_grad"
            assert pp[kind]["bytes_sent"] == M * S
            sent = sum(v["bytes_sent"] for v in pp.values())
            assert sent == M * S
            P = e["zero"]["padded"]
            assert P % DP == 0 and 0 <= P - e["zero"]["numel"] < DP
            for k in ("reduce_scatter", "all_gather"):
                assert comm["dp"][k]["bytes_sent"] == (DP - 1) * 4 * P // DP
        if c["dp"] == 0:
            numel_dp0 += evs[0]["zero"]["numel"]
    # over one dp replica, the ranks hold the sharded weights once, the replicated ones tp times
    assert numel_dp0 == n_sharded + TP * n_rep


def test_group_table_matches_formula(runs):
    """distlab.lab.parallelism_3d's bytes-per-group table (what 07_3d_parallelism shows) from this run:
    every group's bytes per step, summed over its members, equal theory.comm_bytes.predicted_bytes (the
    formulas above, with Ψ_r counted from the model's shapes), from the first step on (setup
    traffic is not booked to a step); the traffic matrix puts every byte in one cell."""
    from distlab.lab.parallelism_3d import group_rows, measured_bytes, traffic_matrix

    _, _, events, _ = runs
    flat = [e for evs in events for e in evs]
    rows = group_rows(CFG, flat)
    assert len(rows) == 12
    for r in rows:
        assert r["measured"] == r["predicted"] > 0, r
    M, _ = traffic_matrix(CFG, flat)
    sent = measured_bytes(flat)
    assert [sum(row) for row in M] == [sum(v["bytes_sent"] for g in sent[r].values()
                                           for v in g.values()) for r in range(8)]


def test_the_dp_first_order_trains_the_same_with_its_groups_where_it_says(runs):
    """mesh_order="dp-tp-pp": each rank sits where coords(..., "dp-tp-pp") puts it (rank 1 is
    dp replica 1 of tp shard 0), the run matches single, and every group's bytes equal the
    formula's for that order."""
    from distlab.lab.parallelism_3d import group_rows
    single, ranks, _, events = runs
    for r, evs in enumerate(events):
        assert len(evs) == DP_FIRST.steps
        assert evs[0]["mesh"]["coords"] == coords(r, DP, TP, PP, "dp-tp-pp")
    assert events[1][0]["mesh"]["coords"] == {"pp": 0, "dp": 1, "tp": 0}
    for out in ranks:
        for k, v in single["state"].items():
            torch.testing.assert_close(out["runs"][1]["state"][k], v, atol=ATOL, rtol=0, msg=k)
    rows = group_rows(DP_FIRST, [e for evs in events for e in evs])
    assert len(rows) == 12
    for r in rows:
        assert r["measured"] == r["predicted"] > 0, r


def test_the_rank_order_decides_which_group_crosses_between_nodes():
    """On two nodes of two ranks (torchrun's blocks of consecutive ranks), dp = tp = 2: in
    Megatron's order the dp groups span the nodes, so node 0's link carries its two ranks'
    ZeRO-1 traffic (gloo's reduce-scatter writes twice the ring's); with "dp-tp-pp" the tp
    groups do, and it carries their all-reduces instead (notebook 17 measures both)."""
    from distlab.lab.multi_node import node_link_formula
    from distlab.theory.comm_bytes import predicted_bytes
    base = BASE.replace(strategy="3d", world_size=4, tp=2, pp=1)
    megatron, dp_first = base, base.replace(mesh_order="dp-tp-pp")
    dp = [predicted_bytes(megatron, r)["dp"] for r in (0, 1)]
    tp = [predicted_bytes(dp_first, r)["tp"] for r in (0, 1)]
    assert node_link_formula(megatron, 2) == sum(2 * d["reduce_scatter"] + d["all_gather"]
                                                 for d in dp)
    assert node_link_formula(dp_first, 2) == sum(t["tp.all_reduce"] for t in tp) > 0
    assert node_link_formula(megatron.replace(world_size=2, tp=2), 1) == sum(
        v for v in predicted_bytes(megatron.replace(world_size=2, tp=2), 0)["tp"].values())
