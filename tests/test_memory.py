"""Measured memory (distlab.memory): the per-category bytes, the activation meter, and the
per-step peak of aten allocations that stands in for torch.cuda.max_memory_allocated on CPU.

Every check is on exact byte counts of tensors whose sizes we chose (no tolerance: these are
counts, not timings). The tracker's step-time cost is measured by
benchmarks/memory_checkpointing.py, not asserted here (timings on a shared 2-core box vary).
"""

import gc

import pytest
import torch

from distlab import Run, RunConfig, run_ranks
from distlab.data.dataset import make_data
from distlab.memory import (PEAK_LABEL, ActivationMeter, PeakMemoryTracker, count_saved,
                            model_state_bytes)
from distlab.rank.train import train_with_state
from distlab.rank.build import build_model, build_optimizer

MB4 = 2**20  # a (2**18,) float32 tensor


def test_tracker_counts_new_storages_and_frees_them():
    tracker = PeakMemoryTracker()
    with tracker:
        a = torch.ones(2**18)  # 1 MiB
        assert tracker.current == MB4
        v = a.view(512, 512).t()  # views: no new storage
        a.add_(1.0)  # in place: no new storage
        b = a * 2  # 1 MiB more
        assert tracker.current == 2 * MB4 and tracker.peak == 2 * MB4
        del b
        gc.collect()
        assert tracker.current == MB4  # freed through the storage's weakref
        c = torch.empty(2**17)  # 0.5 MiB
        assert tracker.peak == 2 * MB4 and tracker.current == MB4 + MB4 // 2
    del v, c
    d = a.clone()  # outside the mode: not seen
    assert tracker.current == MB4
    del a
    gc.collect()
    assert tracker.current == 0  # freed after the mode ended: still taken off
    tracker.reset_peak()
    assert tracker.peak == 0
    del d


def test_tracker_adopts_existing_tensors_and_tracks_steps():
    w = torch.zeros(2**18)
    tracker = PeakMemoryTracker()
    tracker.adopt([w, w, w.view(-1)])  # one storage, counted once
    assert tracker.current == MB4
    tracker.step_begin()
    tmp = w + 1
    del tmp
    assert tracker.step_end() == 2 * MB4
    tracker.step_begin()  # a new step starts its peak from what is live now
    assert tracker.step_end() == MB4
    assert torch.ones(3) is not None and tracker.current == MB4  # mode left: not tracked


def test_tracker_multiple_returns_and_lists():
    tracker = PeakMemoryTracker()
    x = torch.randn(64, 32)
    with tracker:
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, [32], None, None, 1e-5)
        assert tracker.current == (64 * 32 + 64 + 64) * 4
        parts = torch.split(out, 16)  # views of `out`
        copies = [p.clone() for p in parts]
    assert tracker.current == (64 * 32 * 2 + 128) * 4
    assert len(copies) == 4 and len(parts) == 4 and mean.shape == rstd.shape


def test_training_step_peak_against_categories():
    """One real step of our GPT with AdamW: the peak holds the parameters with the saved
    activations (end of forward) and the parameters, gradients and optimizer state together
    (optimizer step); what stays live afterwards is those three (plus the batch)."""
    cfg = RunConfig(global_batch=8, seq_len=16, n_layer=2, n_embd=32, n_head=2)
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = build_optimizer(cfg, model.parameters())
    meter, tracker = ActivationMeter(model), PeakMemoryTracker()
    tracker.adopt(model.parameters())
    x, y = make_data(cfg).rank_batch(0, cfg.global_batch, 0, 1)
    tracker.step_begin(x, y)
    with meter.measure():
        loss = model(x, y)
    after_forward = tracker.current
    loss.backward()
    opt.step()
    peak = tracker.step_end()
    states = model_state_bytes(model, opt)
    batch = x.untyped_storage().nbytes()  # x and y are views of one (rows, s+1) array
    assert after_forward >= states["params"] + meter.bytes
    assert peak >= states["params"] + states["grads"] + states["optim"] + batch
    del loss
    gc.collect()
    assert tracker.current == states["params"] + states["grads"] + states["optim"] + batch
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert tracker.current == states["params"] + states["optim"] + batch


def test_activation_meter_counts_each_storage_once_and_skips_parameters():
    lin = torch.nn.Linear(256, 256, bias=False)
    meter = ActivationMeter(lin)
    x = torch.randn(4, 256, requires_grad=True)
    with meter.measure():
        h = lin(x)  # saves x (4 KiB) and the weight (a parameter: not counted)
        e = h.exp()  # saves its result (4 KiB)
        e.view(-1).sin()  # saves a view of e: the same storage
        count_saved(e)  # what selective checkpointing reports: already seen
    assert meter.bytes == 2 * 4 * 256 * 4
    count_saved(torch.ones(10))  # no meter measuring: ignored
    assert meter.bytes == 2 * 4 * 256 * 4


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One single-process launch: the same short run with the tracker off and on."""
    base = RunConfig(steps=3, global_batch=8, seq_len=16, n_layer=2, n_embd=32, n_head=2)
    run_dir = str(tmp_path_factory.mktemp("memory-runs"))
    cfgs = [base, base.replace(track_peak=True)]
    run_ranks(train_with_state, 1, [c.to_dict() for c in cfgs], run_dir=run_dir, timeout_s=60)
    run = Run.load(run_dir)
    return run.history("start"), run.history("step")


def test_train_reports_the_peak_when_asked(launched):
    starts, steps = launched
    assert [s.get("peak_memory") for s in starts] == [None, PEAK_LABEL]
    off, on = steps[:3], steps[3:]
    assert all("peak" not in e["memory"] for e in off)
    for e_off, e_on in zip(off, on):
        mem = e_on["memory"]
        # the categories are unchanged by tracking, and the peak covers them
        assert {k: v for k, v in mem.items() if k not in ("peak", "allocated")} == \
            e_off["memory"]
        assert mem["peak"] >= mem["params"] + mem["grads"] + mem["optim"]
        assert mem["peak"] >= mem["params"] + mem["activations"]
        assert mem["allocated"] >= mem["params"] + mem["grads"] + mem["optim"]
    assert e_on["loss"] == e_off["loss"]  # tracking only watches


def test_activation_meter_counts_autocast_weight_copies_apart():
    """Under bf16 autocast a Linear saves its input cast to bf16 (an activation: the cast of a
    leaf that is not a parameter counts too) and the bf16 copy autocast made of its weight (a
    cast of a parameter, 2 bytes per weight whatever the batch): counted in param_cast_bytes."""
    lin = torch.nn.Linear(256, 128, bias=False)
    meter = ActivationMeter(lin)
    x = torch.randn(4, 256, requires_grad=True)
    with meter.measure(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(x)
        h.float().exp()  # exp is not on CPU autocast's lists: fp32; it saves its result
    assert meter.param_cast_bytes == 128 * 256 * 2
    assert meter.by_dtype == {"bfloat16": 4 * 256 * 2, "float32": 4 * 128 * 4}
    assert meter.bytes == sum(meter.by_dtype.values())
    with meter.measure():  # fp32: no copies (the weight itself is a parameter); x, exp's result
        lin(x).exp()
    assert (meter.param_cast_bytes, meter.by_dtype) == (0, {"float32": (4 * 256 + 4 * 128) * 4})
