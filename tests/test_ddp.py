"""DDP (`ddp`, written in distlab, and `ddp-torch`, torch's own) follows `single` step for step,
moves the bytes the ring formula says, once per optimizer step, in the buckets bucket_mb asks
for, and starts communicating before backward ends.

Launches: one `single` run, then one launch per world size (2 and 4) that trains every DDP
config in turn (distlab.rank.train.train_with_state); the bucket timelines come from the launch's
event log.

Tolerance: atol=1e-5 on every parameter after 10 SGD steps in float32, as in
test_equivalence.py. A bucketed all-reduce sums the same numbers as a per-tensor one; against
`single` only the summation order differs (the mean of per-slice gradients vs the gradient of
the mean), ~1e-7 relative per step, and SGD does not amplify it (we observed at most 7.5e-8 over 20 steps).
1e-5 leaves a >100x margin, while a wrong gradient (a bucket not averaged, a bucket copied back
into the wrong parameters, a micro-batch not accumulated) moves parameters by ~1e-2.
"""

import statistics

import pytest
import torch

from distlab.events import step_events_per_run
from distlab import RunConfig, run_ranks
from distlab.comm import ring_allreduce_bytes
from distlab.models import GPT, GPTConfig
from distlab.parallel.data_parallel.compression import TopK, topk_bytes_per_rank, topk_count
from distlab.parallel.data_parallel.ddp import MiB, assign_buckets, overlap_fraction
from distlab.rank.train import train_with_state

ATOL = 1e-5
BASE = RunConfig(steps=10, optimizer="sgd", lr=0.1, global_batch=8, seq_len=16, n_layer=2,
                 n_embd=32, n_head=2, mlp_ratio=4, timeout_s=60)
# BASE's GPT has 30,080 parameters: 120,320 B of float32 gradients, the largest tensor
# (mlp.fc.weight) 16,384 B. 0.02 MiB (20,972 B) cuts them into 8 buckets, 0.005 MiB into more,
# 1 MiB into one.
BUCKET_MB = (0.02, 0.005, 1.0)
ACCUM = {2: 4, 4: 2}  # micro-batches per step: 1 row each at world 2 and 4 (global batch 8)
TOPK_RATIO = 0.01


def _configs(world):
    ddp = BASE.replace(strategy="ddp", world_size=world, bucket_mb=BUCKET_MB[0])
    return {
        "ddp": ddp,
        "ddp-torch": ddp.replace(strategy="ddp-torch"),
        "ddp accum": ddp.replace(grad_accum=ACCUM[world]),
        "ddp-torch accum": ddp.replace(strategy="ddp-torch", grad_accum=ACCUM[world]),
        "ddp small buckets": ddp.replace(bucket_mb=BUCKET_MB[1]),
        "ddp one bucket": ddp.replace(bucket_mb=BUCKET_MB[2]),
        "ddp topk": ddp.replace(compress="topk", topk_ratio=TOPK_RATIO),
    }


def _grad_sizes():
    """Gradient bytes per parameter in ddp's launch order (reverse registration)."""
    model = GPT(GPTConfig.from_run(BASE))
    return [p.numel() * p.element_size() for p in model.parameters()][::-1]


def _expected_buckets(bucket_mb):
    sizes = _grad_sizes()
    return [sum(sizes[i] for i in b) for b in assign_buckets(sizes, bucket_mb * MiB)]


def _worst_param_diff(result, ref):
    return max((t - ref["state"][k]).abs().max().item()
               for k, t in result["state"].items())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("single"))
    return run_ranks(train_with_state, 1, [BASE.to_dict()], timeout_s=60, run_dir=run_dir)[0][0]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def ddp_runs(request, tmp_path_factory):
    world = request.param
    cfgs = _configs(world)
    run_dir = str(tmp_path_factory.mktemp(f"ddp-w{world}"))
    results = run_ranks(train_with_state, world, [c.to_dict() for c in cfgs.values()],
                        timeout_s=60, run_dir=run_dir)
    out = {}
    for i, (name, cfg) in enumerate(cfgs.items()):
        out[name] = {"cfg": cfg, "ranks": [results[r][i] for r in range(world)],
                     "events": [step_events_per_run(run_dir, r)[i] for r in range(world)]}
    return world, out


def test_ddp_matches_single_parameter_by_parameter(single, ddp_runs):
    world, runs = ddp_runs
    for name, run in runs.items():
        if run["cfg"].compress != "none":
            continue
        worst = max(_worst_param_diff(res, single) for res in run["ranks"])
        print(f"world={world} {name}: worst parameter diff vs single {worst:.2e}")
        assert worst <= ATOL, f"{name}: |diff| {worst:.2e}"
        # every rank applied the same averaged gradient: bitwise identical parameters
        for res in run["ranks"][1:]:
            for k, t in res["state"].items():
                assert torch.equal(t, run["ranks"][0]["state"][k]), (name, k)
        # the mean of the ranks' slice losses is the global batch's loss
        for s in range(BASE.steps):
            mean = sum(res["losses"][s] for res in run["ranks"]) / world
            assert mean == pytest.approx(single["losses"][s], abs=1e-5), (name, s)


def test_bytes_per_rank_per_step_equal_the_ring_formula(ddp_runs):
    world, runs = ddp_runs
    grad_bytes = sum(_grad_sizes())
    expect = ring_allreduce_bytes(grad_bytes, world)  # 2(N-1)/N x gradient bytes
    for name, run in runs.items():
        if run["cfg"].compress != "none":
            continue
        for r, res in enumerate(run["ranks"]):
            for s, stats in enumerate(res["comm"]):
                assert set(stats) == {"all_reduce"}, (name, s, stats)  # nothing else per step
                assert stats["all_reduce"]["bytes_sent"] == pytest.approx(expect, abs=1e-6)
                assert stats["all_reduce"]["bytes_recv"] == pytest.approx(expect, abs=1e-6)


def test_one_all_reduce_per_bucket_per_optimizer_step(ddp_runs):
    # with accumulation the micro-batches before the last only accumulate (no_sync): calls per
    # step = buckets, not grad_accum x buckets
    world, runs = ddp_runs
    n_ours = len(_expected_buckets(BUCKET_MB[0]))
    for name in ("ddp", "ddp accum", "ddp-torch", "ddp-torch accum"):
        run = runs[name]
        for r, res in enumerate(run["ranks"]):
            for s, stats in enumerate(res["comm"]):
                if name.startswith("ddp-torch"):
                    # torch's Reducer: one bucket in iteration 0, rebuilt from iteration 1 on
                    n = len(run["events"][r][s]["ddp_torch"]["buckets"])
                    assert n == 1 if s == 0 else n > 1, (name, s, n)
                else:
                    n = n_ours
                assert stats["all_reduce"]["calls"] == n, (name, r, s)
    print(f"world={world}: buckets at bucket_mb={BUCKET_MB[0]}: ddp {n_ours}, ddp-torch "
          f"{len(runs['ddp-torch']['events'][0][1]['ddp_torch']['buckets'])} (from step 1)")


def test_bucket_count_follows_bucket_mb(ddp_runs):
    world, runs = ddp_runs
    counts = {}
    for name in ("ddp", "ddp small buckets", "ddp one bucket"):
        run = runs[name]
        expect = _expected_buckets(run["cfg"].bucket_mb)
        for events in run["events"]:
            for e in events:
                assert [b["bytes"] for b in e["ddp"]["buckets"]] == expect, name
        counts[run["cfg"].bucket_mb] = len(expect)
    assert counts[BUCKET_MB[2]] == 1
    assert counts[BUCKET_MB[1]] > counts[BUCKET_MB[0]] > 1
    print(f"world={world}: buckets per bucket_mb {counts}")


def test_all_reduces_start_before_backward_ends(ddp_runs):
    world, runs = ddp_runs
    overlaps = []
    for name in ("ddp", "ddp small buckets"):
        for events in runs[name]["events"]:
            for e in events:
                t = e["ddp"]
                starts = [b["start"] for b in t["buckets"]]
                assert starts == sorted(starts)  # launched in bucket order on every rank
                assert starts[0] < t["backward"][1], (name, e["step"])
                assert 0 < t["overlap"] <= 1 and t["hidden_s"] > 0
                overlaps.append(t["overlap"])
    print(f"world={world}: overlap median {statistics.median(overlaps):.2f} "
          f"(min {min(overlaps):.2f}, max {max(overlaps):.2f})")


def test_topk_bytes_equal_values_plus_indices(ddp_runs):
    # each rank all-gathers k float32 values + k int32 indices per bucket (k = ratio x numel,
    # rounded, at least 1): a ring all-gather sends (N-1) x 8k bytes per rank
    world, runs = ddp_runs
    run = runs["ddp topk"]
    numels = [b // 4 for b in _expected_buckets(run["cfg"].bucket_mb)]
    expect = topk_bytes_per_rank(numels, TOPK_RATIO, world)
    for res in run["ranks"]:
        for stats in res["comm"]:
            assert set(stats) == {"all_gather"}
            assert stats["all_gather"]["calls"] == len(numels)
            assert stats["all_gather"]["bytes_sent"] == pytest.approx(expect, abs=1e-6)
    dense = ring_allreduce_bytes(sum(_grad_sizes()), world)
    print(f"world={world}: topk {TOPK_RATIO} sends {expect} B/step vs dense {dense:.0f} B "
          f"({dense / expect:.1f}x fewer)")


def test_topk_loss_still_falls(ddp_runs):
    world, runs = ddp_runs

    def global_losses(name):  # mean of the ranks' slice losses = the global batch's loss
        ranks = runs[name]["ranks"]
        return [sum(r["losses"][s] for r in ranks) / world for s in range(BASE.steps)]

    topk, dense = global_losses("ddp topk"), global_losses("ddp")
    first, last = statistics.mean(topk[:3]), statistics.mean(topk[-3:])
    print(f"world={world}: loss, first 3 -> last 3 steps: topk {first:.3f} -> {last:.3f}, "
          f"uncompressed {statistics.mean(dense[:3]):.3f} -> {statistics.mean(dense[-3:]):.3f}")
    assert last < first - 0.05  # it learns ...
    assert last > statistics.mean(dense[-3:])  # ... more slowly than with every entry sent


# -- the pieces, in process ----------------------------------------------------------------
def test_assign_buckets_closes_a_bucket_once_it_reaches_the_cap_as_torch_does():
    sizes = [5, 3, 4, 10, 1, 1, 2]
    assert assign_buckets(sizes, 8) == [[0, 1], [2, 3], [4, 5, 6]]
    assert assign_buckets(sizes, 100) == [list(range(7))]
    for cap in (1, 4, 8, 13):
        buckets = assign_buckets(sizes, cap)
        assert [i for b in buckets for i in b] == list(range(7))  # order kept, all present
        for b in buckets[:-1]:
            total = sum(sizes[i] for i in b)
            assert total >= cap  # closed once it reached the cap ...
            assert total - sizes[b[-1]] < cap  # ... and not before
    # the same buckets as torch's Reducer at the same cap, on the default GPT's gradients
    import torch.distributed as dist
    grads = [torch.empty(s // 4) for s in _grad_sizes()]
    for mb in (0.05, 0.25, 1.0):
        cap = int(mb * MiB)
        theirs, _ = dist._compute_bucket_assignment_by_size(grads, [cap], [False] * len(grads))
        assert assign_buckets(_grad_sizes(), cap) == [list(b) for b in theirs], mb


def test_overlap_fraction():
    # union of [0,2] and [1,4] is [0,4]; the window [0,3] covers 3 of it
    assert overlap_fraction([(1, 4), (0, 2)], (0, 3)) == (3, 4)
    assert overlap_fraction([(5, 6)], (0, 3)) == (0, 1)
    assert overlap_fraction([], (0, 3)) == (0, 0)


def test_topk_with_ratio_one_is_the_dense_mean():
    g = [torch.randn(50) for _ in range(3)]
    payloads = [TopK(1.0).compress(0, x) for x in g]
    out = TopK.decompress(torch.cat(payloads), torch.empty(50), world=3)
    assert torch.allclose(out, sum(g) / 3, atol=1e-6)


def test_topk_error_feedback_loses_nothing():
    # what was sent over T steps plus what is still in memory is the sum of the gradients
    torch.manual_seed(0)
    c, sent, total = TopK(0.1), torch.zeros(40), torch.zeros(40)
    for _ in range(5):
        g = torch.randn(40)
        total += g
        sent += TopK.decompress(c.compress(0, g), torch.empty(40), world=1)
        assert (TopK.decompress(c.compress(1, g), torch.empty(40), 1) != 0).sum() == 4
    assert torch.allclose(sent + c.memory[0], total, atol=1e-5)
    assert topk_count(40, 0.1) == 4 and topk_count(10, 0.01) == 1
