"""Ranks that were built differently are told so, by name, on every rank, before the wrapper's
first collective: distlab.parallel.agree under each public wrapper.

One launch of 4 ranks runs every case in turn. In each, rank 2 (or rank 1) builds the wrapper
with one thing different (a layer width, the bucket size, the FSDP units, the ZeRO stage, a
learning rate, the TP plan); every rank must raise RanksDisagree naming that setting, the
value each side holds and the ranks that hold it, within a few seconds (the check is one
all_gather_object; before it, the width case under DistributedDataParallel ended in gloo's
"Received data size doesn't match" abort, and under parallelize_module it trained on with
shards that do not fit). A last case builds every wrapper alike and must pass: the check can
come out either way.
"""

import time

import pytest
import torch
from torch import nn

from distlab import (
    ColwiseParallel,
    DistributedDataParallel,
    RowwiseParallel,
    RunError,
    ZeroOptimizer,
    fully_shard,
    parallelize_module,
    run_ranks,
)
from distlab.parallel.agree import RanksDisagree

WORLD = 4
ODD = 2  # the rank built differently


def mlp(width=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))


def build(case, rank):
    """Build the case's wrapper as this rank would; rank ODD differs in one thing."""
    odd = rank == ODD
    if case == "ddp width":
        DistributedDataParallel(mlp(32 if odd else 16))
    elif case == "ddp bucket":
        DistributedDataParallel(mlp(), bucket_mb=1.0 if odd else 25.0)
    elif case == "fsdp units":
        model = mlp()
        fully_shard(model, units=["0"] if odd else ["2"])
    elif case == "zero stage":
        ZeroOptimizer(mlp().parameters(), torch.optim.SGD, stage=2 if odd else 1, lr=0.1)
    elif case == "zero lr":
        ZeroOptimizer(mlp().parameters(), torch.optim.SGD, stage=1, lr=0.2 if odd else 0.1)
    elif case == "tp width":
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        parallelize_module(mlp(32 if odd else 16), plan)
    elif case == "tp plan":
        last = RowwiseParallel(output_layout="sequence" if odd else "replicate")
        parallelize_module(mlp(), {"0": ColwiseParallel(), "2": last})
    elif case == "all alike":
        DistributedDataParallel(mlp())
        model = mlp()
        fully_shard(model)
        ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        ZeroOptimizer(mlp().parameters(), torch.optim.SGD, stage=2, lr=0.1)
        parallelize_module(mlp(), {"0": ColwiseParallel(), "2": RowwiseParallel()})


CASES = ("ddp width", "ddp bucket", "fsdp units", "zero stage", "zero lr", "tp width",
         "tp plan", "all alike")


def every_case(rank, world, device, log):
    out = {}
    for case in CASES:
        t0 = time.perf_counter()
        try:
            build(case, rank)
            out[case] = {"error": None}
        except RanksDisagree as e:
            out[case] = {"error": str(e)}
        out[case]["seconds"] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="module")
def launched():
    return run_ranks(every_case, WORLD, timeout_s=30)


# case -> the words its error must hold: the owner, the setting, each side's value
EXPECTED = {
    "ddp width": ["distlab.DistributedDataParallel", "parameters", "'0.weight', (16, 8)",
                  "'0.weight', (32, 8)"],
    "ddp bucket": ["distlab.DistributedDataParallel", "bucket_mb: 25.0 on ranks", "1.0 on rank"],
    "fsdp units": ["distlab.fully_shard", "units", "'2'", "'0'"],
    "zero stage": ["distlab.ZeroOptimizer", "stage", "1 on ranks", "2 on rank"],
    "zero lr": ["distlab.ZeroOptimizer", "param group 0's settings", "'lr': 0.1", "'lr': 0.2"],
    "tp width": ["distlab.parallelize_module", "parameters", "(16, 8)", "(32, 8)"],
    "tp plan": ["distlab.parallelize_module", "plan", "output_layout='replicate'",
                "output_layout='sequence'"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(EXPECTED))
def test_every_rank_names_the_difference_and_the_ranks(launched, case):
    others = ", ".join(str(r) for r in range(WORLD) if r != ODD)
    for rank, out in enumerate(launched):
        msg = out[case]["error"]
        assert msg is not None, f"rank {rank}: {case} was built without an error"
        for words in EXPECTED[case] + [f"on ranks {others}", f"on rank {ODD}"]:
            assert words in msg, f"rank {rank}, {case}: {words!r} not in {msg!r}"
        assert msg == launched[0][case]["error"]  # every rank says the same
        # one all_gather_object of a few KiB: measured 6-25 ms on 4 ranks; 10 s is a hang's
        # bound, not a speed target
        assert out[case]["seconds"] < 10


@pytest.mark.slow
def test_ranks_built_alike_pass(launched):
    assert [out["all alike"]["error"] for out in launched] == [None] * WORLD



# -- a step count mismatch ---------------------------------------------------------------------
def one_more_step(rank, world, device, log, wrapper):
    """Rank 1 runs one step more than rank 0 (the loop's end condition differs)."""
    import torch.nn.functional as F

    from distlab import PipelineSchedule
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    if wrapper == "PipelineSchedule":
        torch.manual_seed(0)
        stage = nn.Linear(8, 8) if rank == 0 else nn.Linear(8, 4)
        sched = PipelineSchedule(stage, "1f1b", 2, F.mse_loss, n_stages=2)
        step = lambda: sched.step(x if rank == 0 else None, y if rank == 1 else None)  # noqa
    else:
        model = mlp()
        if wrapper == "DistributedDataParallel":
            model = DistributedDataParallel(model)
        elif wrapper == "ZeroOptimizer":
            opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1)
        else:
            fully_shard(model)
        step = lambda: F.mse_loss(model(x), y).backward()  # noqa: E731
    for _ in range(2 + rank):
        step()
        if wrapper == "ZeroOptimizer":
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("wrapper, owner", [
    ("DistributedDataParallel", "DistributedDataParallel"), ("ZeroOptimizer", "ZeroOptimizer"),
    ("fully_shard", "fully_shard"), ("PipelineSchedule", "PipelineSchedule")])
def test_a_rank_that_runs_one_more_step_is_reported_as_a_step_mismatch(wrapper, owner):
    """Before, gloo's bare 'Connection closed by peer' (or a timeout) named no cause; now the
    failing collective says which step each rank began (distlab.step_ledger). And it comes
    within seconds, not at the group's timeout (10 minutes here): rank 0, done, waits in the
    launcher's closing barrier and says so; rank 1's collective reads that and ends (its
    sends and receives, PipelineSchedule's, are published for rank 0 to read instead)."""
    t0 = time.perf_counter()
    with pytest.raises(RunError) as e:
        run_ranks(one_more_step, 2, wrapper, timeout_s=600)
    seconds = time.perf_counter() - t0
    said = str(e.value)
    assert "ranks are at different steps" in said, said[:2000]
    assert f"rank 0 began {owner} step 2" in said and f"rank 1 began {owner} step 3" in said
    if wrapper in ("PipelineSchedule", "ZeroOptimizer"):  # rank 1 blocks in a receive (rank
        # 0's activations) or in gloo's reduce-scatter, which it publishes for rank 0 to read
        what = "recv from rank 0" if wrapper == "PipelineSchedule" else "reduce_scatter on ranks 0,1"
        assert e.value.rank == 0 and (f"rank 1 waits in {what} (its last step began: {owner} "
                                      "step 3), which needs this rank, and this rank has left "
                                      f"its loop (its last step began: {owner} step 2)") in said
    else:
        assert e.value.rank == 1 and ("rank 0 finished its run (its last step began: "
                                      f"{owner} step 2)") in said, said[:2000]
    assert seconds < 30, seconds  # measured 1-4 s


def rows_per_rank(rank, world, device, log, uneven):
    """DDP over 3 steps; rank r feeds 4 + 2r rows when uneven (a random split, a last batch)."""
    import warnings

    import torch.nn.functional as F
    model = DistributedDataParallel(mlp())
    rows = 4 + 2 * rank if uneven else 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            F.mse_loss(model(torch.randn(rows, 8)), torch.randn(rows, 4)).backward()
    return [str(w.message) for w in caught if "different numbers of rows" in str(w.message)]


def test_ranks_that_feed_different_rows_to_ddp_are_told_once():
    """Before: silent (each rank's mean weighs the same, whatever its rows). Now every rank
    warns once, naming the rows; equal rows say nothing."""
    said = run_ranks(rows_per_rank, 2, True, timeout_s=30)
    assert [len(s) for s in said] == [1, 1], said
    assert "rank 0 4, rank 1 6" in said[0][0] and "rank 1 6, rank 0 4" in said[1][0], said
    assert "DistributedSampler with drop_last=True" in said[0][0]
    assert run_ranks(rows_per_rank, 2, False, timeout_s=30) == [[], []]


def uneven_rows_unwatched(rank, world, device, log):
    import torch.nn.functional as F
    model = DistributedDataParallel(mlp())
    rows = 4 + 2 * rank
    F.mse_loss(model(torch.randn(rows, 8)), torch.randn(rows, 4)).backward()


def test_a_ranks_warning_reaches_the_caller():
    """distlab's warnings in a rank become the Run's problems: the caller is warned too, not
    only the rank's stderr file."""
    with pytest.warns(RuntimeWarning, match="rank 1: ranks fed different numbers of rows"):
        run_ranks(uneven_rows_unwatched, 2, timeout_s=30)
