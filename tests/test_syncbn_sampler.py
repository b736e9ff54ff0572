"""SyncBatchNorm, BatchNorm buffers, the distributed sampler and uneven inputs.

Checked against (a) `single` on the same global batch and (b) PyTorch's own implementations:
nn.BatchNorm1d (nn.SyncBatchNorm cannot train on CPU), torch's DistributedSampler, and torch
DDP under `Join` on the same per-rank batches.

Tolerances (measured on this machine, torch 2.13 CPU):

* SyncBN under `allreduce` vs `single`, SGD fp32, 20 steps: ATOL_BN = 1e-5. Measured worst
  differences: parameters 1.2e-7 (world 2 and 4), running statistics 2.4e-7 (world 2) and
  3.6e-7 (world 4). The statistics are summed in a different order (per rank, then across
  ranks) and BatchNorm divides by sqrt(var + eps), which amplifies rounding where a channel's
  variance over the batch is small (its backward carries 1/std and 1/std³). We feared that
  would need a looser tolerance than the GPT's; in practice, with the sums taken in float64
  (distlab.parallel.data_parallel.syncbn), it agrees about as well as the GPT (~1e-7), so the GPT's 1e-5
  (test_equivalence) holds with a margin of ~30x. Plain per-rank BatchNorm misses `single` by
  0.26 (world 2, 4 rows per rank) and ~10 (world 4, 2 rows per rank): four orders and more
  above the tolerance. Where small batches do bite is the single-layer comparison with 2 rows
  (see test_syncbn_at_world_1_equals_torch_batchnorm1d): there even torch's fp32 kernel is
  ~3e-4 off the exact input gradient.
* ours vs torch DDP + Join, SGD: ATOL = 1e-5 as for the GPT; measured 0 (world 2) and 7.5e-9
  (world 4).
"""

import copy
import math
import time

import pytest
import torch

from distlab import RunConfig, RunError, launch, run_ranks
from distlab.data.dataset import ClusterData, FiniteDataset, MarkovData, make_data
from distlab.models.bnnet import BNNet
from distlab.parallel.data_parallel.syncbn import SyncBatchNorm, convert_sync_batchnorm
from distlab.data.sampler import DistributedSampler, ShardReader, batches_per_rank, shard_reader
from distlab.rank.train import train_with_state
from distlab.rank.build import build_model

ATOL_BN = 1e-5
ATOL = 1e-5

# The BatchNorm net on Gaussian clusters: 8 rows per step, so 4 rows per rank at world 2 and 2
# at world 4. Hidden width 32.
BN = RunConfig(model="bnnet", optimizer="sgd", lr=0.1, steps=20, global_batch=8, n_embd=32,
               timeout_s=60)
# A finite set of 32 rows read for 2 epochs: 4 equal batches of 8 per epoch at any world size
# dividing 8 ("equal batches by construction").
BN_FINITE = BN.replace(sync_bn=True, dataset_size=32, epochs=2)
# A tiny GPT on a finite Markov set of 9 rows, 2 rows per rank per step: at world 2 the shards
# hold 5 and 4 rows, i.e. 3 and 2 batches (uneven inputs); drop_last=True makes them 2 and 2.
# (Uneven shards differ by one row, so the extra batch has one row: BatchNorm could not train
# on it, hence the GPT here.)
GPT_UNEVEN = RunConfig(strategy="allreduce", optimizer="sgd", lr=0.1, steps=20, global_batch=4,
                       seq_len=16, n_layer=1, n_embd=32, n_head=2, dataset_size=9,
                       drop_last=False, timeout_s=60)


# -- unit checks: no processes ------------------------------------------------------------------

def test_cluster_data_is_deterministic_and_rank_blocks_partition_the_global_batch():
    d = ClusterData(seed=3)
    x, y = d.global_batch(5, 8)
    x2, y2 = ClusterData(seed=3).global_batch(5, 8)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (8, 16)
    for world in (2, 4):
        parts = [d.rank_batch(5, 8, r, world) for r in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert not torch.equal(d.global_batch(6, 8)[0], x)
    # the Bayes floor is well below a uniform guess, and its Monte Carlo error is small
    assert d.loss_at_start == pytest.approx(math.log(4))
    assert 0.05 < d.loss_floor < 0.5 * d.loss_at_start and d.loss_floor_stderr < 0.01
    # features are deliberately far from mean 0 / variance 1: BatchNorm has work to do
    big = d.global_batch(0, 4096)[0]
    assert big.mean(0).abs().max() > 2 and (big.std(0).max() / big.std(0).min()) > 4
    assert make_data(BN).__class__ is ClusterData and make_data(RunConfig()).__class__ is MarkovData


def test_syncbn_at_world_1_equals_torch_batchnorm1d():
    """Forward, input and parameter gradients, running statistics and eval output of our
    SyncBatchNorm (no process group: the global batch is the local one) against torch's
    nn.BatchNorm1d, over several training steps and batch sizes.

    Both are measured against nn.BatchNorm1d in float64, the exact answer to ~1e-15. The
    comparison is error against error, not a fixed tolerance, because with 2 rows BatchNorm's
    input gradient is a near-total cancellation (the normalised output of 2 rows is ±1 whatever
    x is, so d out/dx ≈ 0): torch's own fp32 kernel misses the float64 answer there by a fraction
    ~3e-4 of the gradient's scale (measured), and so would any fp32 implementation."""
    torch.manual_seed(0)
    data = ClusterData()
    worst = {}  # quantity -> (our error, torch's error), relative to the quantity's scale
    for rows in (2, 3, 8, 64):
        lin = torch.nn.Linear(16, 32)
        ref = torch.nn.BatchNorm1d(32)
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.normal_()
        ours = convert_sync_batchnorm(copy.deepcopy(ref))
        exact = copy.deepcopy(ref).double()
        assert isinstance(ours, SyncBatchNorm)
        for step in range(3):
            h = lin(data.global_batch(step, rows)[0]).detach()
            g = torch.randn(rows, 32)
            got = {}
            for name, m, dtype in (("torch", ref, torch.float32), ("ours", ours, torch.float32),
                                   ("exact", exact, torch.float64)):
                x = h.to(dtype).clone().requires_grad_()
                y = m(x)
                (y * g.to(dtype)).sum().backward()
                got[name] = {"out": y, "grad_x": x.grad, "grad_w": m.weight.grad,
                             "grad_b": m.bias.grad, "running_mean": m.running_mean,
                             "running_var": m.running_var}
                m.zero_grad()
            for q, t in got["exact"].items():
                scale = t.abs().max().item()
                e_ours, e_torch = ((got[k][q].double() - t).abs().max().item() / scale
                                   for k in ("ours", "torch"))
                old = worst.get(q, (0.0, 0.0))
                worst[q] = (max(old[0], e_ours), max(old[1], e_torch))
        assert torch.equal(ref.num_batches_tracked, ours.num_batches_tracked)
        ref.eval(), ours.eval()
        x = lin(data.global_batch(9, 5)[0]).detach()
        torch.testing.assert_close(ours(x), ref(x))  # eval: running statistics
    print("vs float64 BatchNorm1d, worst relative error (ours, torch's fp32):",
          {q: f"{a:.1e}, {b:.1e}" for q, (a, b) in worst.items()})
    for q, (e_ours, e_torch) in worst.items():
        # no worse than torch's own fp32 kernel (2x for rounding luck), or within 2e-6 of the
        # scale (~16 fp32 ulps); a wrong formula (biased running var, a missing 1/N, a gradient
        # without the mean terms) is off by >1e-2
        assert e_ours <= max(2 * e_torch, 2e-6), (q, e_ours, e_torch)


def test_convert_keeps_parameters_and_the_rank_builds_syncbn_only_when_asked():
    plain = build_model(BN)
    torch.manual_seed(0)
    a = build_model(BN)
    torch.manual_seed(0)
    b = build_model(BN.replace(sync_bn=True))
    assert not any(isinstance(m, SyncBatchNorm) for m in plain.modules())
    assert sum(isinstance(m, SyncBatchNorm) for m in b.modules()) == 2
    assert a.state_dict().keys() == b.state_dict().keys()  # same checkpoints either way
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    x, y = ClusterData().global_batch(0, 8)
    assert abs(a(x, y).item() - b(x, y).item()) < 1e-6  # forward(x, targets): the mean loss
    assert isinstance(BNNet(), torch.nn.Module)


def test_sampler_shards_are_disjoint_and_cover_the_epoch():
    for size, world in ((10, 3), (9, 2), (16, 4), (5, 8)):
        for drop_last in (False, True):
            shards = [DistributedSampler(size, world, r, seed=1, drop_last=drop_last).indices(2)
                      for r in range(world)]
            flat = [i for s in shards for i in s]
            assert len(flat) == len(set(flat)), "shards overlap"
            counts = [len(s) for s in shards]
            assert counts == [len(DistributedSampler(size, world, r, drop_last=drop_last))
                              for r in range(world)]
            if drop_last:  # equal counts; the dropped tail is smaller than the world
                assert len(set(counts)) == 1 and size - len(flat) == size % world
            else:  # no padding: every row exactly once, counts differ by at most one
                assert sorted(flat) == list(range(size)) and max(counts) - min(counts) <= 1
    s = DistributedSampler(100, 2, 0, seed=0)
    assert s.indices(0) != s.indices(1)  # reshuffled every epoch ...
    assert s.indices(0) == DistributedSampler(100, 2, 0, seed=0).indices(0)  # ... deterministically


def test_sampler_against_torch_distributed_sampler():
    from torch.utils.data.distributed import DistributedSampler as TorchSampler
    for size, world in ((10, 3), (9, 2), (16, 4), (7, 4)):
        for r in range(world):
            for epoch in (0, 3):
                t = TorchSampler(range(size), num_replicas=world, rank=r, seed=5, drop_last=True)
                t.set_epoch(epoch)
                ours = DistributedSampler(size, world, r, seed=5, drop_last=True)
                assert ours.indices(epoch) == list(t), "drop_last=True: identical to torch"
                t = TorchSampler(range(size), num_replicas=world, rank=r, seed=5, drop_last=False)
                t.set_epoch(epoch)
                padded, mine = list(t), DistributedSampler(size, world, r, seed=5,
                                                           drop_last=False).indices(epoch)
                # torch pads every rank to ceil(size/world) rows by repeating the head of the
                # permutation; ours stops at the data: torch's shard minus its padded rows
                assert len(padded) == math.ceil(size / world)
                assert padded[:len(mine)] == mine
    assert batches_per_rank(9, 2, 2, drop_last=False) == [3, 2]
    assert batches_per_rank(9, 2, 2, drop_last=True) == [2, 2]
    assert batches_per_rank(9, 2, 2, drop_last=False, epochs=3) == [9, 6]


def test_shard_reader_batches_are_the_rows_of_the_shard():
    data = FiniteDataset(ClusterData(), 9)
    assert torch.equal(data[3][0], FiniteDataset(ClusterData(), 20)[3][0])  # rows by index
    reader = ShardReader(data, DistributedSampler(9, 2, 0, drop_last=False), batch=2, epochs=2)
    assert [len(reader.rows(s)) for s in range(len(reader))] == [2, 2, 1, 2, 2, 1]
    assert reader.batch(len(reader)) is None
    x, y = reader.batch(1)
    assert torch.equal(x, data.x[reader.rows(1)]) and torch.equal(y, data.y[reader.rows(1)])
    r = shard_reader(GPT_UNEVEN.replace(world_size=2), make_data(GPT_UNEVEN), 1, 2)
    assert len(r) == 2 and r.batch(0)[0].shape == (2, 16)


def test_join_with_sync_bn_is_refused():
    with pytest.raises(ValueError, match="join=True with sync_bn=True"):
        BN.replace(join=True, sync_bn=True)


# -- multi-process runs: several configs per launch ---------------------------------------------

def torch_join_reference(rank, world, device, log, cfg_dict):
    """torch's own DDP under torch.distributed.algorithms.Join on this rank's batches from our
    sampler (divide_by_initial_world_size=False: average over the ranks that still have data)."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    cfg = RunConfig.from_dict(cfg_dict)
    torch.manual_seed(cfg.seed)
    model = DistributedDataParallel(build_model(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    reader = shard_reader(cfg, make_data(cfg), rank, world)
    with Join([model], divide_by_initial_world_size=False):
        for step in range(len(reader)):
            x, y = reader.batch(step)
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def buffers_at_step_start(rank, world, cfg_dict):
    """Give each rank different running statistics (as plain BatchNorm leaves them after a
    step), then start a step: AllReduceDP.batch broadcasts rank 0's, like torch DDP with
    broadcast_buffers=True at each forward. Returns the buffers after it."""
    from distlab.comm import Comm
    from distlab.parallel import make_strategy

    cfg = RunConfig.from_dict(cfg_dict)
    strategy = make_strategy(cfg, Comm())
    model = strategy.wrap(build_model(cfg))
    with torch.no_grad():
        for b in model.buffers():
            b.fill_(rank + 1)
    strategy.batch(make_data(cfg), 0)
    return {k: v.clone() for k, v in model.named_buffers()}


def syncbn_layer_vs_whole_batch(rank, world):
    """One SyncBatchNorm layer on this rank's rows of a 16-row batch against nn.BatchNorm1d on
    all 16 (torch's, in every rank): output and input-gradient rows, parameter gradients
    (summed over ranks: the loss is a sum over rows) and running statistics."""
    from distlab.comm import Comm

    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 8, generator=g) * 3 + 5
    dy = torch.randn(16, 8, generator=g)
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    ref = torch.nn.BatchNorm1d(8)
    ours = SyncBatchNorm(8, comm=Comm())
    xa, xb = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
    ya = ref(xa)
    (ya * dy).sum().backward()
    yb = ours(xb)
    (yb * dy[rows]).sum().backward()
    for p in (ours.weight, ours.bias):
        torch.distributed.all_reduce(p.grad)
    return {"out": (yb - ya[rows]).abs().max().item(),
            "grad_x": (xb.grad - xa.grad[rows]).abs().max().item(),
            "grad_w": (ours.weight.grad - ref.weight.grad).abs().max().item(),
            "grad_b": (ours.bias.grad - ref.bias.grad).abs().max().item(),
            "running": max((ours.running_mean - ref.running_mean).abs().max().item(),
                           (ours.running_var - ref.running_var).abs().max().item())}


def ours_and_torch_join(rank, world, device, log, cfg_dicts, join_dict):
    return {"ours": train_with_state(rank, world, device, log, cfg_dicts),
            "torch_join": torch_join_reference(rank, world, device, log, join_dict),
            "buffers": buffers_at_step_start(rank, world, cfg_dicts[0]),
            "layer": syncbn_layer_vs_whole_batch(rank, world)}


def _worst(a: dict, b: dict, only=None) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item()
               for k in a if only is None or only(k))


@pytest.fixture(scope="module")
def single():
    cfgs = [BN, BN.replace(sync_bn=True), BN_FINITE]
    out = run_ranks(train_with_state, 1, [c.to_dict() for c in cfgs], timeout_s=60)[0]
    return dict(zip(("plain", "sync", "finite"), out))


def _parallel_configs(world):
    par = dict(strategy="allreduce", world_size=world)
    cfgs = {"sync": BN.replace(sync_bn=True, **par), "plain": BN.replace(**par),
            "ddp_sync": BN.replace(sync_bn=True, strategy="ddp", world_size=world),
            "join": GPT_UNEVEN.replace(world_size=world, join=True)}
    if world == 2:
        cfgs["finite"] = BN_FINITE.replace(**par)
        cfgs["drop_last"] = GPT_UNEVEN.replace(world_size=world, drop_last=True)
    return cfgs


_launched: dict = {}  # world -> results: each world launches once for all the tests below


def _launch(world):
    if world not in _launched:
        _launched[world] = _run_parallel(world)
    return _launched[world]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def parallel(request):
    return _launch(request.param)


@pytest.fixture(scope="module")
def world2():
    return _launch(2)


def _run_parallel(world):
    cfgs = _parallel_configs(world)
    t0 = time.perf_counter()
    res = run_ranks(ours_and_torch_join, world, [c.to_dict() for c in cfgs.values()],
                    cfgs["join"].to_dict(), timeout_s=60)
    print(f"world {world}: {len(cfgs)} configs + torch Join in one launch, "
          f"{time.perf_counter() - t0:.1f} s")
    # results of rank r: ours[r][config name], torch_join[r], buffers[r]
    return {"world": world, "cfgs": cfgs,
            "ours": [{name: r["ours"][i] for i, name in enumerate(cfgs)} for r in res],
            "torch_join": [r["torch_join"] for r in res], "buffers": [r["buffers"] for r in res],
            "layer": [r["layer"] for r in res]}


def test_syncbn_layer_on_shards_equals_batchnorm1d_on_the_whole_batch(parallel):
    worst = {k: max(r[k] for r in parallel["layer"]) for k in parallel["layer"][0]}
    print(f"world {parallel['world']}: SyncBN on shards vs nn.BatchNorm1d on the batch:",
          {k: f"{v:.1e}" for k, v in worst.items()})
    # fp32 rounding at values of order 1-10 (x ~ 5 ± 3): ~1e-6; a wrong formula is off by >1e-2
    assert max(worst.values()) < 1e-5


def test_syncbn_allreduce_equals_single_params_and_running_stats(single, parallel):
    world, ours = parallel["world"], parallel["ours"]
    ref = single["sync"]["state"]
    # our SyncBN at world 1 trains exactly like nn.BatchNorm1d
    assert _worst(single["plain"]["state"], ref) < ATOL_BN
    for r in range(world):
        st = ours[r]["sync"]["state"]
        params = _worst(st, ref, lambda k: "running" not in k and "num_batches" not in k)
        stats = _worst(st, ref, lambda k: "running" in k)
        print(f"world {world} rank {r}: SyncBN vs single: params {params:.1e}, "
              f"running stats {stats:.1e}")
        assert params < ATOL_BN and stats < ATOL_BN
        assert _worst(st, ref, lambda k: "num_batches" in k) == 0
        for k, v in st.items():  # every rank holds the same model, buffers included
            assert torch.equal(v, ours[0]["sync"]["state"][k]), k
    mean_loss = [sum(ours[r]["sync"]["losses"][s] for r in range(world)) / world
                 for s in range(BN.steps)]
    assert max(abs(a - b) for a, b in zip(mean_loss, single["sync"]["losses"])) < 1e-5


def test_plain_batchnorm_per_rank_does_not_equal_single(single, parallel):
    world, ours = parallel["world"], parallel["ours"]
    st, ref = ours[0]["plain"]["state"], single["plain"]["state"]
    params = _worst(st, ref, lambda k: "running" not in k and "num_batches" not in k)
    stats = _worst(st, ref, lambda k: "running" in k)
    print(f"world {world} ({BN.global_batch // world} rows/rank): plain BN vs single: "
          f"params {params:.1e}, running stats {stats:.1e}")
    # per-rank statistics of 4 or 2 rows are a different function from the batch of 8's
    assert params > 1000 * ATOL_BN and stats > 1000 * ATOL_BN


def test_buffers_are_rank_0s_at_every_steps_start(parallel):
    # buffers_at_step_start: rank r filled its buffers with r + 1, then a step started
    for bufs in parallel["buffers"]:
        assert len(bufs) == 6  # 2 BatchNorm layers x (running_mean, running_var, count)
        for k, v in bufs.items():
            assert torch.equal(v, torch.ones_like(v)), k  # rank 0's, on every rank


def test_equal_batches_by_construction_finish_and_equal_single(single, world2):
    world, ours = world2["world"], world2["ours"]
    steps = len(single["finite"]["losses"])
    assert steps == 8  # 32 rows / 8 per step x 2 epochs: the run ends when the data does
    for r in range(world):
        assert len(ours[r]["finite"]["losses"]) == steps
        assert _worst(ours[r]["finite"]["state"], single["finite"]["state"]) < ATOL_BN


def test_drop_last_gives_equal_batches_and_the_run_finishes(world2):
    world, ours = world2["world"], world2["ours"]
    assert [len(ours[r]["drop_last"]["losses"]) for r in range(world)] == [2, 2]
    for k, v in ours[1]["drop_last"]["state"].items():
        assert torch.equal(v, ours[0]["drop_last"]["state"][k]), k


def test_join_keeps_ranks_identical_and_matches_torch_join(parallel):
    world, ours, torch_join = parallel["world"], parallel["ours"], parallel["torch_join"]
    cfg = parallel["cfgs"]["join"]
    counts = batches_per_rank(cfg.dataset_size, world, cfg.local_batch, cfg.drop_last)
    assert len(set(counts)) > 1  # really uneven: world 2 [3, 2], world 4 [3, 2, 2, 2]
    # each rank trained on its own batches (and shadowed the rest) ...
    assert [len(ours[r]["join"]["losses"]) for r in range(world)] == counts
    # ... and every rank ends with bitwise the same parameters
    for r in range(world):
        for k, v in ours[r]["join"]["state"].items():
            assert torch.equal(v, ours[0]["join"]["state"][k]), (r, k)
    # torch's joined ranks skip the optimizer and get the last joiner's model at the end; ours
    # step along with the averaged gradient: the same parameters either way
    diff = max(_worst(ours[r]["join"]["state"], torch_join[r]) for r in range(world))
    print(f"world {world}: batches per rank {counts}; ours vs torch DDP+Join: {diff:.1e}")
    assert diff < ATOL


def test_uneven_inputs_without_join_end_in_a_timeout_that_names_who_ran_out():
    cfg = GPT_UNEVEN.replace(world_size=2, timeout_s=3)
    t0 = time.perf_counter()
    with pytest.raises(RunError) as info:
        launch(cfg).wait(timeout=60)
    took = time.perf_counter() - t0
    msg = info.value.message
    print(f"uneven inputs, {took:.1f} s: {msg[:400]}")
    assert "timed out after 3 s (RunConfig.timeout_s)" in msg
    assert "batches per rank [3, 2]" in msg and "rank(s) [1] ran out of data after 2 steps" in msg
    assert took < 30


def test_syncbn_under_ddp_equals_single(single, parallel):
    # the DDP written here broadcasts buffers at each step and shares SyncBN's statistics
    world, ours = parallel["world"], parallel["ours"]
    ref = single["sync"]["state"]
    for r in range(world):
        st = ours[r]["ddp_sync"]["state"]
        assert _worst(st, ref, lambda k: "num_batches" not in k) < ATOL_BN
