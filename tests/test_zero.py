"""ZeRO (`zero1`, `zero2`, `zero3`, written in distlab) and torch's references (`zero1-torch`,
`fsdp-torch`) follow `single` step for step, hold the bytes the ZeRO paper says, and move the
bytes it says.

Launches: one `single` launch (every baseline config in turn), then one launch per world size
(2 and 4) that trains every sharded config in turn (distlab.rank.train.train_with_state).

Equivalence tolerance: atol=1e-5 on every parameter after 10 SGD steps in float32, as in
test_equivalence.py and test_ddp.py. Sharding changes no arithmetic of the update: SGD is
elementwise, so stepping a flat shard computes the same numbers as stepping whole tensors, and
the reduce-scatter sums the same per-rank gradients an all-reduce sums. Against `single` only the
summation order of the gradient differs (the mean of per-slice gradients vs the gradient of the
mean), ~1e-7 relative per step, which SGD does not amplify (observed over 20 steps: at most 7.5e-8, as DDP).
1e-5 leaves a >100x margin, while a wrong gradient (a shard not averaged, a unit reduced into
the wrong shard, a micro-batch not accumulated, a prefetched unit used before its all-gather
finished) moves parameters by ~1e-2. Clipping: both sides scale by max_norm / (‖g‖ + 1e-6); the
global norm is summed in another order (squares of shards across ranks vs norms of tensors),
~1e-7 relative, same margin.

Memory (per rank, measured after the optimizer step from the tensors the rank holds; fp32, so
4 bytes a value; AdamW state = exp_avg + exp_avg_sq (8 bytes a value) + one 4-byte step counter
per optimizer tensor). For a model of Ψ values in T tensors, units u of Ψ_u values (zero1: one
unit, the whole model), P_u = Ψ_u rounded up to a multiple of N (padding), N ranks:

    single   params 4Ψ        grads 4Ψ        optim 8Ψ + 4T
    zero1    params 4P        grads 4P        optim 8P/N + 4              (P = pad(Ψ))
    zero2    params 4ΣP_u     grads 4ΣP_u/N   optim 8ΣP_u/N + 4·units
    zero3    params 4ΣP_u/N   grads 4ΣP_u/N   optim 8ΣP_u/N + 4·units     (outside fwd/bwd)

The memory model below is chosen so that Ψ and the block units are not multiples of 4: the
padding is visible in the formulas and asserted exactly.

Bytes on the wire per rank per step (modeled ring bytes, booked by distlab.comm):

    ddp      all-reduce 2(N-1)/N·4Ψ  (zero1-torch's torch DDP all-reduce, counted by a comm hook)
    zero1    reduce-scatter (N-1)/N·4P + all-gather (N-1)/N·4P            = ddp's (P = Ψ here)
    zero2    reduce-scatter (N-1)/N·4ΣP_u + all-gather (N-1)/N·4ΣP_u      = ddp's
    zero3    all-gather 2(N-1)/N·4ΣP_u (forward, backward) + reduce-scatter (N-1)/N·4ΣP_u
             = 1.5x ddp's; with A micro-batches the all-gathers are 2A(N-1)/N·4ΣP_u
"""


import pytest
import torch

from distlab.events import step_events_per_run
from distlab import RunConfig, run_ranks
from distlab.comm import ring_allreduce_bytes
from distlab.models import GPT, GPTConfig
from distlab.parallel.zero.zero_torch import chain_broadcast_bytes
from distlab.parallel.zero.stages import padded_size
from distlab.rank.train import train_with_state

ATOL = 1e-5
BASE = RunConfig(steps=10, optimizer="sgd", lr=0.1, global_batch=8, seq_len=16, n_layer=2,
                 n_embd=32, n_head=2, mlp_ratio=4, timeout_s=60)
# Launch time is the test's cost: the five strategies train BASE's 10 steps; the variants
# (accumulation, clipping, checkpointing) train SHORT's 5, against a 5-step `single`.
SHORT = BASE.replace(steps=5)
# The global norm of BASE's gradients is ~1.0-1.4 over SHORT's 5 steps (printed below): 0.3
# clips every step, by a factor 3-5.
CLIP = 0.3
ACCUM = {2: 4, 4: 2}  # micro-batches per step: 1 row each (global batch 8)
# Memory checks: AdamW, 1 step (the state exists after the first), a model whose sizes do not
# divide by 4 (n_embd 30, vocab 63, one block): Ψ = 15,510 values (Ψ mod 4 = 2), units
# 2,370 / 11,190 / 1,950 (each mod 4 = 2).
MEM = BASE.replace(optimizer="adamw", lr=1e-3, steps=1, n_embd=30, vocab_size=63, n_layer=1)
EQUIV = ("zero1", "zero2", "zero3", "zero1-torch", "fsdp-torch")
CLIPPED = {2: ("zero1", "zero2", "zero3", "fsdp-torch"), 4: ("zero3",)}  # one clip code for all stages
MEMORY = ("zero1", "zero2", "zero3", "zero1-torch", "fsdp-torch")


def _configs(world):
    cfgs = {s: BASE.replace(strategy=s, world_size=world) for s in EQUIV}
    for s in ("zero1", "zero2", "zero3"):
        cfgs[f"{s} accum"] = SHORT.replace(strategy=s, world_size=world, grad_accum=ACCUM[world])
    for s in CLIPPED[world]:
        cfgs[f"{s} clip"] = SHORT.replace(strategy=s, world_size=world, grad_clip=CLIP)
    if world == 2:  # the checkpointed block recomputes its forward inside zero3's backward
        cfgs["zero3 checkpointing"] = SHORT.replace(strategy="zero3", world_size=world,
                                                    checkpointing="full")
    for s in MEMORY:
        cfgs[f"{s} mem"] = MEM.replace(strategy=s, world_size=world)
    cfgs["zero3 mem offload"] = cfgs["zero3 mem"].replace(offload=True)
    if world == 2:  # FSDP2's CPU offload costs ~0.5 s a step at world 4 on 2 cores
        cfgs["fsdp-torch mem offload"] = cfgs["fsdp-torch mem"].replace(offload=True)
    return cfgs


def _units(cfg):
    """Values per unit of the GPT of cfg, by name: tok_emb+pos_emb, each block, ln_f+head."""
    sizes = {}
    for name, p in GPT(GPTConfig.from_run(cfg)).named_parameters():
        top = name.split(".")[0]
        key = ("emb" if top in ("tok_emb", "pos_emb") else "head" if top in ("ln_f", "head")
               else ".".join(name.split(".")[:2]))
        sizes[key] = sizes.get(key, 0) + p.numel()
    return [sizes["emb"]] + [v for k, v in sizes.items() if k.startswith("blocks.")] \
        + [sizes["head"]]


def _psi(cfg):
    return sum(_units(cfg))


def _n_tensors(cfg):
    return len(list(GPT(GPTConfig.from_run(cfg)).parameters()))


def _worst_param_diff(result, ref):
    return max((t - ref["state"][k]).abs().max().item()
               for k, t in result["state"].items())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("single"))
    cfgs = {"sgd": BASE, "short": SHORT, "clip": SHORT.replace(grad_clip=CLIP), "mem": MEM}
    res = run_ranks(train_with_state, 1, [c.to_dict() for c in cfgs.values()], timeout_s=60,
                    run_dir=run_dir)[0]
    events = step_events_per_run(run_dir, 0)
    return {name: {**res[i], "events": events[i]} for i, name in enumerate(cfgs)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def runs(request, tmp_path_factory):
    world = request.param
    cfgs = _configs(world)
    run_dir = str(tmp_path_factory.mktemp(f"zero-w{world}"))
    results = run_ranks(train_with_state, world, [c.to_dict() for c in cfgs.values()],
                        timeout_s=60, run_dir=run_dir)
    events = [step_events_per_run(run_dir, r) for r in range(world)]
    out = {name: {"cfg": cfg, "ranks": [results[r][i] for r in range(world)],
                  "events": [events[r][i] for r in range(world)]}
           for i, (name, cfg) in enumerate(cfgs.items())}
    return world, out


# -- equivalence -------------------------------------------------------------------------------
def test_every_strategy_matches_single_parameter_by_parameter(single, runs):
    world, out = runs
    for name, run in out.items():
        if run["cfg"].optimizer != "sgd":
            continue
        cfg = run["cfg"]
        ref = single["clip" if cfg.grad_clip else "sgd" if cfg.steps == BASE.steps else "short"]
        worst = max(_worst_param_diff(res, ref) for res in run["ranks"])
        print(f"world={world} {name}: worst parameter diff vs single {worst:.2e}")
        assert worst <= ATOL, f"{name}: |diff| {worst:.2e}"
        # after the all-gather every rank holds the same parameters, bitwise
        for res in run["ranks"][1:]:
            for k, t in res["state"].items():
                assert torch.equal(t, run["ranks"][0]["state"][k]), (name, k)
        # the mean of the ranks' slice losses is the global batch's loss
        for s in range(cfg.steps):
            mean = sum(res["losses"][s] for res in run["ranks"]) / world
            assert mean == pytest.approx(ref["losses"][s], abs=1e-5), (name, s)


def test_clipping_is_by_the_global_norm(single, runs):
    # single clips with torch.nn.utils.clip_grad_norm_; the sharded runs sum squares of their
    # shards across ranks. The norm each logs must be the same, and clipping must bite.
    world, out = runs
    ref_norms = [e["grad_norm"] for e in single["clip"]["events"]]
    assert min(ref_norms) > CLIP  # clipping is active at every step
    assert _worst_param_diff(single["clip"], single["short"]) > 100 * ATOL  # and changes the run
    print(f"single: global grad norm per step {min(ref_norms):.3f}..{max(ref_norms):.3f}")
    for s in CLIPPED[world]:
        for events in out[f"{s} clip"]["events"]:
            norms = [e["grad_norm"] for e in events]
            assert norms == pytest.approx(ref_norms, rel=1e-5), s


# -- memory per rank ---------------------------------------------------------------------------
def _expected_memory(strategy, cfg, world):
    psi, units, T = _psi(cfg), _units(cfg), _n_tensors(cfg)
    if strategy == "zero1":
        P = padded_size(psi, world)
        return {"params": 4 * P, "grads": 4 * P, "optim": 8 * P // world + 4}
    Pu = sum(padded_size(u, world) for u in units)
    params = 4 * Pu if strategy == "zero2" else 4 * Pu // world
    return {"params": params, "grads": 4 * Pu // world, "optim": 8 * Pu // world + 4 * len(units)}


def test_single_memory_is_the_replicated_formula(single):
    mem = single["mem"]["events"][-1]["memory"]
    psi, T = _psi(MEM), _n_tensors(MEM)
    assert psi % 4 == 2 and all(u % 4 == 2 for u in _units(MEM))  # padding at N = 2 and 4
    assert (mem["params"], mem["grads"], mem["optim"]) == (4 * psi, 4 * psi, 8 * psi + 4 * T)


def test_zero_memory_per_rank_is_the_sharded_formula(runs):
    world, out = runs
    psi = _psi(MEM)
    for s in ("zero1", "zero2", "zero3"):
        expect = _expected_memory(s, MEM, world)
        for r, events in enumerate(out[f"{s} mem"]["events"]):
            for e in events:
                got = {k: e["memory"][k] for k in expect}
                assert got == expect, (s, r, e["step"], got, expect)
        info = out[f"{s} mem"]["events"][0][-1]["zero"]
        print(f"world={world} {s}: per rank {expect} (Ψ={psi}, padded {info['padded']}, shard "
              f"{info['shard']}); single: params {4 * psi} grads {4 * psi} optim "
              f"{8 * psi + 4 * _n_tensors(MEM)}")


def test_offload_moves_the_optimizer_state_category(runs):
    world, out = runs
    expect = _expected_memory("zero3", MEM, world)
    for events in out["zero3 mem offload"]["events"]:
        m = events[-1]["memory"]
        assert (m["optim"], m["optim_offloaded"]) == (0, expect["optim"])
        assert (m["params"], m["grads"]) == (expect["params"], expect["grads"])
        assert events[-1]["zero"]["offload"].startswith("cpu")
    for r, events in enumerate(out.get("fsdp-torch mem offload", {"events": []})["events"]):
        m, ref = events[-1]["memory"], out["fsdp-torch mem"]["events"][r][-1]["memory"]
        for k in ("params", "grads", "optim"):
            assert (m[k], m[f"{k}_offloaded"]) == (0, ref[k])


def test_reference_memory_sums_to_the_model_over_ranks(runs):
    # torch's shards are not the flat padded ones: FSDP2 cuts each tensor on dim 0 (uneven rows
    # allowed), ZeroRedundancyOptimizer gives whole tensors to ranks. Over all ranks the local
    # shards add up to the model exactly; AdamW keeps a step counter per tensor it steps
    # (FSDP2: every rank steps every tensor's shard; ZeRO-1: each tensor on one rank).
    world, out = runs
    psi, T = _psi(MEM), _n_tensors(MEM)
    total = lambda s, k: sum(ev[-1]["memory"][k] for ev in out[f"{s} mem"]["events"])  # noqa
    assert (total("fsdp-torch", "params"), total("fsdp-torch", "grads")) == (4 * psi, 4 * psi)
    assert total("fsdp-torch", "optim") == 8 * psi + 4 * T * world
    assert total("zero1-torch", "optim") == 8 * psi + 4 * T
    for ev in out["zero1-torch mem"]["events"]:  # DDP keeps full parameters and gradients
        assert (ev[-1]["memory"]["params"], ev[-1]["memory"]["grads"]) == (4 * psi, 4 * psi)
    per_rank = [ev[-1]["memory"]["optim"] for ev in out["zero1-torch mem"]["events"]]
    print(f"world={world}: zero1-torch optimizer state per rank {per_rank} (greedy whole-tensor "
          f"partition) vs zero1 {_expected_memory('zero1', MEM, world)['optim']}")


# -- bytes on the wire -------------------------------------------------------------------------
def _assert_bytes(stats, kind, expect, calls):
    assert stats[kind]["bytes_sent"] == pytest.approx(expect, abs=1e-6), kind
    assert stats[kind]["bytes_recv"] == pytest.approx(expect, abs=1e-6), kind
    assert stats[kind]["calls"] == calls, kind


def test_bytes_per_rank_per_step_follow_the_paper(runs):
    world, out = runs
    n, psi, units = world, _psi(BASE), _units(BASE)
    Pu = sum(padded_size(u, world) for u in units)
    assert Pu == psi == padded_size(psi, world)  # BASE: no padding, the formulas are exact
    ddp = ring_allreduce_bytes(4 * psi, n)  # DDP's 2(N-1)/N x 4Ψ (test_ddp.py measures it)
    half = (n - 1) * 4 * psi / n
    U = len(units)
    for name, run in out.items():
        cfg = run["cfg"]
        if cfg.optimizer != "sgd" or cfg.grad_clip or cfg.strategy == "fsdp-torch":
            continue
        A = cfg.grad_accum
        for res in run["ranks"]:
            for stats in res["comm"]:
                total = sum(v["bytes_sent"] for v in stats.values())
                if cfg.strategy == "zero1-torch":
                    assert set(stats) == {"all_reduce"}, (name, stats)
                    assert stats["all_reduce"]["bytes_sent"] == pytest.approx(ddp, abs=1e-6)
                elif cfg.strategy == "zero1":
                    assert set(stats) == {"reduce_scatter", "all_gather"}, (name, stats)
                    _assert_bytes(stats, "reduce_scatter", half, 1)
                    _assert_bytes(stats, "all_gather", half, 1)
                    assert total == pytest.approx(ddp, abs=1e-6)
                elif cfg.strategy == "zero2":
                    assert set(stats) == {"reduce_scatter", "all_gather"}, (name, stats)
                    _assert_bytes(stats, "reduce_scatter", half, U)
                    _assert_bytes(stats, "all_gather", half, U)
                    assert total == pytest.approx(ddp, abs=1e-6)
                else:  # zero3: gathered for forward and again for backward, every micro-batch
                    assert set(stats) == {"reduce_scatter", "all_gather"}, (name, stats)
                    _assert_bytes(stats, "reduce_scatter", half, U)
                    _assert_bytes(stats, "all_gather", 2 * A * half, 2 * A * U)
                    if A == 1:
                        assert total == pytest.approx(1.5 * ddp, abs=1e-6)
    print(f"world={world}: per rank per step ddp {ddp:.0f} B, zero1/zero2 {2 * half:.0f} B, "
          f"zero3 {3 * half:.0f} B (x{3 * half / ddp:.2f})")


def test_zero1_torch_broadcasts_partitions(runs):
    # ZeroRedundancyOptimizer's broadcasts bypass Comm: step_info models them as chains. Each
    # rank's partition goes to the N-1 others, so over all ranks N-1 copies of 4Ψ are received.
    world, out = runs
    psi = _psi(BASE)
    info = [ev[-1]["zero1_torch"] for ev in out["zero1-torch"]["events"]]
    assert sum(info[0]["partition_bytes"]) == 4 * psi
    recv = [i["broadcast_modeled"]["bytes_recv"] for i in info]
    assert sum(recv) == (world - 1) * 4 * psi
    for r, i in enumerate(info):
        assert tuple(i["broadcast_modeled"].values()) == chain_broadcast_bytes(
            info[0]["partition_bytes"], r)
    ddp = ring_allreduce_bytes(4 * psi, world)
    print(f"world={world}: zero1-torch per rank: all-reduce {ddp:.0f} B + broadcasts received "
          f"{recv} B; zero1: {ddp:.0f} B in all")


def test_zero3_prefetches_and_frees(runs):
    # After the first forward recorded the order, every all-gather but the first of a forward
    # is a prefetch, and from the second step on that one too (started between steps);
    # gathered parameters peak at a few units (the one computing, the next one arriving, and
    # in backward the one whose last gradients are still on their way).
    world, out = runs
    units = _units(BASE)
    biggest = 4 * max(padded_size(u, world) for u in units)
    for events in out["zero3"]["events"]:
        first = events[0]["zero"]["prefetch"]
        assert (first["gathers"], first["prefetched"]) == (2 * len(units), 2 * len(units) - 1)
        for e in events[1:]:
            p = e["zero"]["prefetch"]
            assert p["gathers"] == p["prefetched"] == 2 * len(units)
            # the blocked time splits into the gathers issued when needed and late prefetches
            assert p["blocked_unprefetched_s"] + p["blocked_prefetched_s"] == pytest.approx(
                p["blocked_s"], abs=1e-9)
            assert 0 <= p["blocked_prefetched_max_s"] <= p["blocked_prefetched_s"] + 1e-12
            # and into forward's and backward's
            assert set(p["blocked_by_phase_s"]) == {"forward", "backward"}
            assert sum(p["blocked_by_phase_s"].values()) == pytest.approx(p["blocked_s"],
                                                                          abs=1e-9)
            # each gather's moments (benchmarks/step_model.py sets ranks' side by side):
            # issued and needed before it was had, and blocked = had - needed
            assert len(p["timed"]) == p["gathers"]
            assert all(i <= w and n <= w for i, n, w in p["timed"])
            assert sum(w - n for _, n, w in p["timed"]) == pytest.approx(p["blocked_s"],
                                                                        abs=1e-9)
            assert e["zero"]["gathered_peak_bytes"] <= 3 * biggest
            assert e["zero"]["grad_buffer_peak_bytes"] <= 2 * biggest
    e = out["zero3"]["events"][0][-1]["zero"]
    print(f"world={world} zero3: {e['prefetch']}, gathered peak {e['gathered_peak_bytes']} B, "
          f"flat gradient peak {e['grad_buffer_peak_bytes']} B, of {4 * sum(units)} B in all")


def whole_against_full_tensor(rank, world, device, log):
    """distlab's gloo gather of FSDP2's DTensors against DTensor.full_tensor(), on a 1-D mesh
    of 4 (a length of 5 cut 2, 2, 1, 0) and on HSDP's 2 x 2 mesh (Replicate, Shard(0))."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from distlab.parallel.zero.zero_torch import _whole

    torch.manual_seed(0)
    whole = {"5x3": torch.randn(5, 3), "7": torch.randn(7), "1x2": torch.randn(1, 2)}
    flat = init_device_mesh("cpu", (world,))
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for name, t in whole.items():
        for mesh, placements in ((flat, [Shard(0)]), (hsdp, [Replicate(), Shard(0)])):
            d = distribute_tensor(t, mesh, placements)
            ours = _whole(d)
            out[f"{name} {mesh.ndim}-D"] = (tuple(d.to_local().shape), torch.equal(ours, t),
                                           torch.equal(ours, d.full_tensor()))
    return out


@pytest.mark.slow
def test_fsdp2_state_dict_gathers_uneven_shards_like_full_tensor():
    """FSDP2's state dict over gloo gathers with c10d (distlab.parallel.zero.zero_torch._whole):
    DTensor.full_tensor()'s functional collectives crashed over gloo with CUDA tensors on an
    H200. Equal to the tensor and to full_tensor(), bit for bit, also where a rank's piece is
    empty."""
    per_rank = run_ranks(whole_against_full_tensor, 4, timeout_s=60)
    assert per_rank[3]["5x3 1-D"][0] == (0, 3)  # the last rank's piece of 5 rows is empty
    for rank, res in enumerate(per_rank):
        for case, (_, equal, as_torch) in res.items():
            assert equal and as_torch, (rank, case)
