"""The meshes. The 3D mesh (distlab.parallel.mesh): groups as the Megatron layout says, and
`3d` (tp x pp x ZeRO-1 over dp) follows `single` step for step, moving the bytes the formulas
say. The N-D mesh (`mesh`, below): every composition equal to one process, every group's bytes
its formula's.

Launches (2): one single-process launch trains every reference, and ONE world-8 launch
(dp=tp=pp=2) builds a Mesh and returns its groups, then trains `3d` in both rank orders and every
composition of the N-D mesh below in turn (distlab.lab.parallelism_3d.mesh_ranks).

Tolerance: atol=1e-5 on every (gathered) parameter after 4 SGD steps in float32, and on the
loss. 3d computes `single`'s sums split into tp partial sums, m micro-batch means and dp
averages: only the summation order differs (~1e-7 relative per step). A lost micro-batch,
an unaveraged dp gradient or a doubled bias moves parameters by >1e-3.

Bytes per step and rank, with S = (global_batch/dp/m)·T·d·4 (one micro-batch's residual stream),
L_s = n_layer/pp blocks per stage, m micro-batches, Ψ_r this rank's parameters, P = Ψ_r padded
to a multiple of dp:
  tp group: 4·L_s·m all-reduces ("tp.all_reduce"), each 2(t-1)/t·S sent
  pp group: stage 0 sends m·S activations, stage 1 sends m·S gradients (pp=2)
  dp group: ZeRO-1 reduce-scatter and all-gather, each (dp-1)/dp·4·P sent

The N-D mesh (distlab.parallel.parallelize): the compositions the field trains, each equal to
one process, each group moving the bytes its formula says (distlab.theory.mesh_bytes).
Tolerance: atol=1e-5 on every (gathered) parameter after STEPS SGD steps in fp32, and on the
loss. Each composition computes `single`'s sums split differently (tp partial sums, the ring's
online softmax over key blocks, micro-batch means, averages over dp, cp and edp): only the
summation order differs, ~1e-7 relative per step (measured: at most 6e-8 after 4 steps). A lost
micro-batch, an unaveraged gradient or a missing ep division moves parameters by more than 1e-3
(test_training_moved_the_weights shows the steps move them that far).

MoE references: ep's ranks route their own tokens as GShard groups. Where those groups are one
process's groups too (whole rows: dp, pipeline micro-batches) `single` runs with moe_groups set
to match, and the balance loss and capacity drops stay on; under cp a rank's tokens are a share
of every row, which no one-process group forms, so those runs drop no token (capacity_factor =
n_experts) and have no balance loss: each token's expert then does not depend on its group.
"""

import json
import os

import pytest
import torch

from distlab import RunConfig, run_ranks
from distlab.lab.parallelism_3d import mesh_ranks
from distlab.parallel.mesh import coords, grid_coords, grid_groups, layout, rank_of, table
from distlab.parallel.parallelize import DIMS, ORDER, ep_groups, sizes
from distlab.parallel.parallelize import layout as nd_layout
from distlab.parallel.tensor.tp import plan_table
from distlab.rank.train import train_with_state
from distlab.theory.mesh_bytes import mesh_bytes

ATOL = 1e-5
DP, TP, PP, M = 2, 2, 2, 2
BASE = RunConfig(steps=4, optimizer="sgd", lr=0.1, global_batch=8, seq_len=16, n_layer=2 * PP,
                 n_embd=32, n_head=4, mlp_ratio=4, timeout_s=60)
CFG = BASE.replace(strategy="3d", world_size=DP * TP * PP, tp=TP, pp=PP, microbatches=M,
                   schedule="1f1b")
# the other rank order (dp fastest: a dp group on consecutive ranks, tp groups strided by dp),
# trained in the same launch
DP_FIRST = CFG.replace(mesh_order="dp-tp-pp")

# the N-D mesh's compositions (distlab.parallel.parallelize), trained in the same launch
STEPS = 3  # the N-D compositions' steps (a wrong average shows after one)
ND_BASE = BASE.replace(steps=STEPS)
NO_DROP = dict(n_experts=4, aux_loss_coef=0.0, capacity_factor=4.0)
# DeepSeek's routing: dropless, top-2, a shared expert, the balancing bias (its loads summed
# over dp_shard x cp, then dp_replicate: Strategy.routing_comms), at a rate that moves it in
# 3 steps
DEEPSEEK = dict(n_experts=4, top_k=2, aux_loss_coef=0.0, capacity_factor=0.0,
                n_shared_experts=1, expert_bias_rate=0.01)
# name: (the mesh's degrees and knobs, what `single` needs to see the same routing groups)
COMPOSITIONS = {
    "dp2 x cp2 x tp2 (fully_shard)": (dict(dp_shard=2, cp=2, tp=2), {}),
    "pp2 x cp2 x tp2": (dict(pp=2, cp=2, tp=2, microbatches=2), {}),
    # torchtitan's 3D, and the global norm over tp, pp and the ZeRO shards
    "pp2 x dp_shard2 x tp2 (zero3, 1f1b), grad_clip": (
        dict(pp=2, dp_shard=2, tp=2, microbatches=2, schedule="1f1b", grad_clip=0.05),
        dict(grad_clip=0.05)),
    "HSDP dp_replicate2 x dp_shard2 x tp2": (dict(dp_replicate=2, dp_shard=2, tp=2), {}),
    # the experts' own ZeRO over edp beside the dense one (distlab.parallel.expert.zero):
    # stage 3 under the pipeline, 2 with TP, 1 with HSDP and the clip; cp2 x dp4 keeps the
    # unsharded path (the experts' gradients all-reduced over edp)
    "pp2 x dp4 (ep2, zero3, 1f1b, DeepSeek's routing)": (
        dict(pp=2, dp_shard=4, ep=2, zero_stage=3, microbatches=2, schedule="1f1b",
             **DEEPSEEK), dict(moe_groups=8, **DEEPSEEK)),
    "HSDP dp_replicate2 x dp_shard2 x cp2 (ep2, zero1, DeepSeek's routing), grad_clip": (
        dict(dp_replicate=2, dp_shard=2, cp=2, ep=2, zero_stage=1, grad_clip=0.05, **DEEPSEEK),
        dict(grad_clip=0.05, **DEEPSEEK)),
    # the norm's other groups: cp, and the experts over ep (each held by its edp ranks)
    "cp2 x dp4 (ep2), grad_clip": (dict(cp=2, dp_shard=4, ep=2, zero_stage=0, grad_clip=0.05,
                                        **NO_DROP), dict(grad_clip=0.05, **NO_DROP)),
    # experts under tp (left whole on each tp rank), with the balance loss and capacity drops
    "tp2 x dp4 (ep2, zero2, balance loss, drops)": (
        dict(tp=2, dp_shard=4, ep=2, zero_stage=2, n_experts=4, capacity_factor=1.0),
        dict(n_experts=4, capacity_factor=1.0, moe_groups=4)),
    "pp2 x tp4, sp": (dict(pp=2, tp=4, sp=True, zero_stage=0, microbatches=2), {}),
    # fully_shard's per-parameter layout (FSDP2's) on the mesh: HSDP with TP, clipped
    "HSDP dp_replicate2 x dp_shard2 x tp2 (per_param), grad_clip": (
        dict(dp_replicate=2, dp_shard=2, tp=2, fsdp_layout="per_param", grad_clip=0.05),
        dict(grad_clip=0.05)),
}
MESH = {k: ND_BASE.replace(**m) for k, (m, _) in COMPOSITIONS.items()}
SINGLE = {k: ND_BASE.replace(**s) for k, (_, s) in COMPOSITIONS.items()}
# named strategies beside their mesh presets (RunConfig.as_mesh), in the same launch; 3d's two
# orders are CFG and DP_FIRST above
NAMED = {"cp": ND_BASE.replace(strategy="cp", world_size=8, cp_ranks=2)}
PRESETS = {"3d": CFG.as_mesh(), **{k: c.as_mesh() for k, c in NAMED.items()}}
# one process without the clip, dense and with experts: grad_clip must change single's result
# for the clipped compositions' equality to be about the norm
UNCLIPPED = {"dense": ND_BASE, "experts": ND_BASE.replace(**NO_DROP)}


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
def launch(tmp_path_factory):
    """The two launches: every reference in one process, everything else at world 8."""
    single = run_ranks(train_with_state, 1, [BASE.to_dict()] + [c.to_dict() for c in
                                                                  SINGLE.values()]
                       + [c.to_dict() for c in UNCLIPPED.values()],
                       timeout_s=60, run_dir=str(tmp_path_factory.mktemp("single")))[0]
    run_dir = str(tmp_path_factory.mktemp("mesh"))
    ranks = run_ranks(mesh_ranks, 8, (DP, TP, PP), [CFG.to_dict(), DP_FIRST.to_dict()]
                      + [c.to_dict() for c in [*MESH.values(), *NAMED.values(),
                                               *PRESETS.values()]],
                      timeout_s=60, run_dir=run_dir, wall_timeout_s=300)
    return single, ranks, [_step_events(run_dir, r) for r in range(8)]


@pytest.fixture(scope="module")
def runs(launch):
    """3d's: single's run, the ranks' outputs, CFG's step events, then DP_FIRST's."""
    single, ranks, events = launch
    return (single[0], ranks, [e[:CFG.steps] for e in events],
            [e[CFG.steps:2 * CFG.steps] for e in events])


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


# -- the N-D mesh (distlab.parallel.parallelize) ------------------------------------------------
# -- its layout (pure) -----------------------------------------------------------------------
def test_the_grid_is_3ds_layout_with_other_names():
    sizes3 = {"dp": 2, "tp": 2, "pp": 2}
    for order in ("tp-dp-pp", "dp-tp-pp"):
        o = tuple(order.split("-"))
        assert {k: grid_groups(sizes3, (k,), o) for k in sizes3} == layout(2, 2, 2, order)


def test_every_kind_of_group_partitions_the_world_and_agrees_with_the_coordinates():
    cfg = ND_BASE.replace(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2)  # all five at once: 32
    s = sizes(cfg)
    assert cfg.strategy == "mesh" and cfg.world_size == 32
    lay = nd_layout(s, zero_stage=3)
    assert set(lay) == {"tp", "cp", "pp", "dp_shard_cp", "dp_replicate"}
    for kind, groups in lay.items():
        assert sorted(r for g in groups for r in g) == list(range(32)), kind
    coords = [grid_coords(r, {d: s[d] for d in DIMS}, ORDER) for r in range(32)]
    assert [c["tp"] for c in coords[:4]] == [0, 1, 0, 1]  # tp fastest, then cp
    assert [c["cp"] for c in coords[:4]] == [0, 0, 1, 1]
    for g in lay["tp"]:  # a tp group: consecutive ranks (one node's)
        assert g == list(range(g[0], g[0] + 2))
    for g in lay["dp_shard_cp"]:  # ZeRO's group: same pp, dp_replicate and tp
        assert len({(coords[r]["pp"], coords[r]["dp_replicate"], coords[r]["tp"])
                    for r in g}) == 1 and len(g) == 4


def test_the_rank_order_can_put_the_data_parallel_ranks_together():
    from distlab.parallel.parallelize import ORDERS
    s = {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2, "ep": 1}
    default, dp_first = (nd_layout(s, 3, ORDERS[o]) for o in ("tp-dp-pp", "dp-tp-pp"))
    assert default["tp"][0] == [0, 1] and default["dp_shard_cp"][0] == [0, 2, 4, 6]
    assert dp_first["tp"][0] == [0, 4] and dp_first["dp_shard_cp"][0] == [0, 1, 2, 3]


def test_expert_groups_are_cut_from_the_data_parallel_ranks():
    s = sizes(ND_BASE.replace(cp=2, dp_shard=4, ep=2, n_experts=4, zero_stage=0))
    groups = ep_groups(s)
    assert groups["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # consecutive: cp pairs here
    assert groups["edp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # the same experts


# -- the config: degrees named, the world inferred, impossible meshes refused -----------------
def test_a_mesh_string_names_the_degrees():
    from distlab.parallel.parallelize import mesh_string, parse_mesh
    cfg = RunConfig(mesh="pp2 x dp_shard2 x tp2", microbatches=2, global_batch=8, seq_len=16,
                    n_embd=32, n_head=4)
    assert (cfg.strategy, cfg.world_size, cfg.pp, cfg.dp_shard, cfg.tp) == ("mesh", 8, 2, 2, 2)
    assert parse_mesh(mesh_string(sizes(cfg.replace(ep=1)))) == {"pp": 2, "dp_shard": 2, "tp": 2}
    assert parse_mesh("dp4 × cp2 (ep2)") == {"dp_shard": 4, "cp": 2, "ep": 2}
    for bad, words in (("pp2 x qq2", "'qq2'"), ("tp2 x tp2", "tp twice")):
        with pytest.raises(ValueError, match=words):
            parse_mesh(bad)
    with pytest.raises(ValueError, match="name each degree once"):
        RunConfig(mesh="tp2 x cp2", tp=4)


def test_degrees_without_a_strategy_run_on_the_mesh():
    cfg = RunConfig(tp=2, cp=2, dp_shard=2, global_batch=8, seq_len=16, n_embd=32, n_head=4)
    assert (cfg.strategy, cfg.world_size, cfg.dp_degree) == ("mesh", 8, 2)
    assert RunConfig(strategy="mesh", world_size=8, tp=2, cp=2).dp_degree == 2  # dp_shard: rest
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("changes, words", [
    (dict(strategy="mesh", world_size=8, tp=2, cp=3), ["cp3", "tp2", "world_size=8"]),
    (dict(tp=2, cp=2, dp_shard=2, seq_len=18), ["seq_len=18", "cp=2"]),
    (dict(cp=2, dp_shard=2, n_head=2, tp=2, n_embd=32, cp_attention="ulysses"),
     ["ulysses", "tp=2", "cp=2"]),
    (dict(dp_shard=4, ep=3, n_experts=6), ["ep=3", "4 data-parallel"]),
    (dict(dp_shard=2, tp=2, ep=2, n_experts=4, sp=True, zero_stage=0), ["sp=True", "experts"]),
    (dict(dp_shard=4, ep=2, n_experts=4, fsdp_layout="per_param"), ["ep=2", "per_param"]),
    (dict(pp=2, dp_shard=2, ep=2, n_experts=4, zero_stage=0), ["pp=2", "aux_loss_coef=0"]),
    (dict(dp_shard=2, ep=2), ["ep=2", "n_experts"]),
    (dict(tp=2, dp_shard=2, sp=True, zero_stage=2), ["sp=True", "zero_stage"]),
])
def test_a_mesh_that_cannot_work_is_refused_naming_why(changes, words):
    with pytest.raises(ValueError) as e:
        ND_BASE.replace(**changes)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# -- the compositions, trained ---------------------------------------------------------------
@pytest.fixture(scope="module")
def nd(launch):
    """(single's, each rank's, each rank's step events) per composition."""
    single, ranks, events = launch
    first = 2 * CFG.steps  # 3d's two runs came first
    return ({**{k: single[1 + i] for i, k in enumerate(MESH)},
             **{f"unclipped {k}": single[1 + len(MESH) + i] for i, k in enumerate(UNCLIPPED)}},
            {k: [out["runs"][2 + i] for out in ranks] for i, k in enumerate(MESH)},
            {k: [e[first + i * STEPS:first + (i + 1) * STEPS] for e in events]
             for i, k in enumerate(MESH)})


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_each_composition_equals_one_process(nd, name):
    single, mesh, events = nd
    ref = single[name]
    for rank, out in enumerate(mesh[name]):
        assert out["state"].keys() == ref["state"].keys(), rank
        for k, v in ref["state"].items():
            torch.testing.assert_close(out["state"][k], v, atol=ATOL, rtol=0,
                                       msg=f"{name}: rank {rank}, {k}")
    # the loss: each rank holding one (the last stage's, one per tp group) has the mean over its
    # rows and tokens; those ranks' mean is the global batch's
    holders = [r for r in range(8) if events[name][r][0]["mesh"]["coords"]["pp"]
               == MESH[name].pp - 1 and events[name][r][0]["mesh"]["coords"]["tp"] == 0]
    losses = torch.tensor([mesh[name][r]["losses"] for r in holders]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), atol=ATOL, rtol=0)


def test_training_moved_the_weights(nd):
    """The tolerance means something: STEPS steps move the weights by far more than ATOL."""
    from distlab.rank.build import build_model
    single, _, _ = nd
    torch.manual_seed(0)
    start = build_model(ND_BASE).state_dict()
    moved = max((single[next(iter(MESH))]["state"][k] - v).abs().max().item()
                for k, v in start.items())
    assert moved > 100 * ATOL


def test_the_balancing_bias_moved_where_it_is_on(nd):
    """DeepSeek's compositions: the bias each rank holds equals one process's (checked above
    with the rest of the state), and it moved, so that equality is about loads summed over the
    routing groups (one rank's own loads give other signs)."""
    single, _, _ = nd
    for name, cfg in MESH.items():
        bias = [v for k, v in single[name]["state"].items() if k.endswith("expert_bias")]
        assert any(b.abs().max() > 0 for b in bias) == bool(cfg.expert_bias_rate), name


@pytest.mark.parametrize("clipped, unclipped", [
    ("pp2 x dp_shard2 x tp2 (zero3, 1f1b), grad_clip", "unclipped dense"),
    ("cp2 x dp4 (ep2), grad_clip", "unclipped experts")])
def test_clipping_clipped(nd, clipped, unclipped):
    """grad_clip=0.05 changes the result (the norm is above it), so equality above is about
    the norm summed over tp, pp, cp, ep and the ZeRO shards, not a clip that never fired.
    (The two references share model, data and routing; only the clip differs.)"""
    single, _, _ = nd
    a, b = single[clipped], single[unclipped]
    assert max((a["state"][k] - b["state"][k]).abs().max().item() for k in a["state"]) > 1e-3


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_bytes_per_dimension_equal_the_formula(nd, name):
    """Every group's booked bytes, every rank, every step: theory.mesh_bytes (exact: the
    counts are whole messages; the target was within 2%). ep's all-to-alls are checked
    against the routing in the next test."""
    _, _, events = nd
    for rank, evs in enumerate(events[name]):
        want = {g: {k: v for k, v in kinds.items() if v}
                for g, kinds in mesh_bytes(MESH[name], rank).items() if g != "ep"}
        for e in evs:
            got = {g: {k: v["bytes_sent"] for k, v in kinds.items() if v["bytes_sent"]}
                   for g, kinds in e["mesh"]["comm"].items() if g != "ep"}
            assert got == want, (name, rank)


def test_expert_all_to_alls_carry_the_routed_rows(nd):
    """cp2 x dp4 (ep2), no drops: a rank dispatches the rows its router sent to the other rank's
    experts and combines back the rows the other rank sent to its own, d floats each; the
    gradients go back the way the rows came (one forward a step: the step's routing is the
    event's)."""
    name = "cp2 x dp4 (ep2), grad_clip"
    _, _, events = nd
    cfg, row = MESH[name], MESH[name].n_embd * 4
    groups = ep_groups(sizes(cfg))["ep"]
    for step in range(STEPS):
        routed = {r: [m["tokens_per_expert"] for m in events[name][r][step]["moe"]]
                  for r in range(8)}
        for r in range(8):
            (other,) = [o for g in groups if r in g for o in g if o != r]
            mine = set(range(2 * groups[r // 2].index(r), 2 * groups[r // 2].index(r) + 2))
            sent = sum(c for layer in routed[r] for e, c in enumerate(layer) if e not in mine)
            back = sum(c for layer in routed[other] for e, c in enumerate(layer) if e in mine)
            ep = events[name][r][step]["mesh"]["comm"]["ep"]
            # backward reverses each all-to-all: the combine's gradient leaves with the rows
            # this rank dispatched, the dispatch's gradient with the rows it combined back
            assert ep["ep.dispatch"]["bytes_sent"] == ep["ep.combine.grad"]["bytes_sent"] \
                == sent * row
            assert ep["ep.combine"]["bytes_sent"] == ep["ep.dispatch.grad"]["bytes_sent"] \
                == back * row
            assert sent and back  # the routing did send rows both ways


@pytest.mark.parametrize("name", [k for k in COMPOSITIONS
                                  if MESH[k].ep > 1 and MESH[k].zero_stage])
def test_experts_have_their_own_shards_over_edp(nd, name):
    """Beside a dense ZeRO the experts are sharded by their own ZeRO over edp: the dense units
    hold no expert, the experts' units hold this rank's experts, and the two add up to what the
    rank holds (distlab.theory.mesh_bytes counts both from the model's shapes)."""
    from distlab.theory.mesh_bytes import expert_units, held_numels
    _, _, events = nd
    cfg = MESH[name]
    s = sizes(cfg)
    edp = s["dp_replicate"] * s["dp_shard"] * s["cp"] // s["ep"]
    for rank, evs in enumerate(events[name]):
        e = evs[-1]
        experts = e["expert_zero"]
        assert (experts["stage"], experts["ranks"]) == (cfg.zero_stage, edp)
        want = [sum(n for sh in shapes for n in [torch.Size(sh).numel()])
                for _, shapes in expert_units(cfg, rank)]
        assert [u[1] for u in experts["units"]] == want and all(w > 0 for w in want)
        assert all(p % edp == 0 for _, _, p in experts["units"])
        assert not any(".experts." in u[0] for u in e["zero"]["units"])
        assert e["zero"]["numel"] + sum(want) == sum(held_numels(cfg, rank).values())


def test_a_chained_optimizer_steps_and_schedules_every_optimizer():
    from distlab.parallel.zero.chained import ChainedOptimizer
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    chain = ChainedOptimizer([torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)])
    for g in chain.param_groups:  # what the loop's schedule does
        g["lr"] = 0.5
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    chain.step()
    assert a.tolist() == [0.5, 0.5] and b.tolist() == [0.5, 0.5, 0.5]
    chain.zero_grad()
    assert a.grad is None and b.grad is None
    with pytest.raises(ValueError, match="2 optimizers' states, this chain 1"):
        ChainedOptimizer([torch.optim.SGD([a], lr=0.1)]).load_state_dict(chain.state_dict())


def test_capacity_dropped_tokens_where_the_reference_drops_them(nd):
    """The run with capacity_factor=1 dropped tokens (so its equality covers drops)."""
    _, _, events = nd
    evs = events["tp2 x dp4 (ep2, zero2, balance loss, drops)"]
    assert sum(m["dropped"] for r in range(8) for e in evs[r] for m in e["moe"]) > 0


def test_named_strategies_equal_their_mesh_presets(launch):
    """`3d` and cp train what their mesh presets train: the
    same final weights on every rank (the same sums in the same groups: equal to the last
    bit is not promised, 1e-6 is far below what a wrong group or a missing average moves)."""
    _, ranks, events = launch
    first = 2 + len(MESH)  # 3d's two runs, then the compositions
    runs = {"3d": 0, **{k: first + i for i, k in enumerate(NAMED)}}
    presets = {k: first + len(NAMED) + i for i, k in enumerate(PRESETS)}
    assert PRESETS["3d"].dp_shard == DP and PRESETS["3d"].zero_stage == 1
    assert DP_FIRST.as_mesh().mesh_order == "dp-tp-pp"  # the order goes with it
    assert PRESETS["cp"].cp == 2
    ep = RunConfig(strategy="ep", world_size=8, n_experts=8, global_batch=8).as_mesh()
    assert (ep.ep, ep.dp_shard, ep.zero_stage) == (8, 8, 0)  # ep: every replica, no ZeRO
    for name in PRESETS:
        for rank, out in enumerate(ranks):
            named, preset = out["runs"][runs[name]]["state"], out["runs"][presets[name]]["state"]
            assert named.keys() == preset.keys(), name
            for k, v in named.items():
                torch.testing.assert_close(preset[k], v, atol=1e-6, rtol=0,
                                           msg=f"{name}, rank {rank}, {k}")
    # the preset sits where the named strategy puts each rank (3d logs its coordinates)
    for r in range(8):
        named_c = events[r][0]["mesh"]["coords"]
        preset_e = events[r][(2 * CFG.steps + (len(MESH) + len(NAMED)) * STEPS)]
        assert {k: preset_e["mesh"]["coords"][k if k != "dp" else "dp_shard"]
                for k in named_c} == named_c
