"""Bad data, caused on purpose, under the public wrappers in a loop of your own. Each test
asserts the text of the warning or error (the rank, the step, the module or layer, the counts or
shapes), how long it took, and that no process is left:

  a NaN row on one rank under DistributedDataParallel   off (torch's default): every parameter
                                                        of every rank NaN, silent; detect_nan=True:
                                                        NonFiniteError naming rank 1, step 5, '(input)'
  a NaN made by one module on one rank, fully_shard     detect_nan=True: rank 1, step 5, module '0'
  rows dropped inside forward, a different number       ddp: a warning, once, naming each rank's
  on each rank                                          kept rows of those fed; none when equal
                                                        tp (default: checked at each layer's calls
                                                        1, 2, 4, ...): a ValueError naming the
                                                        RowwiseParallel layer and both shapes at
                                                        the first forward, before gloo aborts

Data that differs by rank before the model (rows fed, NaN in a launched run's batch):
tests/test_agree.py and tests/test_adversarial.py.
"""

import time

import pytest
import torch
from test_process_safety import assert_all_gone
from torch import nn

from distlab import RunError, run_ranks

NAN_STEP = 5  # the step (from 1) whose batch holds the NaN, on rank 1


def _launch(fn, *args):
    """run_ranks(fn, 2, *args); (results or the RunError, seconds, the ranks' pids)."""
    seen = {}
    t0 = time.perf_counter()
    try:
        out = run_ranks(fn, 2, *args, timeout_s=10, on_start=lambda run: seen.update(run=run))
    except RunError as e:
        out = e
    return out, time.perf_counter() - t0, seen["run"].pids


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


class Log(nn.Module):
    """log(x): NaN for a negative entry, which the batch never has but once, on rank 1."""

    def forward(self, x):
        return torch.log(x)


def _batch(rank, step):
    """Rows of 8 features; at NAN_STEP rank 1's first row holds a NaN (the ddp scenario)."""
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def nan_under_ddp(rank, world, device, log, detect):
    import distlab
    model = distlab.DistributedDataParallel(_mlp(), detect_nan=detect)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, NAN_STEP + 2):
        x, y = _batch(rank, step)
        if rank == 1 and step == NAN_STEP:
            x[0, 0] = float("nan")
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [int(torch.isnan(p).sum()) for p in model.parameters()]


def nan_under_fsdp(rank, world, device, log):
    import distlab
    model = nn.Sequential(Log(), nn.Linear(8, 4))
    distlab.fully_shard(model, detect_nan=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, NAN_STEP + 2):
        x, y = _batch(rank, step)
        x = x.abs() + 1
        if rank == 1 and step == NAN_STEP:
            x[0, 0] = -1.0  # finite, so not '(input)'; Log makes the NaN
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.slow
def test_a_nan_row_on_one_rank_is_silent_by_default_and_named_with_detect_nan():
    nans, took, pids = _launch(nan_under_ddp, False)
    assert not isinstance(nans, RunError), nans
    numel = [p.numel() for p in _mlp().parameters()]
    assert nans == [numel, numel], nans  # before and still by default: all NaN, no error
    assert_all_gone(pids)

    err, took, pids = _launch(nan_under_ddp, True)
    assert isinstance(err, RunError), err
    assert err.rank == 1, err
    assert (f"non-finite values on rank 1 at step {NAN_STEP} in forward: first in module "
            "'(input)' (the batch this rank fed the model: 1 NaN") in err.message, err.message
    assert took < 30, took
    assert_all_gone(pids)


@pytest.mark.slow
def test_a_nan_made_by_one_module_under_fully_shard_names_rank_step_and_module():
    err, took, pids = _launch(nan_under_fsdp)
    assert isinstance(err, RunError), err
    assert err.rank == 1, err
    assert (f"non-finite values on rank 1 at step {NAN_STEP} in forward: first in module '0' "
            "(Log output: 1 NaN") in err.message, err.message
    assert took < 30, took
    assert_all_gone(pids)


class DropRows(nn.Module):
    """Drops `drop` of its rows between its two Linears: inside forward, unseen by the caller."""

    def __init__(self, drop):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 4), drop

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h[:len(h) - self.drop])


def rows_dropped_inside_forward(rank, world, device, log):
    """ddp: rank r drops r rows of 8 (then none: equal); tp: rank r drops r rows before fc2.
    Returns what each said: the ddp warnings per case, and the tp error."""
    import warnings

    import distlab
    said = {}
    for case, drop in (("uneven", rank), ("even", 1)):
        torch.manual_seed(0)
        model = distlab.DistributedDataParallel(DropRows(drop))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                model(torch.randn(8, 8)).pow(2).mean().backward()
        said[case] = [str(w.message) for w in caught if "kept different" in str(w.message)]
    torch.manual_seed(0)
    tp = distlab.parallelize_module(DropRows(rank), {"fc1": distlab.ColwiseParallel(),
                                                     "fc2": distlab.RowwiseParallel()})
    try:
        tp(torch.randn(5, 8, generator=torch.Generator().manual_seed(0)))
        said["tp"] = "no error"
    except ValueError as e:
        said["tp"] = str(e)
    return said


@pytest.mark.slow
def test_rows_dropped_inside_forward_are_warned_under_ddp_and_named_under_tp():
    said, took, pids = _launch(rows_dropped_inside_forward)
    assert not isinstance(said, RunError), said
    for rank in (0, 1):
        assert len(said[rank]["uneven"]) == 1, said  # once, not every step
        assert ("kept different numbers of rows in DistributedDataParallel step 1 (dim 0 of "
                "the output, of the rows fed): rank 0 8 of 8, rank 1 7 of 8"
                in said[rank]["uneven"][0]), said
        assert said[rank]["even"] == [], said
        assert ("the partial output of RowwiseParallel 'fc2' (its sum is all-reduced) has a "
                "different shape on each rank: (5, 4) on rank 0, (4, 4) on rank 1"
                in said[rank]["tp"]), said
    assert took < 30, took
    assert_all_gone(pids)


def test_gloos_size_mismatch_abort_is_explained():
    """Without check_shapes gloo aborts the rank from its own thread (no Python error); the
    launcher's RunError for that SIGABRT reads gloo's line in the rank's stderr and says what
    it means and how to have the layer named (the run this line came from: DropRows under tp
    with check_shapes off, measured once by hand)."""
    from distlab.caller.run import _size_mismatch_hint
    line = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  "
            "[enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:"
            "456] op.preamble.length <= op.nbytes. 20 vs 16. Received data size doesn't match "
            "expected size. Is there a distributed collective mismatch in your code?")
    hint = _size_mismatch_hint(line)
    assert "a message of 20 bytes for this rank's buffer of 16" in hint, hint
    assert "tensors of different sizes" in hint
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in hint and "check_shapes=True" in hint
    assert _size_mismatch_hint("Connection closed by peer") == ""
