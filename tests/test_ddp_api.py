"""distlab.DistributedDataParallel on models the tests define, outside distlab's training loop:
a bare nn.Linear, tied weights, parameters on the root module, BatchNorm buffers, and fp32 next
to fp64 parameters. For each: a few SGD steps on 2 ranks against one process on the same global
batch, and against torch.nn.parallel.DistributedDataParallel on the same per-rank rows; the
gradients are compared right after `loss.backward()` returns, with no other call between;
no_sync accumulates locally and the next backward averages the sum; the wrapper works on a
process group other than the world.

Launches: one of 2 ranks runs every case (ours, torch's, no_sync, the guard rails), one of 4
ranks runs two groups of 2 side by side, and torchrun runs docs/your_model.md's snippet. The
single-process reference runs in this process.

Tolerance: ATOL = 1e-6 on parameters, buffers and gradients, float32, 5 SGD steps at lr 0.1 on
values of order 1. Against one process only the summation order differs (the gradient of the
mean over 8 rows vs the mean of two 4-row means): a few float32 ulps (1.2e-7 relative) per
step, which SGD at this step size does not amplify. Measured on torch 2.13 CPU with gloo: at
most 3e-8 on parameters and BatchNorm's running statistics after 5 steps, 1.2e-7 on the first
step's gradients (the fp64 parameter's, fed by fp32 products): 8x under ATOL or more, and the
inputs are seeded, so the figures do not vary from run to run. Against torch's DDP the
same gradients are averaged over 2 ranks, (a + b) / 2 here and a / 2 + b / 2 there, both exact
in binary floating point: measured 0. A wrong gradient (a bucket not averaged, a rank's
gradient missing, a bucket copied into the wrong parameters) is off by ~1e-2 or more.
"""


import pytest
import torch
import torch.distributed as dist
from api_models import Mixed, RootParams, Tied, batch, loss_of, max_diff, rows
from torch import nn

from distlab import DistributedDataParallel, run_ranks
from distlab.parallel.data_parallel.ddp import plan_buckets
from distlab.parallel.data_parallel.syncbn import convert_sync_batchnorm

ATOL = 1e-6
STEPS, LR = 5, 0.1
BUCKET_MB = 1e-5  # 10.5 bytes: a bucket closes once it reaches this, so nearly every
# gradient is a bucket of its own (torch's rule): several buckets in every model


# -- the models and their data --------------------------------------------------------------
def batchnorm_net():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


MODELS = {"bare linear": lambda: nn.Linear(6, 3), "tied": Tied, "root params": RootParams,
          "batchnorm": batchnorm_net, "mixed dtypes": Mixed}
NO_SYNC_CASES = ("bare linear", "tied", "root params", "mixed dtypes")  # BatchNorm: see below


def make(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name]()


def train(name, model, module, rank, world, seed=0):
    """STEPS of SGD on this rank's rows; the gradients right after the first backward."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = None
    for step in range(STEPS):
        x, y = (rows(t, rank, world) for t in batch(name, step, seed))
        loss_of(name, model(x), y).backward()
        if grads is None:  # nothing called since backward returned
            grads = {k: p.grad.clone() for k, p in module.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"state": {k: v.clone() for k, v in module.state_dict().items()}, "grads": grads}


def single(name, seed=0):
    """One process on the whole global batch: the reference."""
    return train(name, *(2 * [make(name, seed)]), rank=0, world=1, seed=seed)


# -- rank functions (spawned processes import them from here) --------------------------------
def ours(name, rank, world, sync_bn=True):
    module = make(name)
    if sync_bn:  # distlab's SyncBatchNorm: the global batch's statistics, as one process has
        module = convert_sync_batchnorm(module)
    return train(name, DistributedDataParallel(module, bucket_mb=BUCKET_MB), module, rank, world)


def torchs(name, rank, world):
    module = make(name)
    return train(name, nn.parallel.DistributedDataParallel(module, bucket_cap_mb=BUCKET_MB),
                 module, rank, world)


def no_sync_case(name, rank, world):
    """Two micro-batches of 2 rows per rank: the first under no_sync, then one that syncs."""
    module = make(name)
    ddp = DistributedDataParallel(module, bucket_mb=BUCKET_MB)
    x, y = (rows(t, rank, world) for t in batch(name, 0))
    calls = []
    with ddp.no_sync():
        (loss_of(name, ddp(x[:2]), y[:2]) / 2).backward()
    local = {k: p.grad.clone() for k, p in module.named_parameters()}
    calls.append(ddp.comm.stats.get("all_reduce", None))
    (loss_of(name, ddp(x[2:]), y[2:]) / 2).backward()
    calls.append(ddp.comm.stats["all_reduce"].calls)
    return {"local": local, "grads": {k: p.grad.clone() for k, p in module.named_parameters()},
            "calls": [0 if calls[0] is None else calls[0].calls, calls[1]],
            "buckets": len(ddp.buckets),
            "bucket_dtypes": [sorted({str(p.dtype) for p in b.params}) for b in ddp.buckets]}


def guard_rails(rank, world):
    """The errors a misuse gets, as text."""
    out = {}
    module = nn.Linear(6, 3)
    ddp = DistributedDataParallel(module)
    try:
        DistributedDataParallel(module)
    except ValueError as e:
        out["wrapped twice"] = str(e)
    module.double()  # the parameters change dtype under the wrapper
    try:
        ddp(torch.randn(2, 6, dtype=torch.float64))
    except RuntimeError as e:
        out["changed after wrapping"] = str(e)
    return out


def two_ranks(rank, world, device, log, names):
    out = {name: {"ours": ours(name, rank, world), "torch": torchs(name, rank, world)}
           for name in names}
    out["batchnorm"]["ours plain bn"] = ours("batchnorm", rank, world, sync_bn=False)
    for name in NO_SYNC_CASES:
        out[name]["no_sync"] = no_sync_case(name, rank, world)
    out["guard rails"] = guard_rails(rank, world)
    return out


def two_groups(rank, world, device, log, name):
    """Ranks {0, 1} and {2, 3}: two groups, each its own data and its own first init (every
    rank starts from a different seed; construction broadcasts from the group's first rank)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    g = rank // 2
    module = make(name, seed=rank)
    ddp = DistributedDataParallel(module, group=groups[g], bucket_mb=BUCKET_MB)
    return train(name, ddp, module, rank % 2, 2, seed=g)


# -- the tests ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched():
    return run_ranks(two_ranks, 2, list(MODELS), timeout_s=60)


@pytest.mark.parametrize("name", list(MODELS))
def test_equal_to_one_process_and_complete_when_backward_returns(launched, name):
    ref = single(name)
    for r, res in enumerate(launched):
        got = res[name]["ours"]
        grads, state = max_diff(got["grads"], ref["grads"]), max_diff(got["state"], ref["state"])
        print(f"{name} rank {r}: vs one process: gradients {grads:.1e}, after {STEPS} steps "
              f"{state:.1e}")
        assert grads <= ATOL and state <= ATOL


@pytest.mark.parametrize("name", list(MODELS))
def test_equal_to_torch_ddp(launched, name):
    for r, res in enumerate(launched):
        got = res[name]["ours plain bn" if name == "batchnorm" else "ours"]
        theirs = res[name]["torch"]
        grads = max_diff(got["grads"], theirs["grads"])
        state = max_diff(got["state"], theirs["state"])
        print(f"{name} rank {r}: vs torch DDP: gradients {grads:.1e}, after {STEPS} steps "
              f"{state:.1e} (parameters and buffers)")
        assert grads <= ATOL and state <= ATOL


@pytest.mark.parametrize("name", NO_SYNC_CASES)
def test_no_sync_accumulates_then_the_next_backward_averages_the_sum(launched, name):
    # Plain BatchNorm is left out: its statistics over 2-row micro-batches are not the global
    # batch's, so accumulation is not the large batch there, with torch's DDP as with ours.
    ref = single(name)["grads"]  # the first step's
    for r, res in enumerate(launched):
        got = res[name]["no_sync"]
        module = make(name)  # this rank's first micro-batch alone, in this process
        x, y = (rows(t, r, 2)[:2] for t in batch(name, 0))
        (loss_of(name, module(x), y) / 2).backward()
        local = {k: p.grad for k, p in module.named_parameters()}
        assert max_diff(got["local"], local) <= ATOL  # this rank's own, not averaged
        assert got["calls"] == [0, got["buckets"]]  # nothing sent, then one call per bucket
        assert max_diff(got["grads"], ref) <= ATOL  # the average of the accumulated sums
        assert all(len(d) == 1 for d in got["bucket_dtypes"])
    assert launched[0][name]["no_sync"]["buckets"] > 1  # BUCKET_MB cuts every model


def test_buckets_hold_one_dtype():
    params = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4),
              torch.zeros(2, dtype=torch.float64)]
    assert plan_buckets(params, 1e6) == [[0, 2], [1, 3]]
    assert plan_buckets(params, 16) == [[0], [1], [2], [3]]  # the cap per dtype
    same = [torch.zeros(n) for n in (5, 3, 4, 10, 1, 1, 2)]
    assert plan_buckets(same, 32) == [[0, 1], [2, 3], [4, 5, 6]]  # = assign_buckets


def test_guard_rails_say_what_to_do(launched):
    msgs = launched[0]["guard rails"]
    assert "already wrapped" in msgs["wrapped twice"] and "fresh module" in msgs["wrapped twice"]
    assert "changed after it was wrapped" in msgs["changed after wrapping"]
    assert "then wrap it" in msgs["changed after wrapping"]


def test_any_process_group():
    name = "root params"
    res = run_ranks(two_groups, 4, name, timeout_s=60)
    for g in (0, 1):
        ref = train(name, *(2 * [make(name, seed=2 * g)]), rank=0, world=1, seed=g)
        for r in (2 * g, 2 * g + 1):
            worst = max_diff(res[r]["state"], ref["state"])
            print(f"group {g} rank {r}: vs one process from rank {2 * g}'s init: {worst:.1e}")
            assert worst <= ATOL
    assert max_diff(res[0]["state"], res[2]["state"]) > 1e-2  # the groups did train apart
